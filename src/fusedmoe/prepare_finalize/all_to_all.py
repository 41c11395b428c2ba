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
from typing import TYPE_CHECKING

import torch

from ..experts.base import ExpertsInputs
from ..ops.quantize import num_partials, scale_shape
from ..problem import Layout, MoEProblem
from ..quant import FP8_DTYPE
from ..workspace.manager import Workspace
from ..workspace.plan import BufferSpec, Phase
from .base import PrepareFinalize
from .batched import (
    BatchedCapacityError,
    _arange,
    _capturing,
    gather_batched,
    gather_plan,
    max_count_tensor,
    reduce_plan,
    scatter_batched,
    scatter_plan,
)

if TYPE_CHECKING:
    from ..distributed import Transport


def contiguous_expert_map(num_experts: int, rank: int, world_size: int, device=None) -> torch.Tensor:
    """int32 [num_experts]: global id -> local id on ``rank`` (contiguous partition), -1 elsewhere."""
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} must be divisible by the expert-parallel world size "
                         f"{world_size}")
    n = num_experts // world_size
    m = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    m[rank * n:(rank + 1) * n] = torch.arange(n, dtype=torch.int32, device=device)
    return m


class AllToAllPrepareFinalize(PrepareFinalize):
    """Expert-parallel dispatch/combine over a :class:`~fusedmoe.distributed.Transport` (see module docs).

    Args:
        transport: the collectives (``TorchDistributedTransport(group)``).
        num_experts: global number of experts E (divisible by the world size).
        max_tokens_per_rank: static bound on M on every rank (sizes the receive buffers).
        layout: ``Layout.STANDARD`` (for TorchExperts/TritonExperts) or ``Layout.BATCHED`` (batched experts).
        max_tokens_per_expert: batched only: cap on received rows per expert (default ``W * max_tokens_per_rank``,
            which cannot overflow); an exceeded cap raises :class:`BatchedCapacityError` in eager mode.
    """

    def __init__(self, transport: Transport, num_experts: int, max_tokens_per_rank: int, *,
                 layout: Layout = Layout.STANDARD, max_tokens_per_expert: int | None = None):
        self.transport = transport
        self.rank, self.world = int(transport.rank), int(transport.world_size)
        if num_experts % self.world:
            raise ValueError(f"num_experts={num_experts} must be divisible by the expert-parallel world size "
                             f"{self.world}")
        if max_tokens_per_rank < 0:
            raise ValueError(f"max_tokens_per_rank must be >= 0, got {max_tokens_per_rank}")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.world
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.layout = Layout(layout)
        self.max_tokens_per_expert = max_tokens_per_expert
        self._maps: dict[torch.device, torch.Tensor] = {}
        self._max_count: dict[torch.device, torch.Tensor] = {}
        self._state: tuple | None = None

    def __repr__(self) -> str:
        return (f"AllToAllPrepareFinalize(rank={self.rank}, world={self.world}, layout={self.layout.value}, "
                f"max_tokens_per_rank={self.max_tokens_per_rank})")

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

    def plan(self, p: MoEProblem) -> list[BufferSpec]:
        S, H, W, R = p.slots, p.H, self.world, self.recv_rows(p)
        i64, i32, f32, dt = torch.int64, torch.int32, torch.float32, p.dtype
        P, F = Phase.PREPARE, Phase.FINALIZE
        specs = [
            BufferSpec("ep_keys", (S,), i64, P, F),
            BufferSpec("ep_sorted", (S,), i64, P, P),
            BufferSpec("ep_bad", (S,), torch.bool, P, P),
            BufferSpec("ep_order", (S,), i64, P, F),
            BufferSpec("ep_offsets", (W + 1,), i64, P, P),
            BufferSpec("ep_send_counts", (W,), i64, P, P),
            BufferSpec("ep_send_rows", (S,), i64, P, P),
            BufferSpec("ep_send_meta", (S, 2), i32, P, P),
            BufferSpec("ep_recv_meta", (R, 2), i32, P, P),
            BufferSpec("ep_recv_ids", (R, 1), i32, P, F),
            BufferSpec("ep_recv_w", (R, 1), f32, P, F),
            BufferSpec("ep_recv_out", (R, H), dt, Phase.GEMM2, F, region="2"),
            BufferSpec("ep_back", (S, H), dt, F, F),
            BufferSpec("ep_slot_pos", (S,), i64, F, F),
            *reduce_plan("ep_", S, H, dt),
        ]
        if self.wire_fp8(p):
            q, M = p.quant, p.M
            specs += [
                BufferSpec("ep_src_q", (M, H), FP8_DTYPE, P, P),
                BufferSpec("ep_send_hidden", (S, H), FP8_DTYPE, P, P),
                BufferSpec("ep_recv_hidden", (R, H), FP8_DTYPE, P, Phase.GEMM1),
            ]
            if not q.static_activation_scale:
                G = scale_shape(q.mode, 1, H, q.block_shape[1])[1]
                specs += [
                    BufferSpec("ep_src_scale", (M, G), f32, P, P),
                    BufferSpec("ep_send_scale", (S, G), f32, P, P),
                    BufferSpec("ep_recv_scale", (R, G), f32, P, Phase.GEMM1),
                ]
            return specs
        specs += [
            BufferSpec("ep_send_hidden", (S, H), dt, P, P),
            BufferSpec("ep_recv_hidden", (R, H), dt, P, Phase.GEMM1),
        ]
        if self.layout == Layout.BATCHED:
            E, T = self.local_experts, self.tokens_per_expert()
            specs += scatter_plan("epb_", R, H, E, T, dt) + gather_plan("epb_", R, H, E, T, dt)
        elif p.quant is not None:
            q = p.quant
            specs.append(BufferSpec("ep_a1q", (R, H), FP8_DTYPE, P, Phase.GEMM1))
            if not q.static_activation_scale:
                specs.append(BufferSpec("ep_a1_scale", scale_shape(q.mode, R, H, q.block_shape[1]), f32, P,
                                        Phase.GEMM1))
            if q.mode == "fp8_tensor" and not q.static_activation_scale:
                specs.append(BufferSpec("ep_a1_partial", (num_partials(R),), f32, P, P))
        return specs

    def wire_fp8(self, p: MoEProblem) -> bool:
        """Do tokens travel as fp8 rows (+ scales)? Standard layout, with scales that are row-local or static."""
        q = p.quant
        return (self.layout == Layout.STANDARD and q is not None
                and (q.mode != "fp8_tensor" or q.static_activation_scale))

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

    # ---- dispatch -------------------------------------------------------------------------------------------
    def prepare(self, x: ExpertsInputs, p: MoEProblem, ws: Workspace) -> ExpertsInputs:
        if p.M > self.max_tokens_per_rank:
            raise ValueError(f"rank {self.rank} has {p.M} tokens but max_tokens_per_rank is "
                             f"{self.max_tokens_per_rank}")
        if p.E != self.local_experts or p.global_E != self.num_experts:
            raise ValueError(f"problem has {p.E} local / {p.global_E} global experts, expected "
                             f"{self.local_experts} / {self.num_experts}")
        dev = x.hidden_states.device
        k, W, El = p.top_k, self.world, self.local_experts
        ids = x.topk_ids.reshape(-1)
        keys, sorted_keys, order = ws["ep_keys"], ws["ep_sorted"], ws["ep_order"]
        keys.copy_(ids)
        bad = ws["ep_bad"]
        torch.lt(keys, 0, out=bad)
        bad.logical_or_(keys >= self.num_experts)
        keys.div_(El, rounding_mode="floor").masked_fill_(bad, W)  # destination rank, W = nowhere
        torch.sort(keys, stable=True, out=(sorted_keys, order))
        offsets, counts = ws["ep_offsets"], ws["ep_send_counts"]
        torch.searchsorted(sorted_keys, _arange(W + 1, dev), out=offsets)
        torch.sub(offsets[1:], offsets[:-1], out=counts)

        send_rows, send_hidden, send_meta = ws["ep_send_rows"], ws["ep_send_hidden"], ws["ep_send_meta"]
        torch.div(order, k, rounding_mode="floor", out=send_rows)
        wire_fp8 = self.wire_fp8(p)
        if wire_fp8:  # quantize the M token rows once, then gather fp8 rows (as bytes) and their scales
            self._quantize_source(x, p, ws)
            torch.index_select(ws["ep_src_q"].view(torch.uint8), 0, send_rows, out=send_hidden.view(torch.uint8))
            if "ep_send_scale" in ws:
                torch.index_select(ws["ep_src_scale"], 0, send_rows, out=ws["ep_send_scale"])
        else:
            torch.index_select(x.hidden_states, 0, send_rows, out=send_hidden)
        torch.index_select(ids.to(torch.int32), 0, order, out=send_meta[:, 0])
        w_bits = x.topk_weights.reshape(-1).to(torch.float32).view(torch.int32)
        torch.index_select(w_bits, 0, order, out=send_meta[:, 1])

        send_list, recv_list = self.transport.exchange_counts(counts)  # host sync
        n_send, n_recv = sum(send_list), sum(recv_list)
        R_max = self.recv_rows(p)
        if n_recv > R_max:
            raise ValueError(f"rank {self.rank} received {n_recv} rows, more than the static bound {R_max}: "
                             f"some rank has more than max_tokens_per_rank={self.max_tokens_per_rank} tokens")
        recv_hidden, recv_meta = ws["ep_recv_hidden"], ws["ep_recv_meta"]
        self.transport.all_to_all(recv_hidden[:n_recv], send_hidden[:n_send], send_list, recv_list)
        self.transport.all_to_all(recv_meta[:n_recv], send_meta[:n_send], send_list, recv_list)
        if wire_fp8 and "ep_send_scale" in ws:
            self.transport.all_to_all(ws["ep_recv_scale"][:n_recv], ws["ep_send_scale"][:n_send], send_list,
                                      recv_list)
        recv_ids, recv_w = ws["ep_recv_ids"], ws["ep_recv_w"]
        recv_ids[:n_recv, 0].copy_(recv_meta[:n_recv, 0])
        recv_ids[n_recv:].fill_(-1)  # sentinel ids: rows that were not received are not local anywhere
        recv_w[:n_recv, 0].copy_(recv_meta[:n_recv, 1].view(torch.float32))
        self._state = (send_list, recv_list, n_send, n_recv)

        inner = self.problem(p)
        emap = x.expert_map if x.expert_map is not None else self.expert_map(dev)
        common = dict(w1=x.w1, w2=x.w2, w1_scale=x.w1_scale, w2_scale=x.w2_scale, a1_scale=x.a1_scale,
                      a2_scale=x.a2_scale, w1_bias=x.w1_bias, w2_bias=x.w2_bias)
        if self.layout == Layout.BATCHED:
            T = self.tokens_per_expert()
            mc = self.max_count(dev)
            a, num_tokens = scatter_batched(
                ws, "epb_", recv_hidden, recv_ids, recv_w, E=El, global_E=self.num_experts, T=T, top_k=1,
                expert_map=emap, weight_on_input=p.apply_router_weight_on_input, max_count_out=mc)
            if self.max_tokens_per_expert is not None and not _capturing(mc) and int(mc.item()) > T:
                raise BatchedCapacityError(
                    f"rank {self.rank}: an expert received {int(mc.item())} rows but max_tokens_per_expert is {T}")
            return ExpertsInputs(hidden_states=a, topk_weights=None, topk_ids=None, expert_map=None,
                                 expert_num_tokens=num_tokens, **common)
        hidden, a1_scale = recv_hidden, x.a1_scale
        q = inner.quant
        if wire_fp8:  # already quantized at the source: fp8 rows and their scales arrived together
            a1_scale = ws["ep_recv_scale"] if "ep_recv_scale" in ws else x.a1_scale
        elif q is not None and n_recv:
            from ..ops.quantize import quantize_activation

            hidden = ws["ep_a1q"]
            scale_out = None if q.static_activation_scale else ws["ep_a1_scale"]
            if scale_out is not None and scale_out.dim() == 2:
                scale_out = scale_out[:n_recv]
            _, a1_scale = quantize_activation(
                recv_hidden[:n_recv], q.mode, out=hidden[:n_recv], scale_out=scale_out,
                static_scale=x.a1_scale if q.static_activation_scale else None,
                partial=ws["ep_a1_partial"] if "ep_a1_partial" in ws else None, group_k=q.block_shape[1])
            if a1_scale.dim() == 2:
                a1_scale = ws["ep_a1_scale"]
        elif q is not None:
            hidden = ws["ep_a1q"]
            a1_scale = x.a1_scale if q.static_activation_scale else ws["ep_a1_scale"]
        return ExpertsInputs(hidden_states=hidden, topk_weights=recv_w, topk_ids=recv_ids, expert_map=emap,
                             **{**common, "a1_scale": a1_scale})

    @staticmethod
    def _quantize_source(x: ExpertsInputs, p: MoEProblem, ws: Workspace) -> None:
        """fp8 rows of this rank's M tokens into ``ep_src_q`` (+ row scales into ``ep_src_scale``)."""
        if p.M == 0:
            return
        from ..ops.quantize import quantize_activation

        q = p.quant
        quantize_activation(x.hidden_states, q.mode, out=ws["ep_src_q"],
                            scale_out=None if q.static_activation_scale else ws["ep_src_scale"],
                            static_scale=x.a1_scale if q.static_activation_scale else None,
                            group_k=q.block_shape[1])

    def expert_output(self, output: torch.Tensor, p: MoEProblem, ws: Workspace) -> torch.Tensor:
        if self.layout == Layout.BATCHED:
            return ws["epb_y_batched"].view(p.E, p.max_tokens_per_expert, p.H)
        return ws["ep_recv_out"]

    # ---- combine --------------------------------------------------------------------------------------------
    def finalize(self, output, expert_output, x, p, ws) -> None:
        send_list, recv_list, n_send, n_recv = self._state
        self._state = None
        rows = ws["ep_recv_out"]
        if self.layout == Layout.BATCHED:
            w = None if p.apply_router_weight_on_input else ws["ep_recv_w"][:n_recv]
            gather_batched(ws, "epb_", expert_output.reshape(-1, p.H), ws["epb_slot_dest"][:n_recv], w,
                           rows[:n_recv], 1)
        back = ws["ep_back"]
        self.transport.all_to_all(back[:n_send], rows[:n_recv], recv_list, send_list)
        S = p.slots
        pos = ws["ep_slot_pos"]
        pos.index_copy_(0, ws["ep_order"], _arange(S, output.device))  # slot -> its row in the send order
        pos.masked_fill_(ws["ep_keys"] >= self.world, -1)  # slots that went nowhere
        gather_batched(ws, "ep_", back, pos, None, output, p.top_k)


__all__ = ["AllToAllPrepareFinalize", "contiguous_expert_map"]
