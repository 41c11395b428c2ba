"""Which transformers experts modules fusedmoe computes exactly, and with which fusedmoe activation.

Shared by :mod:`fusedmoe.integrations.hf` (the experts implementation, :func:`~fusedmoe.integrations.hf.patch_model`)
and :mod:`fusedmoe.integrations.hf_quantized` (the forward of quantized experts), which both import it; ``hf``
re-exports its public names. transformers is imported only where a check needs it (an optional dependency).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..problem import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from .convert import hf_activation

__all__ = ["SERVED_DTYPES", "act_fn_activation", "experts_unsupported"]

#: Dtypes fusedmoe's kernels compute; other floating models run transformers' own code (with a warning).
SERVED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _activation_of(experts: nn.Module) -> str:
    """The fusedmoe activation of a transformers experts module; NotImplementedError saying why there is none."""
    if type(experts).__name__ == "GptOssExperts":
        if (getattr(experts, "alpha", None), getattr(experts, "limit", None)) != (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT):
            raise NotImplementedError(
                f"gpt-oss swiglu alpha={experts.alpha}, limit={experts.limit} differ from fusedmoe's swigluoai "
                f"(alpha={SWIGLUOAI_ALPHA}, limit={SWIGLUOAI_LIMIT})"
            )
        return "swigluoai"
    from transformers.integrations.moe import _default_apply_gate

    if getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        raise NotImplementedError("a custom gate (_apply_gate) fusedmoe does not implement")
    return _module_activation(experts)


def _module_activation(experts: nn.Module) -> str:
    """The fusedmoe activation of what ``experts.act_fn`` computes (what transformers' gate applies), or of
    ``config.hidden_act`` for a module without one. The module decides, not the config: Gemma-4's experts build
    theirs from ``hidden_activation``, LFM2-MoE's are SiLU whatever ``hidden_act`` says."""
    act_fn = getattr(experts, "act_fn", None)
    hidden_act = getattr(getattr(experts, "config", None), "hidden_act", None)
    if act_fn is None:
        return hf_activation("silu" if hidden_act is None else hidden_act)
    try:
        return act_fn_activation(act_fn)
    except NotImplementedError:
        if hidden_act is None:
            raise
        raise NotImplementedError(_no_kernel(act_fn, f" (hidden_act={hidden_act!r})")) from None


#: transformers / torch activation types -> the fusedmoe activation computing the same function (exact types: a
#: subclass may compute something else). Filled on first use (:func:`_act_kinds`).
_ACT_KINDS: dict[type, str] = {}


def _act_kinds() -> dict[type, str]:
    if not _ACT_KINDS:
        from transformers import activations as a

        kinds = {
            nn.SiLU: "silu",
            "SiLUActivation": "silu",
            "GELUTanh": "gelu",  # gelu_pytorch_tanh, gelu_python_tanh
            "PytorchGELUTanh": "gelu",  # older transformers' name
            "NewGELUActivation": "gelu",
            "FastGELUActivation": "gelu",
            "GELUActivation": "gelu_exact",  # gelu, gelu_python (erf)
        }
        for key, kind in kinds.items():
            cls = getattr(a, key, None) if isinstance(key, str) else key
            if isinstance(cls, type):
                _ACT_KINDS[cls] = kind
    return _ACT_KINDS


def act_fn_activation(act_fn: object) -> str:
    """The fusedmoe activation computing what the callable ``act_fn`` computes (a transformers ``ACT2FN`` module,
    ``nn.SiLU`` / ``nn.GELU``, ``F.silu`` / ``F.gelu``); NotImplementedError naming it when fusedmoe has none."""
    kind = _act_kinds().get(type(act_fn))
    if kind is not None:
        return kind
    if type(act_fn) is nn.GELU:
        return "gelu" if act_fn.approximate == "tanh" else "gelu_exact"
    if act_fn is F.silu:
        return "silu"
    if act_fn is F.gelu:
        return "gelu_exact"
    if isinstance(act_fn, functools.partial) and act_fn.func is F.gelu and not act_fn.args:
        if act_fn.keywords in ({}, {"approximate": "none"}):
            return "gelu_exact"
        if act_fn.keywords == {"approximate": "tanh"}:
            return "gelu"
    raise NotImplementedError(_no_kernel(act_fn))


def _no_kernel(act_fn: object, note: str = "") -> str:
    name = getattr(act_fn, "__name__", type(act_fn).__name__)
    return f"the experts' activation {name}{note} has no fusedmoe kernel (SiLU and GELU have)"


def experts_unsupported(experts: nn.Module) -> str | None:
    """Why fusedmoe cannot compute the transformers experts module ``experts`` exactly, or None when it can.

    Checks what a weight's dtype does not decide: gating, norms, layout, activation. A module that transformers'
    expert parallelism sharded (``_is_expert_parallel``) is computed on its local experts (see
    :func:`fusedmoe.integrations.hf.fusedmoe_experts_forward`)."""
    if getattr(experts, "has_post_expert_norm", False):
        return "post-expert norms are not supported"
    if not getattr(experts, "has_gate", True):
        return "ungated experts are not supported"
    dtype = getattr(getattr(experts, "gate_up_proj", None), "dtype", None)
    if dtype is not None and dtype not in (*SERVED_DTYPES, torch.float64):
        return f"expert weights of dtype {dtype} (quantized) are not supported through transformers"
    standard = getattr(experts, "is_concatenated", True) and not getattr(experts, "is_transposed", False)
    gpt_oss = (
        getattr(experts, "is_transposed", False)
        and not getattr(experts, "is_concatenated", True)
        and getattr(experts, "has_bias", False)
    )
    if not (standard or gpt_oss):
        return "weight layout not supported (concatenated [E, 2I, H] or gpt-oss's interleaved, transposed one)"
    try:
        _activation_of(experts)
    except NotImplementedError as err:
        return str(err)
    return None


def _source_key(*tensors: torch.Tensor) -> tuple:
    """What a copy converted from ``tensors`` depends on: each one's storage, version (in-place writes), dtype,
    device and shape. A kept copy whose key no longer matches is remade."""
    return tuple((t.data_ptr(), t._version, t.dtype, t.device, t.shape) for t in tensors)


def _dtype_unsupported(dtype: torch.dtype) -> str | None:
    if dtype in SERVED_DTYPES:
        return None
    return f"{dtype} is not computed by fusedmoe's kernels (float32, float16, bfloat16); transformers' code runs it"
