"""The MoE layer's forward and backward in plain torch, per expert: the CPU training path and the reference the
Triton backward is compared against.

Forward, per routed slot ``s = (t, j)`` with local expert ``e``, weight ``w``:
``h = x_s W1[e]ᵀ + b1[e]``, ``a = act(h)``, ``y = a W2[e]ᵀ + b2[e]`` and ``out[t] = Σ_j w·y`` where
``x_s = x[t]`` (or, with the weight on the input, ``x_s = w·x[t]`` and ``out[t] = Σ_j y``).

Backward for ``g = d out``: ``dy = w·g[t]`` (``g[t]`` on input), ``dW2[e] = Σ dyᵀ a``, ``db2[e] = Σ dy``,
``da = dy W2[e]``, ``dh = act'(h, da)``, ``dW1[e] = Σ dhᵀ x_s``, ``db1[e] = Σ dh``, ``dx[t] += dh W1[e]``
(times ``w`` on input), ``dw = <y, g[t]>`` (on input: ``<dh W1[e], x[t]>``). Slots of non-local or
out-of-range experts get zero everywhere.

Precision: float64 inputs compute in float64 (this is what ``gradcheck`` checks); others run their matmuls in
the input dtype (float32 accumulation) and the elementwise math in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference import activation_reference
from .activations import gated_activation_backward


@dataclass(frozen=True)
class MoEGradients:
    """Gradients of one MoE call; None where no gradient was asked for (or the input is absent)."""

    hidden_states: torch.Tensor | None = None
    w1: torch.Tensor | None = None
    w2: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    w1_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class ExpertSegments:
    """Routed slots grouped by local expert: ``order`` [n] int64 flat slot indices (local slots only, sorted by
    expert, stable), ``tokens`` [n] their token rows, ``bounds`` the host list of E + 1 segment starts."""

    order: torch.Tensor
    tokens: torch.Tensor
    bounds: list[int]

    def of(self, e: int) -> slice:
        return slice(self.bounds[e], self.bounds[e + 1])


def expert_segments(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int, global_num_experts: int
) -> ExpertSegments:
    """Group the slots of ``topk_ids`` [M, k] by local expert (one host sync for the segment bounds)."""
    k = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < global_num_experts)
    local = ids.clamp(0, max(global_num_experts - 1, 0))
    if expert_map is not None:
        local = expert_map.to(torch.int64)[local]
        valid &= local >= 0
    valid &= local < num_experts
    keys = torch.where(valid, local, num_experts)
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.searchsorted(sorted_keys, torch.arange(num_experts + 1, device=keys.device)).tolist()
    n = bounds[-1]
    return ExpertSegments(order[:n], order[:n] // k, bounds)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` with both operands in ``dtype`` (the input dtype's matmul, float32-accumulated), result in acc."""
    return torch.matmul(a.to(dtype), b.to(dtype)).to(acc)


def _prologue(x, w1, topk_weights, topk_ids, expert_map, global_num_experts):
    """(compute dtype, expert segments, flat routing weights in it) shared by the forward and the backward."""
    E = w1.shape[0]
    global_E = global_num_experts or (expert_map.shape[0] if expert_map is not None else E)
    acc = _compute_dtype(x.dtype)
    return acc, expert_segments(topk_ids, expert_map, E, global_E), topk_weights.reshape(-1).to(acc)


def moe_forward_torch(
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
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The forward above in ``hidden_states``' dtype (any float dtype, float64 included): [M, H]."""
    x = hidden_states
    acc, seg, w = _prologue(x, w1, topk_weights, topk_ids, expert_map, global_num_experts)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for e in range(w1.shape[0]):
        rows = seg.of(e)
        if rows.start == rows.stop:
            continue
        slots, tok = seg.order[rows], seg.tokens[rows]
        ws = w[slots, None]
        xs = x[tok].to(acc) * ws if apply_router_weight_on_input else x[tok].to(acc)
        h = _mm(xs, w1[e].T, x.dtype, acc)
        if w1_bias is not None:
            h = h + w1_bias[e].to(acc)
        y = _mm(activation_reference(h, activation), w2[e].T, x.dtype, acc)
        if w2_bias is not None:
            y = y + w2_bias[e].to(acc)
        out.index_add_(0, tok, y if apply_router_weight_on_input else y * ws)
    return out.to(x.dtype)


def moe_backward_torch(
    grad_out: torch.Tensor,
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
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    needs: tuple[bool, bool, bool, bool, bool, bool] = (True,) * 6,
) -> MoEGradients:
    """Gradients of :func:`moe_forward_torch` for ``grad_out`` [M, H], recomputing the expert activations.

    ``needs`` says which of (hidden_states, w1, w2, topk_weights, w1_bias, w2_bias) want a gradient; each
    gradient has its input's dtype and shape (zero for experts and slots that received nothing).
    """
    x, on_input = hidden_states, apply_router_weight_on_input
    E = w1.shape[0]
    acc, seg, w = _prologue(x, w1, topk_weights, topk_ids, expert_map, global_num_experts)
    need_x, need_w1, need_w2, need_w, need_b1, need_b2 = needs
    need_b1 &= w1_bias is not None
    need_b2 &= w2_bias is not None
    g = grad_out.to(acc)
    dx = torch.zeros(x.shape, dtype=acc, device=x.device) if need_x else None
    dw1 = torch.zeros(w1.shape, dtype=acc, device=x.device) if need_w1 else None
    dw2 = torch.zeros(w2.shape, dtype=acc, device=x.device) if need_w2 else None
    db1 = torch.zeros(w1_bias.shape, dtype=acc, device=x.device) if need_b1 else None
    db2 = torch.zeros(w2_bias.shape, dtype=acc, device=x.device) if need_b2 else None
    dw = torch.zeros(w.shape, dtype=acc, device=x.device) if need_w else None
    for e in range(E):
        rows = seg.of(e)
        if rows.start == rows.stop:
            continue
        slots, tok = seg.order[rows], seg.tokens[rows]
        ws = w[slots, None]
        xt = x[tok].to(acc)
        xs = xt * ws if on_input else xt
        h = _mm(xs, w1[e].T, x.dtype, acc)
        if w1_bias is not None:
            h = h + w1_bias[e].to(acc)
        a = activation_reference(h, activation)
        gt = g[tok]
        dy = gt if on_input else gt * ws
        if need_w2:
            dw2[e] = _mm(dy.T, a, x.dtype, acc)
        if need_b2:
            db2[e] = dy.sum(0)
        if need_w and not on_input:
            y = _mm(a, w2[e].T, x.dtype, acc)
            if w2_bias is not None:
                y = y + w2_bias[e].to(acc)
            dw[slots] = (y * gt).sum(-1)
        if not (need_x or need_w1 or need_b1 or (need_w and on_input)):
            continue
        dh = gated_activation_backward(h, _mm(dy, w2[e], x.dtype, acc), activation)
        if need_w1:
            dw1[e] = _mm(dh.T, xs, x.dtype, acc)
        if need_b1:
            db1[e] = dh.sum(0)
        if need_x or (need_w and on_input):
            dxs = _mm(dh, w1[e], x.dtype, acc)
            if need_w and on_input:
                dw[slots] = (dxs * xt).sum(-1)
            if need_x:
                dx.index_add_(0, tok, dxs * ws if on_input else dxs)

    def cast(t, like):
        return None if t is None else t.to(like.dtype)

    return MoEGradients(
        hidden_states=cast(dx, x),
        w1=cast(dw1, w1),
        w2=cast(dw2, w2),
        topk_weights=None if dw is None else dw.view(topk_weights.shape).to(topk_weights.dtype),
        w1_bias=cast(db1, w1_bias),
        w2_bias=cast(db2, w2_bias),
    )
