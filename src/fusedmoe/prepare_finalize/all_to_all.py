"""Expert parallelism: dispatch tokens to the ranks that own their experts and combine the results.

Rank r of a world of W owns the global experts ``[r * E_local, (r + 1) * E_local)`` (``E_local = E / W``); a
slot with global id g goes to rank ``g // E_local`` (ids outside ``[0, E)`` go nowhere and contribute 0).

Dispatch (``prepare``):
  1. stable-sort this rank's M*k slots by destination rank, count the slots per rank (``searchsorted``);
  2. ``exchange_counts``: one small all-to-all of the counts, read on the host (the inherent sync of
     ``all_to_all_single`` with host split lists);
  3. one all-to-all of the slot rows (the token row of each slot, in the activation dtype) and one of their
     metadata (global id, routing weight as int32 bits), with uneven splits (zero splits work);
  4. the receiver runs its experts on the received rows as a problem of ``M_recv_max`` rows and top-k 1 with
     the global ids and this rank's ``expert_map``. Rows past the received count get id -1 (written: a
     sentinel, not a fill), so no kernel computes or reads them.
     - standard layout (``TorchExperts``/``TritonExperts``): the experts weight and write each row's result.
       fp8 with row-local scales (per-token, 128-column blocks) or a static per-tensor scale: the source
       quantizes its M token rows once and sends fp8 rows plus their scales (half the bytes of bf16); a dynamic
       per-tensor scale cannot travel (each source would have its own), so then the receiver quantizes the
       received rows (scale over received rows only);
     - batched layout: the received rows are scattered into ``[E_local, T, H]`` exactly as by
       :class:`~fusedmoe.prepare_finalize.batched.BatchedPrepareFinalize` (``T = W * max_tokens_per_rank``, or a
       cap), and the per-row results gathered (and weighted) back after the experts.
Combine (``finalize``): the result rows go back with the splits reversed; the source gathers, per slot, the row
at the slot's position in its send order (fp32 sum over top-k, zero for slots that went nowhere) into the
fresh output. Every output row is written; nothing is zero-filled or accumulated in place.

Static sizes: every buffer, including the receive buffers, is in the workspace plan, sized by the static
bound ``M_recv_max = W * max_tokens_per_rank * top_k`` (``max_tokens_per_rank`` bounds M on every rank; the
layer takes it from the user or from a max-reduce over ranks, rounded up to a power of two). So a call
allocates only the output, the 2 x W count tensor and small temporaries; the cost is that the receiver's
experts plan for the worst case (rows past the received count are skipped by the kernels).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..experts.base import ExpertsInputs
from ..ops.quantize import num_partials, quantize_activation, scale_shape
from ..problem import Layout, MoEProblem
from ..quant import FP8_DTYPE, QuantConfig
from ..steps import step
from ..transport import Transport
from ..workspace.manager import Workspace
from ..workspace.plan import BufferSpec
from .base import PrepareFinalize
from .batched import (
    SCATTER_BUFFERS,
    BatchedCapacityError,
    GatherBuffers,
    ScatterBuffers,
    _arange,
    _capturing,
    gather_batched,
    gather_plan,
    max_count_tensor,
    prepared_inputs,
    scatter_batched,
    scatter_plan,
)


def contiguous_expert_map(num_experts: int, rank: int, world_size: int, device=None) -> torch.Tensor:
    """int32 [num_experts]: global id -> local id on ``rank`` (contiguous partition), -1 elsewhere."""
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} must be divisible by the expert-parallel world size {world_size}")
    n = num_experts // world_size
    m = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    m[rank * n : (rank + 1) * n] = torch.arange(n, dtype=torch.int32, device=device)
    return m


class AllToAllPrepareFinalize(PrepareFinalize):
    """Expert-parallel dispatch/combine over a :class:`~fusedmoe.transport.Transport` (see module docs).

    Args:
        transport: the collectives (``TorchDistributedTransport(group)``).
        num_experts: global number of experts E (divisible by the world size).
        max_tokens_per_rank: static bound on M on every rank (sizes the receive buffers).
        layout: ``Layout.STANDARD`` (for TorchExperts/TritonExperts) or ``Layout.BATCHED`` (batched experts).
        max_tokens_per_expert: batched only: cap on received rows per expert (default ``W * max_tokens_per_rank``,
            which cannot overflow); an exceeded cap raises :class:`BatchedCapacityError` in eager mode.
    """

    def __init__(
        self,
        transport: Transport,
        num_experts: int,
        max_tokens_per_rank: int,
        *,
        layout: Layout = Layout.STANDARD,
        max_tokens_per_expert: int | None = None,
    ):
        self.transport = transport
        self.rank, self.world = int(transport.rank), int(transport.world_size)
        if num_experts % self.world:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the expert-parallel world size {self.world}"
            )
        if max_tokens_per_rank < 0:
            raise ValueError(f"max_tokens_per_rank must be >= 0, got {max_tokens_per_rank}")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.world
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.layout = Layout(layout)
        self.max_tokens_per_expert = max_tokens_per_expert
        self._maps: dict[torch.device, torch.Tensor] = {}
        self._max_count: dict[torch.device, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (
            f"AllToAllPrepareFinalize(rank={self.rank}, world={self.world}, layout={self.layout.value}, "
            f"max_tokens_per_rank={self.max_tokens_per_rank})"
        )

    # ---- static shapes --------------------------------------------------------------------------------------
    def recv_rows(self, p: MoEProblem) -> int:
        """Static bound on the rows this rank receives."""
        return self.world * self.max_tokens_per_rank * p.top_k

    def tokens_per_expert(self) -> int:
        T = self.world * self.max_tokens_per_rank
        return T if self.max_tokens_per_expert is None else min(T, self.max_tokens_per_expert)

    def problem(self, p: MoEProblem) -> MoEProblem:
        inner = replace(p, M=self.recv_rows(p), top_k=1, has_expert_map=True)
        if self.layout == Layout.BATCHED:
            inner = replace(inner, max_tokens_per_expert=self.tokens_per_expert())
        return inner

    def wire_fp8(self, p: MoEProblem) -> bool:
        """Do tokens travel as fp8 rows (+ scales)? Standard layout, with scales that are row-local or static."""
        q = p.quant
        return (
            self.layout == Layout.STANDARD
            and q is not None
            and q.fp8
            and (q.mode != "fp8_tensor" or q.static_activation_scale)
        )

    def buffers(self, p: MoEProblem) -> list[BufferSpec]:
        S, H, W, R = p.slots, p.H, self.world, self.recv_rows(p)
        i64, i32, f32, dt = torch.int64, torch.int32, torch.float32, p.dtype
        specs = [
            BufferSpec("ep_keys", (S,), i64),
            BufferSpec("ep_sorted", (S,), i64),
            BufferSpec("ep_bad", (S,), torch.bool),
            BufferSpec("ep_order", (S,), i64),
            BufferSpec("ep_offsets", (W + 1,), i64),
            BufferSpec("ep_send_counts", (W,), i64),
            BufferSpec("ep_send_rows", (S,), i64),
            BufferSpec("ep_send_meta", (S, 2), i32),
            BufferSpec("ep_recv_meta", (R, 2), i32),
            BufferSpec("ep_recv_ids", (R, 1), i32),
            BufferSpec("ep_recv_w", (R, 1), f32),
            BufferSpec("ep_recv_out", (R, H), dt, region="2"),
            BufferSpec("ep_back", (S, H), dt),
            BufferSpec("ep_slot_pos", (S,), i64),
            *gather_plan("ep_", S, H, dt),
        ]
        if self.wire_fp8(p):
            q, M = p.quant, p.M
            specs += [
                BufferSpec("ep_src_q", (M, H), FP8_DTYPE),
                BufferSpec("ep_send_hidden", (S, H), FP8_DTYPE),
                BufferSpec("ep_recv_hidden", (R, H), FP8_DTYPE),
            ]
            if not q.static_activation_scale:
                G = scale_shape(q.mode, 1, H, q.block_shape[1])[1]
                specs += [
                    BufferSpec("ep_src_scale", (M, G), f32),
                    BufferSpec("ep_send_scale", (S, G), f32),
                    BufferSpec("ep_recv_scale", (R, G), f32),
                ]
            return specs
        specs += [
            BufferSpec("ep_send_hidden", (S, H), dt),
            BufferSpec("ep_recv_hidden", (R, H), dt),
        ]
        if self.layout == Layout.BATCHED:
            E, T = self.local_experts, self.tokens_per_expert()
            specs += [
                *scatter_plan(R, H, E, T, dt),
                BufferSpec("b_y_batched", (E * T, H), dt, region="2"),
                *gather_plan("b_", R, H, dt),
            ]
        elif p.quant is not None and p.quant.fp8:
            q = p.quant
            specs.append(BufferSpec("ep_a1q", (R, H), FP8_DTYPE))
            if not q.static_activation_scale:
                specs.append(BufferSpec("ep_a1_scale", scale_shape(q.mode, R, H, q.block_shape[1]), f32))
                if q.mode == "fp8_tensor":
                    specs.append(BufferSpec("ep_a1_partial", (num_partials(R),), f32))
        return specs

    def prepare_steps(self, p: MoEProblem):
        last = _ep_scatter if self.layout == Layout.BATCHED else _ep_inputs
        return [_ep_route, _ep_pack, _ep_dispatch, last]

    def finalize_steps(self, p: MoEProblem):
        return [_ep_gather_batched, _ep_combine] if self.layout == Layout.BATCHED else [_ep_combine]

    def exports(self, p: MoEProblem) -> tuple[str, ...]:
        if self.layout == Layout.BATCHED:
            return ("b_a_batched", "b_num_tokens", "b_y_batched")
        names = {b.name for b in self.buffers(p)}
        return tuple(
            n
            for n in (
                "ep_recv_hidden",
                "ep_recv_ids",
                "ep_recv_w",
                "ep_recv_scale",
                "ep_a1q",
                "ep_a1_scale",
                "ep_recv_out",
            )
            if n in names
        )

    def expert_map(self, device: torch.device | str) -> torch.Tensor:
        """int32 [E]: global id -> local id on this rank, -1 elsewhere (cached per device)."""
        device = torch.device(device)
        m = self._maps.get(device)
        if m is None:
            m = self._maps[device] = contiguous_expert_map(self.num_experts, self.rank, self.world, device)
        return m

    def max_count(self, device: torch.device | str) -> torch.Tensor:
        """Batched layout: int64 [1], the largest per-expert received count of the last call (see batched.py)."""
        return max_count_tensor(self._max_count, device)

    def expert_output(self, output: torch.Tensor, inner: MoEProblem, ws: Workspace) -> torch.Tensor:
        if self.layout == Layout.BATCHED:
            return ws["b_y_batched"].view(inner.E, inner.max_tokens_per_expert, inner.H)
        return ws["ep_recv_out"]


# ---- dispatch ---------------------------------------------------------------------------------------------------
@step
def _ep_route(c, ep_keys, ep_bad, ep_sorted, ep_order, ep_offsets, ep_send_counts):
    """Destination rank of every slot (W = nowhere), slots sorted by it, and the rows sent to each rank."""
    x, p, pf = c.x, c.p, c.component
    if p.M > pf.max_tokens_per_rank:
        raise ValueError(f"rank {pf.rank} has {p.M} tokens but max_tokens_per_rank is {pf.max_tokens_per_rank}")
    if p.E != pf.local_experts or p.global_E != pf.num_experts:
        raise ValueError(
            f"problem has {p.E} local / {p.global_E} global experts, expected {pf.local_experts} / {pf.num_experts}"
        )
    W = pf.world
    ep_keys.copy_(x.topk_ids.reshape(-1))
    torch.lt(ep_keys, 0, out=ep_bad)
    ep_bad.logical_or_(ep_keys >= pf.num_experts)
    ep_keys.div_(pf.local_experts, rounding_mode="floor").masked_fill_(ep_bad, W)
    torch.sort(ep_keys, stable=True, out=(ep_sorted, ep_order))
    torch.searchsorted(ep_sorted, _arange(W + 1, ep_keys.device), out=ep_offsets)
    torch.sub(ep_offsets[1:], ep_offsets[:-1], out=ep_send_counts)


@step
def _ep_pack(
    c, ep_order, ep_send_rows, ep_send_hidden, ep_send_meta, ep_src_q=None, ep_src_scale=None, ep_send_scale=None
):
    """The send buffers in destination order: token rows (fp8 rows and their scales when they travel as fp8)
    and per-slot metadata (global id, routing weight as int32 bits)."""
    x, p = c.x, c.p
    torch.div(ep_order, p.top_k, rounding_mode="floor", out=ep_send_rows)
    if ep_src_q is not None:  # quantize the M token rows once, then gather fp8 rows (as bytes) and their scales
        if p.M:
            _quantize(x.hidden_states, p.quant, x, ep_src_q, ep_src_scale)
        torch.index_select(ep_src_q.view(torch.uint8), 0, ep_send_rows, out=ep_send_hidden.view(torch.uint8))
        if ep_send_scale is not None:
            torch.index_select(ep_src_scale, 0, ep_send_rows, out=ep_send_scale)
    else:
        torch.index_select(x.hidden_states, 0, ep_send_rows, out=ep_send_hidden)
    torch.index_select(x.topk_ids.reshape(-1).to(torch.int32), 0, ep_order, out=ep_send_meta[:, 0])
    w_bits = x.topk_weights.reshape(-1).to(torch.float32).view(torch.int32)
    torch.index_select(w_bits, 0, ep_order, out=ep_send_meta[:, 1])


@step
def _ep_dispatch(
    c,
    ep_send_counts,
    ep_send_hidden,
    ep_send_meta,
    ep_recv_hidden,
    ep_recv_meta,
    ep_recv_ids,
    ep_recv_w,
    ep_send_scale=None,
    ep_recv_scale=None,
):
    """Exchange counts (the host sync of this path), then rows, metadata and scales; unpack the metadata."""
    pf = c.component
    send_list, recv_list = pf.transport.exchange_counts(ep_send_counts)
    n_send, n_recv = sum(send_list), sum(recv_list)
    R_max = ep_recv_ids.shape[0]
    if n_recv > R_max:
        raise ValueError(
            f"rank {pf.rank} received {n_recv} rows, more than the static bound {R_max}: "
            f"some rank has more than max_tokens_per_rank={pf.max_tokens_per_rank} tokens"
        )
    a2a = pf.transport.all_to_all
    a2a(ep_recv_hidden[:n_recv], ep_send_hidden[:n_send], send_list, recv_list)
    a2a(ep_recv_meta[:n_recv], ep_send_meta[:n_send], send_list, recv_list)
    if ep_send_scale is not None:
        a2a(ep_recv_scale[:n_recv], ep_send_scale[:n_send], send_list, recv_list)
    ep_recv_ids[:n_recv, 0].copy_(ep_recv_meta[:n_recv, 0])
    ep_recv_ids[n_recv:].fill_(-1)  # sentinel ids: rows that were not received are not local anywhere
    ep_recv_w[:n_recv, 0].copy_(ep_recv_meta[:n_recv, 1].view(torch.float32))
    c.state.update(send_list=send_list, recv_list=recv_list, n_send=n_send, n_recv=n_recv)


def _quantize(rows, q: QuantConfig, x: ExpertsInputs, out, scale_out, partial=None) -> None:
    """Quantize activation ``rows`` into ``out`` (and ``scale_out``) as ``q`` says; a static scale is x's a1_scale."""
    quantize_activation(
        rows,
        q.mode,
        out=out,
        scale_out=scale_out,
        static_scale=x.a1_scale if q.static_activation_scale else None,
        partial=partial,
        group_k=q.block_shape[1],
    )


@step
def _ep_inputs(
    c, ep_recv_hidden, ep_recv_ids, ep_recv_w, ep_recv_scale=None, ep_a1q=None, ep_a1_scale=None, ep_a1_partial=None
):
    """Standard layout: the received rows (fp8 rows arrive with their scales; a dynamic per-tensor scale is
    taken here over the received rows only) as a problem of top-k 1 with this rank's expert_map."""
    x, p, pf = c.x, c.p, c.component
    n_recv = c.state["n_recv"]
    q = p.quant
    hidden, a1_scale = ep_recv_hidden, x.a1_scale
    if ep_recv_scale is not None:
        a1_scale = ep_recv_scale
    elif ep_a1q is not None:  # quantize on arrival (dynamic per-tensor, or any mode without fp8 on the wire)
        hidden = ep_a1q
        if q.static_activation_scale:
            a1_scale = x.a1_scale
        else:
            a1_scale = ep_a1_scale
        if n_recv:
            scale_out = None if q.static_activation_scale else ep_a1_scale
            if scale_out is not None and scale_out.dim() == 2:
                scale_out = scale_out[:n_recv]
            _quantize(ep_recv_hidden[:n_recv], q, x, ep_a1q[:n_recv], scale_out, ep_a1_partial)
    emap = x.expert_map if x.expert_map is not None else pf.expert_map(ep_recv_hidden.device)
    c.prepared = prepared_inputs(
        x, hidden, topk_weights=ep_recv_w, topk_ids=ep_recv_ids, expert_map=emap, a1_scale=a1_scale
    )


@step(group=SCATTER_BUFFERS)
def _ep_scatter(c, ep_recv_hidden, ep_recv_ids, ep_recv_w, *b):
    """Batched layout: the received rows scattered into [E_local, T, H] as by BatchedPrepareFinalize."""
    x, p, pf = c.x, c.p, c.component
    T = pf.tokens_per_expert()
    mc = pf.max_count(ep_recv_hidden.device)
    emap = x.expert_map if x.expert_map is not None else pf.expert_map(ep_recv_hidden.device)
    a, num_tokens = scatter_batched(
        ScatterBuffers(*b),
        ep_recv_hidden,
        ep_recv_ids,
        ep_recv_w,
        E=pf.local_experts,
        global_E=pf.num_experts,
        T=T,
        top_k=1,
        expert_map=emap,
        weight_on_input=p.apply_router_weight_on_input,
        max_count_out=mc,
    )
    if pf.max_tokens_per_expert is not None and not _capturing(mc) and int(mc.item()) > T:
        raise BatchedCapacityError(
            f"rank {pf.rank}: an expert received {int(mc.item())} rows but max_tokens_per_expert is {T}"
        )
    c.prepared = prepared_inputs(x, a, expert_num_tokens=num_tokens, a1_scale=x.a1_scale)


# ---- combine ----------------------------------------------------------------------------------------------------
@step
def _ep_gather_batched(c, ep_recv_w, ep_recv_out, b_y_batched, b_slot_dest, b_g_index, b_g_invalid, b_g_rows):
    """Batched layout: the per-row results (weighted unless applied on input) back in received-row order."""
    n_recv = c.state["n_recv"]
    w = None if c.p.apply_router_weight_on_input else ep_recv_w[:n_recv]
    gather_batched(
        GatherBuffers(b_g_index, b_g_invalid, b_g_rows), b_y_batched, b_slot_dest[:n_recv], w, ep_recv_out[:n_recv], 1
    )


@step
def _ep_combine(c, ep_recv_out, ep_back, ep_keys, ep_order, ep_slot_pos, ep_g_index, ep_g_invalid, ep_g_rows):
    """Result rows back to their source ranks, then each slot's row summed over top-k into the output."""
    s, pf, p = c.state, c.component, c.p
    pf.transport.all_to_all(ep_back[: s["n_send"]], ep_recv_out[: s["n_recv"]], s["recv_list"], s["send_list"])
    ep_slot_pos.index_copy_(0, ep_order, _arange(p.slots, c.out.device))  # slot -> its row in the send order
    ep_slot_pos.masked_fill_(ep_keys >= pf.world, -1)  # slots that went nowhere
    gather_batched(GatherBuffers(ep_g_index, ep_g_invalid, ep_g_rows), ep_back, ep_slot_pos, None, c.out, p.top_k)


__all__ = ["AllToAllPrepareFinalize", "contiguous_expert_map"]
