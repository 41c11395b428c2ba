"""Weights from transformers models and checkpoints into :class:`fusedmoe.FusedMoE`: :func:`from_hf` and
:func:`from_hf_state_dict`.

The work is done in :mod:`fusedmoe.integrations.convert` (layouts understood, configs read, the layer built),
which takes the layer class as an argument; here it defaults to ``FusedMoE``. The conversions are re-exported,
so ``fusedmoe.integrations.loading`` stays the one place to import them from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from ..layer import FusedMoE
from .convert import (
    HF_ACTIVATIONS,
    SUPPORTED_MODEL_TYPES,
    build_from_hf,
    build_from_hf_state_dict,
    checkpoint_quant,
    convert_hf_state_dict,
    fused_to_gpt_oss,
    gate_then_up,
    gpt_oss_to_fused,
    hf_activation,
    layer_kwargs,
    load_safetensors,
    per_expert_to_fused,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "checkpoint_quant",
    "convert_hf_state_dict",
    "from_hf",
    "from_hf_state_dict",
    "fused_to_gpt_oss",
    "gate_then_up",
    "gpt_oss_to_fused",
    "hf_activation",
    "HF_ACTIVATIONS",
    "layer_kwargs",
    "load_safetensors",
    "per_expert_to_fused",
]


def from_hf_state_dict(
    state_dict: Mapping[str, torch.Tensor] | str | os.PathLike,
    config,
    *,
    prefix: str = "",
    cls=None,
    device=None,
    dtype=None,
    **kwargs,
):
    """A FusedMoE holding one MoE block's weights from a state dict (or safetensors path(s)) and its config.

    ``prefix`` selects the block (e.g. ``"model.layers.3.mlp."``). ``dtype`` / ``device`` default to the
    tensors' (for quantized experts: the router's dtype; the experts stay as the checkpoint stores them, MXFP4 or
    fp8 blocks, :func:`checkpoint_quant`). Extra ``kwargs`` go to the FusedMoE constructor (``workspace``,
    ``backend``, ...). ``cls``: the layer class (default ``FusedMoE``).
    """
    cls = FusedMoE if cls is None else cls
    return build_from_hf_state_dict(cls, state_dict, config, prefix=prefix, device=device, dtype=dtype, **kwargs)


def from_hf(module: nn.Module, *, cls=None, config=None, share_weights: bool = True, **kwargs):
    """A FusedMoE equivalent to a transformers MoE block (router, experts, shared experts) or experts module.

    With an experts module alone the router weight is left at zero: route outside and pass ``router_logits``.
    ``share_weights``: use the module's tensors (no copy) where the layouts agree (all but gpt-oss's experts
    and the concatenated shared-expert gate/up); otherwise copy. Extra ``kwargs`` go to the constructor.
    ``cls``: the layer class (default ``FusedMoE``).
    """
    cls = FusedMoE if cls is None else cls
    return build_from_hf(cls, module, config=config, share_weights=share_weights, **kwargs)
