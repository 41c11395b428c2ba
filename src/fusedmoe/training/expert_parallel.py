"""Expert-parallel training: a differentiable token exchange around this rank's experts.

Rank r of a world of W owns the global experts ``[r * E_local, (r + 1) * E_local)`` (as in inference,
:mod:`fusedmoe.prepare_finalize.all_to_all`). One call, on every rank:

1. dispatch: the M*k slots sorted by the rank that owns their expert; one all-to-all of the counts (read on the
   host), then one of the slots' token rows (:class:`Exchange`: its backward is the same exchange reversed, so the
   rows' gradients return to the ranks that sent them) and one of their local expert ids (integers, no gradient);
2. the received rows through this rank's experts as a top-1 problem with weight 1: :func:`fusedmoe.fused_moe`,
   whose backward (Triton kernels on the Triton backend, scratch from the layer's workspace manager) gives the
   received rows' and the local experts' gradients;
3. combine: the result rows back through the reversed exchange, then, per token, the routing-weighted float32
   sum over its slots (in torch ops, so the routing weights get their gradient on the rank that routed them).
   With ``apply_router_weight_on_input`` the rows are weighted before the dispatch instead.

Slots whose id is outside ``[0, E)`` go nowhere and contribute zero. The exchange sizes come from the counts, so
nothing is padded to a static bound (training runs eagerly, outside a compiled graph; the inference path keeps its
static, graph-friendly sizes). Every rank must run the forward and the backward of every call (the collectives
pair up across ranks), also a rank with no tokens: its backward still takes part in the reversed exchanges.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..transport import Transport


class Exchange(torch.autograd.Function):
    """``rows`` [sum(send), ...] sent in ``send`` splits to ranks 0..W-1; returns the [sum(recv), ...] rows the
    ranks sent here in ``recv`` splits. The backward sends the gradient back the same way, splits swapped."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, transport: Transport, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.transport, ctx.send, ctx.recv = transport, send, recv
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        transport.all_to_all(out, rows.contiguous(), send, recv)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        ctx.transport.all_to_all(back, grad.contiguous(), ctx.recv, ctx.send)
        return back, None, None, None


def expert_parallel_moe(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    transport: Transport,
    num_experts: int,
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    workspace=None,
    backend: str = "auto",
    recompute: bool = False,
) -> torch.Tensor:
    """The MoE layer over expert-parallel ranks, differentiable in ``hidden_states``, ``w1``, ``w2`` and
    ``topk_weights``.

    Args:
        hidden_states: [M, H] this rank's tokens (M may be 0).
        w1: [E_local, 2I, H], w2: [E_local, H, I]: this rank's experts (``E_local = num_experts / world``).
        topk_weights: [M, k] float routing weights; topk_ids: [M, k] integer global expert ids.
        transport: the collectives (:class:`~fusedmoe.transport.TorchDistributedTransport`).
        num_experts: the global number of experts E.
        activation, apply_router_weight_on_input, workspace, backend, recompute: as for
            :func:`fusedmoe.fused_moe` (the workspace manager plans the local experts' forward and backward).

    Returns a fresh [M, H] tensor in ``hidden_states``' dtype. Collective: every rank of the transport calls it
    (and its backward) with the same ``num_experts`` and top-k.
    """
    from ..api import fused_moe

    world = int(transport.world_size)
    M, H = hidden_states.shape
    k = topk_ids.shape[1]
    El = w1.shape[0]
    if El * world != num_experts:
        raise ValueError(f"w1 must hold num_experts / world = {num_experts // world} experts, got {El}")
    device = hidden_states.device
    ids = topk_ids.reshape(-1).long()
    dest = torch.where((ids >= 0) & (ids < num_experts), ids // El, world)  # world: goes nowhere
    order = torch.sort(dest, stable=True).indices
    counts = torch.bincount(dest, minlength=world + 1)[:world]
    send, recv = transport.exchange_counts(counts)
    sent = order[: sum(send)]  # slots in send order
    rows = hidden_states.index_select(0, sent // k)
    if apply_router_weight_on_input:
        rows = rows * topk_weights.reshape(-1).index_select(0, sent).unsqueeze(1).to(rows.dtype)
    recv_rows = Exchange.apply(rows, transport, send, recv)
    local_ids = torch.empty(sum(recv), dtype=torch.int32, device=device)
    transport.all_to_all(local_ids, (ids.index_select(0, sent) - dest.index_select(0, sent) * El).int(), send, recv)
    R = local_ids.numel()
    y = fused_moe(
        recv_rows,
        w1,
        w2,
        torch.ones(R, 1, dtype=torch.float32, device=device),
        local_ids.view(R, 1),
        activation=activation,
        workspace=workspace,
        backend=backend,
        recompute=recompute,
    )
    back = Exchange.apply(y, transport, recv, send)  # [sum(send), H], in send order
    per_slot = back.new_zeros(M * k, H).index_copy(0, sent, back).view(M, k, H)
    if apply_router_weight_on_input:
        out = per_slot.float().sum(1)
    else:
        out = (per_slot.float() * topk_weights.float().unsqueeze(2)).sum(1)
    return out.to(hidden_states.dtype)


__all__ = ["Exchange", "expert_parallel_moe"]
