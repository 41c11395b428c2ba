"""Quantized experts inside a transformers model: :func:`quantize_experts` and :func:`dequantize_experts`.

transformers loads a gpt-oss checkpoint's MXFP4 experts as bf16 unless OpenAI's triton_kernels (through the
``kernels`` package) is installed: it dequantizes them at load time. Those bf16 values are exactly MXFP4 values,
so :func:`quantize_experts` gives each experts module its checkpoint's MXFP4 weights back (the same values: e2m1
codes and e8m0 scales may pair differently, the products do not), drops the float copy, and runs the experts
through fusedmoe's MXFP4 kernels under the ``"fusedmoe_quant"`` experts implementation (a name of its own, so a
model compiled before the switch recompiles). The fp8 modes with dynamic activation scales quantize any float
experts (not exact: a lossy cast, for trying fp8 on a bf16 model).

A quantized module holds, as non-persistent buffers (not in ``state_dict``), the weights in fusedmoe's layout
and their scales: ``fusedmoe_w1`` [E, 2I, H] (MXFP4: [E, 2I, H/2]), ``fusedmoe_w2``, ``fusedmoe_w1_scale``,
``fusedmoe_w2_scale``, stored as integer views (uint8 / int32) so that ``model.to(dtype)`` moves them between
devices without casting them. The biases stay the module's own parameters (read on every call). Its
``gate_up_proj`` / ``down_proj`` become empty parameters unless ``keep_float_weights``: the model then runs its
experts only through fusedmoe, and its ``state_dict`` holds those two as empty tensors, so save the model before
quantizing it (or after :func:`dequantize_experts`). Quantized experts do not train: a forward that needs a
gradient through them raises GradientNotSupportedError.
"""

from __future__ import annotations

import torch
from torch import nn

from ..quant import QuantConfig, dequantize_weight, quantize_weights, quantized_layout
from . import hf
from .convert import fused_to_gpt_oss, gpt_oss_to_fused
from .hf_quantized import (
    _BIAS_CACHE_ATTR,
    _BUFFERS,
    QUANTIZED_ATTR,
    _biases,
    _quantized_tensors,
    is_quantized,
    run_quantized_experts,
)
from .hf_support import SERVED_DTYPES, experts_unsupported

__all__ = [
    "QUANTIZED_ATTR",
    "QUANTIZED_IMPLEMENTATION",
    "dequantize_experts",
    "is_quantized",
    "quantize_experts",
    "run_quantized_experts",
]

#: The experts implementation a quantized model runs (the same function as "fusedmoe", under its own name).
QUANTIZED_IMPLEMENTATION = "fusedmoe_quant"
#: What quantize_experts changed on a module besides the buffers: QuantConfig, the float weights'
#: requires_grad flags (restored by dequantize_experts).
_GRAD_FLAGS_ATTR = "_fusedmoe_float_requires_grad"


def _float_weights(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1 [E, 2I, H], w2 [E, H, I]) of a float experts module in fusedmoe's layout (gpt-oss's converted)."""
    with torch.no_grad():
        if getattr(experts, "is_transposed", False):
            params = (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias)
            w1, _, w2, _ = gpt_oss_to_fused(*params)
            return w1, w2
        return experts.gate_up_proj, experts.down_proj


def _module_problem(experts: nn.Module, q: QuantConfig) -> tuple[type[Exception], str] | None:
    """(error type, reason) when ``experts`` cannot be quantized to ``q``, else None."""
    reason = experts_unsupported(experts)
    if reason is None and getattr(experts, "_is_expert_parallel", False):
        reason = "experts sharded by transformers' expert parallelism are not quantized"
    if reason is not None:
        return NotImplementedError, reason
    if is_quantized(experts):
        return TypeError, f"already quantized ({experts.__dict__[QUANTIZED_ATTR].name})"
    w = experts.gate_up_proj
    if w.dtype not in SERVED_DTYPES:
        return TypeError, f"expert weights of dtype {w.dtype} (float32, float16 or bfloat16 expected)"
    if w.is_meta or "_hf_hook" in experts.__dict__:
        return NotImplementedError, "weights on the meta device or behind an accelerate hook (load them first)"
    # gate_up_proj: gpt-oss [E, H, 2I] (transposed), else [E, 2I, H]
    E, H, I = (
        (w.shape[0], w.shape[1], w.shape[2] // 2)
        if experts.is_transposed
        else (w.shape[0], w.shape[2], w.shape[1] // 2)
    )
    try:
        quantized_layout(q, E, H, I)
    except ValueError as err:
        return ValueError, str(err)
    return None


def quantize_experts(model: nn.Module, quant: QuantConfig | str = "mxfp4", *, keep_float_weights: bool = False) -> int:
    """Hold the weights of every experts module of ``model`` in fusedmoe's ``quant`` mode and select the
    ``"fusedmoe_quant"`` experts implementation; returns how many modules were quantized.

    Args:
        model: a transformers (>= 5) model whose experts modules fusedmoe computes (standard layout or gpt-oss's),
            loaded (not on the meta device) and not patched by :func:`fusedmoe.integrations.hf.patch_model`.
        quant: "mxfp4" (weight-only FP4, gpt-oss's format; exact for experts dequantized from MXFP4) or an fp8
            mode with dynamic activation scales ("fp8_tensor", "fp8_token", "fp8_block").
        keep_float_weights: keep ``gate_up_proj`` / ``down_proj`` as they are (the float copy stays in memory);
            by default they become empty parameters.

    Raises (nothing is changed then):
        ValueError: an unknown mode, static activation scales (which need calibrated ``a*_scale``), or sizes the
            mode cannot hold (MXFP4: H and I multiples of 32), naming the module.
        NotImplementedError: a patched model, a model without experts modules, or an experts module fusedmoe
            cannot compute (named, with why).
        TypeError: a module already quantized, or experts that are not float32/float16/bfloat16.
    """
    q = QuantConfig.parse(quant)
    if q is None or q.static_activation_scale:
        raise ValueError(f"quant must be 'mxfp4' or an fp8 mode with dynamic activation scales, got {quant!r}")
    if hf.patched_blocks(model):
        raise NotImplementedError(
            "quantize_experts: the model is patched (patch_model), whose FusedMoE layers read the float experts; "
            "unpatch_model first"
        )
    named = hf._named_experts(model)
    if not named:
        raise NotImplementedError(
            f"quantize_experts: {type(model).__name__} has no transformers experts module "
            "(@use_experts_implementation) to quantize"
        )
    problems = [
        (p[0], f"{n or '<model>'} ({type(e).__name__}): {p[1]}") for n, e in named if (p := _module_problem(e, q))
    ]
    if problems:
        kinds = {kind for kind, _ in problems}
        kind = kinds.pop() if len(kinds) == 1 else NotImplementedError
        lines = "\n  ".join(text for _, text in problems)
        raise kind(f"quantize_experts cannot quantize these experts modules (nothing was changed):\n  {lines}")
    hf.register(QUANTIZED_IMPLEMENTATION)
    done = []
    try:  # the float weights are dropped only once every module is quantized and the implementation selected
        for _, experts in named:
            _quantize_module(experts, q)
            done.append(experts)
        if named and hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation(QUANTIZED_IMPLEMENTATION)
    except BaseException:  # out of memory half way, or a refused selection: the modules as they were
        for experts in done:
            _unquantize_module(experts)
        raise
    if not keep_float_weights:
        for _, experts in named:
            for name in ("gate_up_proj", "down_proj"):
                old = getattr(experts, name)
                setattr(experts, name, nn.Parameter(old.new_empty(0), requires_grad=False))
    model.__dict__.pop("_compiled_call", None)  # transformers' cached compiled forward (generate's static cache)
    return len(named)


def _quantize_module(experts: nn.Module, q: QuantConfig) -> None:
    w1, w2 = _float_weights(experts)
    with torch.no_grad():
        if q.mode == "mxfp4":  # re-laid for the tensor cores where that layout holds the scales (up to 2^1)
            from ..mxfp4_layout import holds_scales, to_mma_layout

            tensors, q = quantize_weights(w1, w2, QuantConfig("mxfp4")), QuantConfig("mxfp4")
            if holds_scales(tensors[2]) and holds_scales(tensors[3]):
                v1, s1 = to_mma_layout(tensors[0], tensors[2], gated=True)
                v2, s2 = to_mma_layout(tensors[1], tensors[3], gated=False)
                tensors, q = (v1, v2, s1, s2), QuantConfig("mxfp4", layout="mma")
        else:
            tensors = quantize_weights(w1, w2, q)
    for name, t in zip(_BUFFERS, tensors):
        storage = torch.int32 if t.dtype == torch.float32 else torch.uint8  # a view model.to(dtype) leaves alone
        experts.register_buffer(name, t.view(storage), persistent=False)
    experts.__dict__[_GRAD_FLAGS_ATTR] = (experts.gate_up_proj.requires_grad, experts.down_proj.requires_grad)
    experts.__dict__[QUANTIZED_ATTR] = q
    experts.__dict__.pop(hf._CACHE_ATTR, None)  # gpt-oss's converted float copy, if inference made one
    experts.__dict__.pop("_fusedmoe_verdicts", None)
    experts.__dict__.pop(_BIAS_CACHE_ATTR, None)


def dequantize_experts(model: nn.Module) -> int:
    """Undo :func:`quantize_experts` on every quantized experts module, returning how many: the float weights
    it kept (``keep_float_weights``) stay as they are; emptied ones become the dequantized values, in the dtype
    the model has now, with the ``requires_grad`` they had. The quantized buffers are removed and the model's
    experts implementation becomes ``"fusedmoe"`` (float)."""
    quantized = [e for _, e in hf._named_experts(model) if is_quantized(e)]
    for experts in quantized:
        _unquantize_module(experts)
    if quantized and hasattr(model, "set_experts_implementation"):
        hf.register()
        model.set_experts_implementation(hf.EXPERTS_IMPLEMENTATION)
    model.__dict__.pop("_compiled_call", None)
    return len(quantized)


def _unquantize_module(experts: nn.Module) -> None:
    q = experts.__dict__[QUANTIZED_ATTR]
    if experts.gate_up_proj.numel() == 0:  # emptied: the dequantized values back
        dtype = experts.gate_up_proj.dtype  # follows model.to(dtype)
        w1q, w2q, s1, s2 = _quantized_tensors(experts)
        H, I = (16 * w2q.shape[1], 8 * w1q.shape[1]) if q.layout == "mma" else (None, None)  # the layout pads K
        w1 = dequantize_weight(w1q, s1, q, dtype, K=H, gated=True)
        w2 = dequantize_weight(w2q, s2, q, dtype, K=I)
        if getattr(experts, "is_transposed", False):
            b1, b2 = _biases(experts)
            gate_up, _, down, _ = fused_to_gpt_oss(w1, b1, w2, b2)
        else:
            gate_up, down = w1, w2
        grads = experts.__dict__[_GRAD_FLAGS_ATTR]
        experts.gate_up_proj = nn.Parameter(gate_up.contiguous(), requires_grad=grads[0])
        experts.down_proj = nn.Parameter(down.contiguous(), requires_grad=grads[1])
    for name in _BUFFERS:
        delattr(experts, name)
    for attr in (QUANTIZED_ATTR, _GRAD_FLAGS_ATTR, "_fusedmoe_verdicts", _BIAS_CACHE_ATTR):
        experts.__dict__.pop(attr, None)
