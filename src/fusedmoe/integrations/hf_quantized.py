"""An experts module that :func:`fusedmoe.integrations.hf_quant.quantize_experts` quantized: where its quantized
weights live (its :data:`QUANTIZED_ATTR` attribute and the ``fusedmoe_*`` buffers) and its forward,
:func:`run_quantized_experts`.

Shared by :mod:`fusedmoe.integrations.hf` (whose experts forward hands a quantized module here) and
:mod:`fusedmoe.integrations.hf_quant` (which quantizes and restores modules); ``hf_quant`` re-exports the public
names.
"""

from __future__ import annotations

import torch
from torch import nn

from ..api import fused_moe
from ..op import fused_moe_op
from ..quant import FP8_DTYPE
from .convert import gate_then_up
from .hf_support import SERVED_DTYPES, _activation_of, _source_key

__all__ = ["QUANTIZED_ATTR", "is_quantized", "run_quantized_experts"]

#: Attribute of a quantized experts module: its QuantConfig (and, with it, the buffers below).
QUANTIZED_ATTR = "_fusedmoe_quant"
_BUFFERS = ("fusedmoe_w1", "fusedmoe_w2", "fusedmoe_w1_scale", "fusedmoe_w2_scale")


def is_quantized(experts: nn.Module) -> bool:
    """Whether :func:`~fusedmoe.integrations.hf_quant.quantize_experts` holds ``experts``' weights in a quantized
    mode."""
    return experts.__dict__.get(QUANTIZED_ATTR) is not None


#: Attribute of a quantized gpt-oss experts module: (source key, its gate_up_proj_bias in fusedmoe's order).
_BIAS_CACHE_ATTR = "_fusedmoe_gate_then_up_bias"


def _biases(experts: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The module's own bias parameters in fusedmoe's layout. gpt-oss's gate/up interleave is undone once and kept
    (remade when the bias's storage, version, dtype, device or shape changes), not by a torch op per call; while
    autograd records and the bias requires grad, or while compiling, it is undone in the call's own ops."""
    if not getattr(experts, "has_bias", False):
        return None, None
    P = experts._parameters  # by dict: nn.Module's __getattr__ costs ~0.7 us a name per call
    b1, b2 = P.get("gate_up_proj_bias"), P.get("down_proj_bias")
    if b1 is None or b2 is None:  # plain tensors rather than parameters
        b1, b2 = experts.gate_up_proj_bias, experts.down_proj_bias
    if not getattr(experts, "is_transposed", False):
        return b1, b2
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and b1.requires_grad):
        return gate_then_up(b1), b2
    key = _source_key(b1)
    cached = experts.__dict__.get(_BIAS_CACHE_ATTR)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, gate_then_up(b1).contiguous())
        experts.__dict__[_BIAS_CACHE_ATTR] = cached
    return cached[1], b2


def _quantized_tensors(experts: nn.Module) -> tuple[torch.Tensor, ...]:
    """(w1, w2, w1_scale, w2_scale) of a quantized module in the dtypes fused_moe takes (the buffers are views)."""
    q = experts.__dict__[QUANTIZED_ATTR]
    B = experts._buffers
    w1, w2, s1, s2 = (B[n] if n in B else getattr(experts, n) for n in _BUFFERS)
    if q.fp8:
        return w1.view(FP8_DTYPE), w2.view(FP8_DTYPE), s1.view(torch.float32), s2.view(torch.float32)
    return w1, w2, s1, s2


def run_quantized_experts(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts contract for a module :func:`~fusedmoe.integrations.hf_quant.quantize_experts`
    quantized: [T, H] in hidden's dtype. There is no fallback to transformers' code (the float weights may be
    gone): float64 hidden states raise TypeError, calls that need a gradient GradientNotSupportedError."""
    q = experts.__dict__[QUANTIZED_ATTR]
    if hidden_states.dtype not in SERVED_DTYPES:
        raise TypeError(
            f"{type(experts).__name__} holds {q.name} experts (quantize_experts): hidden_states must be float32, "
            f"float16 or bfloat16, got {hidden_states.dtype}"
        )
    if top_k_weights.shape != top_k_index.shape:  # dense [T, E] routing weights
        top_k_weights = top_k_weights.gather(1, top_k_index.long())
    w1, w2, s1, s2 = _quantized_tensors(experts)
    b1, b2 = _biases(experts)
    run = fused_moe_op if torch.compiler.is_compiling() else fused_moe
    return run(
        hidden_states,
        w1,
        w2,
        top_k_weights,  # in transformers' dtype: the kernels read any float dtype and compute in float32
        top_k_index,
        activation=_activation_of(experts),
        quant=q,
        w1_scale=s1,
        w2_scale=s2,
        w1_bias=b1,
        w2_bias=b2,
        workspace=experts.__dict__.get("_fusedmoe_workspace"),
        backend=experts.__dict__.get("_fusedmoe_backend", "auto"),
    )
