"""Batched layout on one rank: tokens scattered per expert into ``[E_local, T, H]`` (T = max tokens per expert).

Prepare (torch index ops into planned buffers; no ``.item()``, no host sync, no allocation, so the whole path
can be captured in a CUDA graph):

1. key every (token, slot) pair with its local expert (E for a non-local or out-of-range id), stable-sort the
   keys (slots of one expert stay in token order), find each expert's segment with ``searchsorted``;
2. ``expert_num_tokens[e] = min(count_e, T)`` (int32, every element written: no zeroed counter, no atomics);
3. the rank of each sorted slot in its segment gives its batched row ``e * T + rank``; slots that are not local
   or whose rank is >= T (capacity overflow) get -1 in ``slot_dest`` (slot order, every element written);
4. token rows (times the routing weight when it applies on the input) are gathered in sorted order and
   ``index_copy_``-ed to their rows. Slots without a row are copied to one extra *trash* row past the batched
   buffer that nothing ever reads. Padded rows (``>= expert_num_tokens[e]``) are never written.

Finalize gathers ``y[slot_dest]`` per slot, replaces the rows of slots without a row by zeros with a select
(``masked_fill_``; never an arithmetic mask, since 0 * NaN = NaN), multiplies by the routing weight (unless it
was applied on the input) and sums over top-k into the fresh output (fp32 accumulation inside ``torch.sum``).
Only valid rows of the expert output are read; a token without a local slot gets a zero row.

Capacity ``T``: by default ``M`` (a token picks each expert at most once, so no expert gets more than M rows;
``route`` guarantees distinct ids per token). With ``max_tokens_per_expert=cap`` the plan uses ``min(cap, M)``
rows per expert: an expert with more tokens keeps the first ``cap`` (in token order) and the others are
dropped. The largest per-expert count of the last call is written on the device (``max_count(device)``,
no sync); in eager mode with ``check_capacity`` (the default when a cap is set) prepare reads it (the one host
sync of this path, only when asked for) and raises :class:`BatchedCapacityError`. Under CUDA-graph capture
the check is skipped: read ``max_count`` after a replay instead.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..experts.base import ExpertsInputs
from ..experts.torch_experts import local_expert_keys
from ..problem import Layout, MoEProblem
from ..workspace.manager import Workspace
from ..workspace.plan import BufferSpec, Phase
from .base import PrepareFinalize


class BatchedCapacityError(RuntimeError):
    """An expert received more tokens than the configured ``max_tokens_per_expert``."""


_ARANGE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """int64 [n] = 0..n-1, cached per (n, device) (a constant, not scratch)."""
    key = (n, device)
    t = _ARANGE.get(key)
    if t is None:
        if len(_ARANGE) > 256:
            _ARANGE.clear()
        t = _ARANGE[key] = torch.arange(n, dtype=torch.int64, device=device)
    return t


def scatter_plan(prefix: str, S: int, H: int, E: int, T: int, dtype: torch.dtype) -> list[BufferSpec]:
    """Buffers of :func:`scatter_batched` for S slots into E experts of T rows of width H."""
    i64, i32, b = torch.int64, torch.int32, torch.bool
    P, F = Phase.PREPARE, Phase.FINALIZE
    n = prefix
    return [
        BufferSpec(n + "keys", (S,), i64, P, P),
        BufferSpec(n + "sorted_keys", (S,), i64, P, P),
        BufferSpec(n + "order", (S,), i64, P, P),
        BufferSpec(n + "offsets", (E + 1,), i64, P, P),
        BufferSpec(n + "counts", (E,), i64, P, P),
        BufferSpec(n + "rank", (S,), i64, P, P),
        BufferSpec(n + "dest", (S,), i64, P, P),
        BufferSpec(n + "ok", (S,), b, P, P),
        BufferSpec(n + "bad", (S,), b, P, P),
        BufferSpec(n + "a_sorted", (S, H), dtype, P, P),
        BufferSpec(n + "w_sorted", (S,), torch.float32, P, P),
        BufferSpec(n + "slot_dest", (S,), i64, P, F),
        BufferSpec(n + "num_tokens", (E,), i32, P, Phase.GEMM2),
        BufferSpec(n + "a_batched", (E * T + 1, H), dtype, P, Phase.GEMM1),
    ]


def gather_plan(prefix: str, S: int, H: int, E: int, T: int, dtype: torch.dtype) -> list[BufferSpec]:
    """Buffers of the batched expert output and of :func:`gather_batched`."""
    y = BufferSpec(prefix + "y_batched", (E * T, H), dtype, Phase.GEMM2, Phase.FINALIZE, region="2")
    return [y, *reduce_plan(prefix, S, H, dtype)]


def reduce_plan(prefix: str, S: int, H: int, dtype: torch.dtype) -> list[BufferSpec]:
    """Buffers of :func:`gather_batched` over S slots of width H."""
    F = Phase.FINALIZE
    return [
        BufferSpec(prefix + "g_index", (S,), torch.int64, F, F),
        BufferSpec(prefix + "g_invalid", (S,), torch.bool, F, F),
        BufferSpec(prefix + "g_rows", (S, H), dtype, F, F),
    ]


def scatter_batched(
    ws: Workspace,
    prefix: str,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor | None,
    *,
    E: int,
    global_E: int,
    T: int,
    top_k: int,
    expert_map: torch.Tensor | None,
    weight_on_input: bool,
    max_count_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter the slots of ``topk_ids`` [M, k] (rows of ``hidden`` [M, H]) into the batched layout.

    Writes ``slot_dest`` (batched row of each slot or -1), ``num_tokens`` (int32 [E]) and the valid rows of
    ``a_batched``; optionally ``max_count_out`` (int64 [1]: the largest per-expert count before capping).

    Returns:
        (a_batched view [E, T, H], expert_num_tokens int32 [E]).
    """
    S = topk_ids.numel()
    dev = hidden.device
    keys, sorted_keys, order = ws[prefix + "keys"], ws[prefix + "sorted_keys"], ws[prefix + "order"]
    local_expert_keys(topk_ids, expert_map, E, global_E, out=keys, scratch=sorted_keys)
    torch.sort(keys, stable=True, out=(sorted_keys, order))
    offsets, counts = ws[prefix + "offsets"], ws[prefix + "counts"]
    torch.searchsorted(sorted_keys, _arange(E + 1, dev), out=offsets)
    torch.sub(offsets[1:], offsets[:-1], out=counts)
    if max_count_out is not None:
        if E:
            torch.amax(counts, dim=0, keepdim=True, out=max_count_out)
        else:
            max_count_out.fill_(0)
    num_tokens = ws[prefix + "num_tokens"]
    num_tokens.copy_(counts.clamp_(max=T))

    rank, dest, bad, tmp = ws[prefix + "rank"], ws[prefix + "dest"], ws[prefix + "bad"], ws[prefix + "ok"]
    torch.index_select(offsets, 0, sorted_keys, out=rank)  # segment start of each sorted slot
    torch.sub(_arange(S, dev), rank, out=rank)
    torch.ge(rank, T, out=bad)  # over capacity
    bad.logical_or_(torch.ge(sorted_keys, E, out=tmp))  # not local
    torch.mul(sorted_keys, T, out=dest)
    dest.add_(rank)
    dest.masked_fill_(bad, -1)
    slot_dest = ws[prefix + "slot_dest"]
    slot_dest.index_copy_(0, order, dest)  # order is a permutation: every element written
    trash = E * T
    dest.masked_fill_(bad, trash)

    a_sorted = ws[prefix + "a_sorted"]
    torch.index_select(hidden, 0, torch.div(order, top_k, rounding_mode="floor", out=rank), out=a_sorted)
    if weight_on_input:
        w_sorted = ws[prefix + "w_sorted"]
        torch.index_select(topk_weights.reshape(-1).to(torch.float32), 0, order, out=w_sorted)
        a_sorted.mul_(w_sorted[:, None])
    a_batched = ws[prefix + "a_batched"]
    a_batched.index_copy_(0, dest, a_sorted)
    H = hidden.shape[1]
    return a_batched[:trash].view(E, T, H), num_tokens


def gather_batched(
    ws: Workspace,
    prefix: str,
    y_batched: torch.Tensor,
    slot_dest: torch.Tensor,
    topk_weights: torch.Tensor | None,
    out: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * y[slot_dest[t*k + j]]`` over slots with a row (``topk_weights`` None: no
    weighting). ``y_batched`` [E*T, H] is read at valid rows only; ``out`` [M, H] is written in full."""
    S = slot_dest.numel()
    idx, invalid, rows = ws[prefix + "g_index"][:S], ws[prefix + "g_invalid"][:S], ws[prefix + "g_rows"][:S]
    torch.lt(slot_dest, 0, out=invalid)
    torch.clamp(slot_dest, min=0, out=idx)
    torch.index_select(y_batched, 0, idx, out=rows)
    rows.masked_fill_(invalid[:, None], 0)  # a select: NaN in unread rows never reaches the result
    if topk_weights is not None:
        rows.mul_(topk_weights.reshape(-1)[:S, None])
    M = S // top_k if top_k else 0
    torch.sum(rows.view(M, top_k, rows.shape[1]), dim=1, out=out)
    return out


def max_count_tensor(cache: dict[torch.device, torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The persistent int64 [1] max-count tensor of ``device`` in ``cache`` (created once, zero-initialised:
    it is a result each call overwrites, never a workspace)."""
    device = torch.device(device)
    t = cache.get(device)
    if t is None:
        t = cache[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return t


class BatchedPrepareFinalize(PrepareFinalize):
    """No expert parallelism, batched layout ``[E_local, T, H]`` + ``expert_num_tokens`` (see module docs).

    Args:
        max_tokens_per_expert: capacity cap T (None: the static bound M). A batch that gives an expert more
            tokens than the cap drops the excess (see ``check_capacity``).
        check_capacity: raise :class:`BatchedCapacityError` in eager mode when the cap was exceeded (one host
            sync per call). Default: True when a cap is set, else False (no overflow is possible then).
    """

    layout = Layout.BATCHED

    def __init__(self, max_tokens_per_expert: int | None = None, *, check_capacity: bool | None = None):
        if max_tokens_per_expert is not None and (
            isinstance(max_tokens_per_expert, bool) or not isinstance(max_tokens_per_expert, int)
            or max_tokens_per_expert < 1
        ):
            raise ValueError(f"max_tokens_per_expert must be an int >= 1 or None, got {max_tokens_per_expert!r}")
        self.max_tokens_per_expert = max_tokens_per_expert
        self.check_capacity = (max_tokens_per_expert is not None) if check_capacity is None else bool(check_capacity)
        self._max_count: dict[torch.device, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"BatchedPrepareFinalize(max_tokens_per_expert={self.max_tokens_per_expert})"

    def tokens_per_expert(self, M: int) -> int:
        """Rows per expert T of the batched buffers for M tokens."""
        cap = self.max_tokens_per_expert
        return M if cap is None else min(cap, M)

    def problem(self, p: MoEProblem) -> MoEProblem:
        return replace(p, max_tokens_per_expert=self.tokens_per_expert(p.M))

    def plan(self, p: MoEProblem) -> list[BufferSpec]:
        T = self.tokens_per_expert(p.M)
        return scatter_plan("b_", p.slots, p.H, p.E, T, p.dtype) + gather_plan("b_", p.slots, p.H, p.E, T, p.dtype)

    def max_count(self, device: torch.device | str) -> torch.Tensor:
        """int64 [1] on ``device``: the largest per-expert token count (before capping) of the last call there.

        A persistent tensor written (not accumulated) by every call; read it after a CUDA-graph replay to
        detect a capacity overflow without a sync inside the graph.
        """
        return max_count_tensor(self._max_count, device)

    def prepare(self, x: ExpertsInputs, p: MoEProblem, ws: Workspace) -> ExpertsInputs:
        T = self.tokens_per_expert(p.M)
        ids = x.topk_ids if x.topk_ids.is_contiguous() else x.topk_ids.contiguous()
        mc = self.max_count(x.hidden_states.device)
        a, num_tokens = scatter_batched(
            ws, "b_", x.hidden_states, ids, x.topk_weights, E=p.E, global_E=p.global_E, T=T, top_k=p.top_k,
            expert_map=x.expert_map, weight_on_input=p.apply_router_weight_on_input, max_count_out=mc)
        if self.check_capacity and not _capturing(mc):
            worst = int(mc.item())  # the one host sync, only with check_capacity
            if worst > T:
                raise BatchedCapacityError(
                    f"an expert received {worst} tokens but max_tokens_per_expert is {T}: raise the cap (or "
                    f"pass max_tokens_per_expert=None for the static bound M={p.M}); the excess was dropped")
        return ExpertsInputs(
            hidden_states=a, w1=x.w1, w2=x.w2, topk_weights=None, topk_ids=None, expert_map=None,
            expert_num_tokens=num_tokens, w1_scale=x.w1_scale, w2_scale=x.w2_scale, a1_scale=x.a1_scale,
            a2_scale=x.a2_scale, w1_bias=x.w1_bias, w2_bias=x.w2_bias)

    def expert_output(self, output: torch.Tensor, p: MoEProblem, ws: Workspace) -> torch.Tensor:
        return ws["b_y_batched"].view(p.E, p.max_tokens_per_expert, p.H)

    def finalize(self, output, expert_output, x, p, ws) -> None:
        w = None if p.apply_router_weight_on_input else x.topk_weights
        gather_batched(ws, "b_", expert_output.view(-1, p.H), ws["b_slot_dest"], w, output, p.top_k)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


__all__ = ["BatchedCapacityError", "BatchedPrepareFinalize", "gather_batched", "gather_plan", "reduce_plan",
           "scatter_batched", "scatter_plan"]
