"""Reference MoE layer: a float64 loop over experts, written for clarity, not speed.

Every kernel in fusedmoe is compared against :func:`fused_moe_reference` on random inputs.
"""

from __future__ import annotations

import math

import torch

from .problem import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from .quant import QuantConfig


def activation_reference(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """[rows, 2I] -> [rows, I]: silu(gate) * up (SwiGLU), gelu_tanh(gate) * up (GeGLU, "gelu"), gpt-oss's clamped
    SwiGLU ``g * sigmoid(1.702 g) * (u + 1)`` with ``g = min(gate, 7)``, ``u = clamp(up, -7, 7)`` ("swigluoai") or
    ``0.5 g (1 + erf(g / sqrt(2))) * up`` (GeGLU with the exact GELU, "gelu_exact").
    """
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if activation == "silu":
        return gate * torch.sigmoid(gate) * up
    if activation == "gelu":
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * gate * (1.0 + torch.tanh(c * (gate + 0.044715 * gate**3))) * up
    if activation == "swigluoai":
        g = gate.clamp(max=SWIGLUOAI_LIMIT)
        u = up.clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
        return g * torch.sigmoid(SWIGLUOAI_ALPHA * g) * (u + 1.0)
    if activation == "gelu_exact":
        return 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0))) * up
    raise ValueError(f"activation must be 'silu', 'gelu', 'swigluoai' or 'gelu_exact', got {activation!r}")


def fused_moe_reference(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
    quant: QuantConfig | str | None = None,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE layer in float64: ``out[t] = sum_j w[t,j] * W2[e] act(W1[e] x[t])`` over local experts ``e``.

    With biases: ``out[t] = sum_j w[t,j] * (W2[e] act(W1[e] x[t] + b1[e]) + b2[e])`` (with
    ``apply_router_weight_on_input`` the weight scales ``x[t]`` instead and ``b2`` is added unweighted).

    Same arguments as :func:`fusedmoe.fused_moe` minus the workspace ones. Slots whose id is outside
    ``[0, global_num_experts)`` or maps to -1 in ``expert_map`` contribute nothing. With ``quant``, weights are
    dequantized with their scales and (fp8) activations go through the same fp8 rounding as the kernels
    (:func:`fusedmoe.quant.fake_quantize_activation`), so the comparison isolates kernel error.

    Returns:
        float64 tensor [M, H] on hidden_states' device.
    """
    quant = QuantConfig.parse(quant)
    M, H = hidden_states.shape
    E = w1.shape[0]
    global_E = (
        global_num_experts if global_num_experts is not None else (expert_map.shape[0] if expert_map is not None else E)
    )
    x = hidden_states.to(torch.float64)
    ids = topk_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < global_E)
    local = ids.clamp(0, max(global_E - 1, 0))
    if expert_map is not None:
        local = expert_map.to(torch.int64)[local]
        valid &= local >= 0
    else:
        valid &= local < E
    weights = topk_weights.to(torch.float64)
    b1 = w1_bias.to(torch.float64) if w1_bias is not None else None
    b2 = w2_bias.to(torch.float64) if w2_bias is not None else None

    # Activation quantization is modelled as the kernels do it: the input once over all M tokens, GEMM1's
    # output once over every local slot row (a per-tensor dynamic scale spans all experts).
    if quant is not None and quant.fp8:
        x = _fake_quant(x, quant, a1_scale)
    groups = []
    for e in range(E):
        tok, slot = torch.nonzero(valid & (local == e), as_tuple=True)
        if tok.numel() == 0:
            continue
        a = x[tok]
        if apply_router_weight_on_input:
            a = a * weights[tok, slot, None]
        gate_up = a @ _expert_weight(w1, w1_scale, quant, e, K=H, gated=True).T
        if b1 is not None:
            gate_up = gate_up + b1[e]
        groups.append((e, tok, slot, activation_reference(gate_up, activation)))
    if quant is not None and quant.fp8 and groups:
        h_all = _fake_quant(torch.cat([g[3] for g in groups]), quant, a2_scale)
        sizes = [g[3].shape[0] for g in groups]
        groups = [(e, tok, slot, h) for (e, tok, slot, _), h in zip(groups, h_all.split(sizes))]

    out = torch.zeros(M, H, dtype=torch.float64, device=hidden_states.device)
    for e, tok, slot, h in groups:
        y = h @ _expert_weight(w2, w2_scale, quant, e, K=h.shape[1]).T
        if b2 is not None:
            y = y + b2[e]
        if not apply_router_weight_on_input:
            y = y * weights[tok, slot, None]
        out.index_add_(0, tok, y)
    return out


def _expert_weight(
    w: torch.Tensor, scale: torch.Tensor | None, quant: QuantConfig | None, e: int, *, K: int, gated: bool = False
) -> torch.Tensor:
    """Expert ``e``'s weight [N, K] in float64, dequantized with its own scales: one expert at a time, so the
    reference holds one expert's float64 copy, not all E (gpt-oss-120b's W1 alone would take 17 GB). ``K`` and
    ``gated`` (GEMM1's gate-then-up weight) place an mma-layout MXFP4 weight's padded columns and rows."""
    if quant is None:
        return w[e].to(torch.float64)
    from .quant import dequantize_weight

    # every scale layout leads with the expert dimension, except a per-tensor scale shared by all experts
    own = scale if scale.dim() == 0 or scale.shape[0] != w.shape[0] else scale[e : e + 1]
    return dequantize_weight(w[e : e + 1], own, quant, K=K, gated=gated)[0].to(torch.float64)


def _fake_quant(x: torch.Tensor, quant: QuantConfig, static_scale: torch.Tensor | None) -> torch.Tensor:
    from .quant import fake_quantize_activation

    scale = static_scale if quant.static_activation_scale else None
    return fake_quantize_activation(x, quant, scale=scale).to(torch.float64)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in float64; NaN anywhere gives inf (never passes a tolerance)."""
    out64, ref64 = out.to(torch.float64), ref.to(torch.float64)
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    if denom == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / denom
