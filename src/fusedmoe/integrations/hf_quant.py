"""Quantized experts inside a transformers model: :func:`quantize_experts` and :func:`dequantize_experts`.

transformers loads a gpt-oss checkpoint's MXFP4 experts as bf16 unless OpenAI's triton_kernels (through the
``kernels`` package) is installed: it dequantizes them at load time. Those bf16 values are exactly MXFP4 values,
so :func:`quantize_experts` gives each experts module its checkpoint's MXFP4 weights back (the same values: e2m1
codes and e8m0 scales may pair differently, the products do not), drops the float copy, and runs the experts
through fusedmoe's MXFP4 kernels under ``experts_implementation="fusedmoe"``. The fp8 modes with dynamic
activation scales quantize any float experts (not exact: a lossy cast, for trying fp8 on a bf16 model).

A quantized module holds, as non-persistent buffers (moved by ``.to()``, not in ``state_dict``), fusedmoe's
layout: ``fusedmoe_w1`` [E, 2I, H] (MXFP4: uint8 [E, 2I, H/2]), ``fusedmoe_w2``, their scales and, for gpt-oss,
the biases (gate then up). Its ``gate_up_proj`` / ``down_proj`` become empty parameters unless
``keep_float_weights``: the model then runs its experts only through fusedmoe, does not train them (quantized
calls have no backward: a forward that needs a gradient raises), and its ``state_dict`` no longer holds them
(save the model before quantizing it). :func:`dequantize_experts` puts float weights back.
"""

from __future__ import annotations

import torch
from torch import nn

from ..api import fused_moe
from ..op import fused_moe_op
from ..quant import QuantConfig, dequantize_weight, quantize_weights
from . import hf
from .loading import fused_to_gpt_oss, gpt_oss_to_fused

__all__ = ["QUANTIZED_ATTR", "dequantize_experts", "is_quantized", "quantize_experts", "run_quantized_experts"]

#: Attribute of a quantized experts module: its QuantConfig (and, with it, the buffers below).
QUANTIZED_ATTR = "_fusedmoe_quant"
_BUFFERS = ("fusedmoe_w1", "fusedmoe_w2", "fusedmoe_w1_scale", "fusedmoe_w2_scale", "fusedmoe_w1_bias")
_BUFFERS += ("fusedmoe_w2_bias",)


def is_quantized(experts: nn.Module) -> bool:
    """Whether :func:`quantize_experts` holds ``experts``' weights in a quantized mode."""
    return experts.__dict__.get(QUANTIZED_ATTR) is not None


def _float_weights(experts: nn.Module):
    """(w1, w2, w1_bias, w2_bias) of a float experts module in fusedmoe's layout (gpt-oss's converted)."""
    with torch.no_grad():
        if getattr(experts, "is_transposed", False):
            w1, b1, w2, b2 = gpt_oss_to_fused(
                experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias
            )
            return w1, w2, b1, b2
        b1 = experts.gate_up_proj_bias if getattr(experts, "has_bias", False) else None
        b2 = experts.down_proj_bias if getattr(experts, "has_bias", False) else None
        return experts.gate_up_proj, experts.down_proj, b1, b2


def quantize_experts(model: nn.Module, quant: QuantConfig | str = "mxfp4", *, keep_float_weights: bool = False) -> int:
    """Hold the weights of every experts module of ``model`` in fusedmoe's ``quant`` mode and select fusedmoe
    as the model's experts implementation; returns how many modules were quantized.

    Args:
        model: a transformers (>= 5) model whose experts modules fusedmoe computes (standard layout or gpt-oss's).
        quant: "mxfp4" (weight-only FP4, gpt-oss's format; exact for experts dequantized from MXFP4) or an fp8
            mode with dynamic activation scales ("fp8_tensor", "fp8_token", "fp8_block").
        keep_float_weights: keep ``gate_up_proj`` / ``down_proj`` as they are (double the memory, but the model
            still saves and can be dequantized by hand); by default they become empty parameters.

    Raises:
        ValueError: an unknown mode, or static activation scales (which need calibrated ``a*_scale``).
        NotImplementedError: an experts module fusedmoe cannot compute (named, with the reason); nothing is
            changed then.
        TypeError: a module already quantized, or float64 experts.
    """
    q = QuantConfig.parse(quant)
    if q is None or q.static_activation_scale:
        raise ValueError(f"quant must be 'mxfp4' or an fp8 mode with dynamic activation scales, got {quant!r}")
    named = hf._named_experts(model)
    problems = []
    for name, experts in named:
        reason = hf.experts_unsupported(experts)
        if reason is None and is_quantized(experts):
            reason = f"already quantized ({experts.__dict__[QUANTIZED_ATTR].name})"
        if reason is None and experts.gate_up_proj.dtype not in hf.SERVED_DTYPES:
            reason = f"expert weights of dtype {experts.gate_up_proj.dtype} (float32, float16 or bfloat16 expected)"
        if reason is not None:
            problems.append(f"{name or '<model>'} ({type(experts).__name__}): {reason}")
    if problems:
        kind = TypeError if all("already quantized" in p or "dtype" in p for p in problems) else NotImplementedError
        raise kind(
            "quantize_experts cannot quantize these experts modules (nothing was changed):\n  " + "\n  ".join(problems)
        )
    for _, experts in named:
        _quantize_module(experts, q, keep_float_weights)
    hf.register()
    if named and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(hf.EXPERTS_IMPLEMENTATION)
    return len(named)


def _quantize_module(experts: nn.Module, q: QuantConfig, keep_float_weights: bool) -> None:
    w1, w2, b1, b2 = _float_weights(experts)
    with torch.no_grad():
        w1q, w2q, s1, s2 = quantize_weights(w1, w2, q)
    tensors = (w1q, w2q, s1, s2, b1.detach().clone() if b1 is not None else None)
    tensors += (b2.detach().clone() if b2 is not None else None,)
    for name, t in zip(_BUFFERS, tensors):
        experts.register_buffer(name, t, persistent=False)
    experts.__dict__[QUANTIZED_ATTR] = q
    experts.__dict__["_fusedmoe_float_dtype"] = experts.gate_up_proj.dtype
    experts.__dict__.pop(hf._CACHE_ATTR, None)  # gpt-oss's converted bf16 copy, if inference made one
    experts.__dict__.pop("_fusedmoe_verdicts", None)
    if not keep_float_weights:
        for name in ("gate_up_proj", "down_proj"):
            old = getattr(experts, name)
            setattr(experts, name, nn.Parameter(old.new_empty(0), requires_grad=False))


def dequantize_experts(model: nn.Module) -> int:
    """Undo :func:`quantize_experts` on every quantized experts module, returning how many: the float weights
    it kept (``keep_float_weights``) stay as they are; emptied ones become the dequantized values in the dtype
    they had. The quantized buffers are removed; the experts implementation stays as it is (fusedmoe, in
    float now)."""
    count = 0
    for _, experts in hf._named_experts(model):
        if not is_quantized(experts):
            continue
        if experts.gate_up_proj.numel() == 0:
            _restore_float_weights(experts)
        for name in _BUFFERS:
            delattr(experts, name)
        for attr in (QUANTIZED_ATTR, "_fusedmoe_float_dtype", "_fusedmoe_verdicts"):
            experts.__dict__.pop(attr, None)
        count += 1
    return count


def _restore_float_weights(experts: nn.Module) -> None:
    q, dtype = experts.__dict__[QUANTIZED_ATTR], experts.__dict__["_fusedmoe_float_dtype"]
    w1 = dequantize_weight(experts.fusedmoe_w1, experts.fusedmoe_w1_scale, q).to(dtype)
    w2 = dequantize_weight(experts.fusedmoe_w2, experts.fusedmoe_w2_scale, q).to(dtype)
    if getattr(experts, "is_transposed", False):
        gate_up, _, down, _ = fused_to_gpt_oss(w1, experts.fusedmoe_w1_bias, w2, experts.fusedmoe_w2_bias)
    else:
        gate_up, down = w1, w2
    grads = (experts.gate_up_proj.requires_grad, experts.down_proj.requires_grad)
    experts.gate_up_proj = nn.Parameter(gate_up.contiguous(), requires_grad=grads[0])
    experts.down_proj = nn.Parameter(down.contiguous(), requires_grad=grads[1])


def run_quantized_experts(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts contract for a module :func:`quantize_experts` quantized: [T, H] in hidden's
    dtype. There is no fallback to transformers' code (the float weights are gone): float64 hidden states and
    calls that need a gradient raise TypeError / RuntimeError."""
    q = experts.__dict__[QUANTIZED_ATTR]
    if hidden_states.dtype not in hf.SERVED_DTYPES:
        raise TypeError(
            f"{type(experts).__name__} holds {q.name} experts (quantize_experts): hidden_states must be float32, "
            f"float16 or bfloat16, got {hidden_states.dtype}"
        )
    if top_k_weights.shape != top_k_index.shape:  # dense [T, E] routing weights
        top_k_weights = top_k_weights.gather(1, top_k_index.long())
    run = fused_moe_op if torch.compiler.is_compiling() else fused_moe
    return run(
        hidden_states,
        experts.fusedmoe_w1,
        experts.fusedmoe_w2,
        top_k_weights.float(),
        top_k_index,
        activation=hf._activation_of(experts),
        quant=q,
        w1_scale=experts.fusedmoe_w1_scale,
        w2_scale=experts.fusedmoe_w2_scale,
        w1_bias=experts.fusedmoe_w1_bias,
        w2_bias=experts.fusedmoe_w2_bias,
        workspace=getattr(experts, "_fusedmoe_workspace", None),
        backend=getattr(experts, "_fusedmoe_backend", "auto"),
    )
