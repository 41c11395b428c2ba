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
from typing import NamedTuple

import torch

from ..experts.base import ExpertsInputs
from ..experts.torch_experts import local_expert_keys
from ..problem import Layout, MoEProblem
from ..steps import step
from ..workspace.manager import Workspace
from ..workspace.plan import BufferSpec
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


class ScatterBuffers(NamedTuple):
    """Views used by :func:`scatter_batched` (plan buffers ``b_<field>``, see :func:`scatter_plan`)."""

    keys: torch.Tensor
    sorted_keys: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor
    counts: torch.Tensor
    rank: torch.Tensor
    dest: torch.Tensor
    ok: torch.Tensor
    bad: torch.Tensor
    a_sorted: torch.Tensor
    w_sorted: torch.Tensor
    slot_dest: torch.Tensor
    num_tokens: torch.Tensor
    a_batched: torch.Tensor


class GatherBuffers(NamedTuple):
    """Views used by :func:`gather_batched` (plan buffers ``<prefix>g_index`` etc., see :func:`gather_plan`)."""

    index: torch.Tensor
    invalid: torch.Tensor
    rows: torch.Tensor


#: The plan names of the :class:`ScatterBuffers` fields, in field order (a step's ``group``, see :func:`scatter_plan`).
SCATTER_BUFFERS = tuple("b_" + f for f in ScatterBuffers._fields)


def scatter_plan(S: int, H: int, E: int, T: int, dtype: torch.dtype) -> list[BufferSpec]:
    """Buffers ``b_*`` of :func:`scatter_batched` for S slots into E experts of T rows of width H."""
    i64, i32, b = torch.int64, torch.int32, torch.bool
    shapes = dict(
        keys=((S,), i64),
        sorted_keys=((S,), i64),
        order=((S,), i64),
        offsets=((E + 1,), i64),
        counts=((E,), i64),
        rank=((S,), i64),
        dest=((S,), i64),
        ok=((S,), b),
        bad=((S,), b),
        a_sorted=((S, H), dtype),
        w_sorted=((S,), torch.float32),
        slot_dest=((S,), i64),
        num_tokens=((E,), i32),
        a_batched=((E * T + 1, H), dtype),
    )
    return [BufferSpec(name, *shapes[f]) for name, f in zip(SCATTER_BUFFERS, ScatterBuffers._fields)]


def gather_plan(prefix: str, S: int, H: int, dtype: torch.dtype) -> list[BufferSpec]:
    """Buffers ``<prefix>g_*`` of :func:`gather_batched` over S slots of width H."""
    return [
        BufferSpec(prefix + "g_index", (S,), torch.int64),
        BufferSpec(prefix + "g_invalid", (S,), torch.bool),
        BufferSpec(prefix + "g_rows", (S, H), dtype),
    ]


def scatter_batched(
    b: ScatterBuffers,
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
    local_expert_keys(topk_ids, expert_map, E, global_E, out=b.keys, scratch=b.sorted_keys)
    torch.sort(b.keys, stable=True, out=(b.sorted_keys, b.order))
    torch.searchsorted(b.sorted_keys, _arange(E + 1, dev), out=b.offsets)
    torch.sub(b.offsets[1:], b.offsets[:-1], out=b.counts)
    if max_count_out is not None:
        if E:
            torch.amax(b.counts, dim=0, keepdim=True, out=max_count_out)
        else:
            max_count_out.fill_(0)
    b.num_tokens.copy_(b.counts.clamp_(max=T))

    rank, dest, bad = b.rank, b.dest, b.bad
    torch.index_select(b.offsets, 0, b.sorted_keys, out=rank)  # segment start of each sorted slot
    torch.sub(_arange(S, dev), rank, out=rank)
    torch.ge(rank, T, out=bad)  # over capacity
    bad.logical_or_(torch.ge(b.sorted_keys, E, out=b.ok))  # not local
    torch.mul(b.sorted_keys, T, out=dest)
    dest.add_(rank)
    dest.masked_fill_(bad, -1)
    b.slot_dest.index_copy_(0, b.order, dest)  # order is a permutation: every element written
    trash = E * T
    dest.masked_fill_(bad, trash)

    a_sorted = b.a_sorted
    torch.index_select(hidden, 0, torch.div(b.order, top_k, rounding_mode="floor", out=rank), out=a_sorted)
    if weight_on_input:
        torch.index_select(topk_weights.reshape(-1).to(torch.float32), 0, b.order, out=b.w_sorted)
        a_sorted.mul_(b.w_sorted[:, None])
    b.a_batched.index_copy_(0, dest, a_sorted)
    H = hidden.shape[1]
    return b.a_batched[:trash].view(E, T, H), b.num_tokens


def gather_batched(
    g: GatherBuffers,
    y_batched: torch.Tensor,
    slot_dest: torch.Tensor,
    topk_weights: torch.Tensor | None,
    out: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * y[slot_dest[t*k + j]]`` over slots with a row (``topk_weights`` None: no
    weighting). ``y_batched`` [E*T, H] is read at valid rows only; ``out`` [M, H] is written in full."""
    S = slot_dest.numel()
    idx, invalid, rows = g.index[:S], g.invalid[:S], g.rows[:S]
    torch.lt(slot_dest, 0, out=invalid)
    torch.clamp(slot_dest, min=0, out=idx)
    torch.index_select(y_batched, 0, idx, out=rows)
    rows.masked_fill_(invalid[:, None], 0)  # a select: NaN in unread rows never reaches the result
    if topk_weights is not None:
        rows.mul_(topk_weights.reshape(-1)[:S, None])
    M = S // top_k if top_k else 0
    torch.sum(rows.view(M, top_k, rows.shape[1]), dim=1, out=out)
    return out


def prepared_inputs(
    x: ExpertsInputs,
    hidden_states: torch.Tensor,
    *,
    topk_weights: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    expert_num_tokens: torch.Tensor | None = None,
    a1_scale: torch.Tensor | None,
) -> ExpertsInputs:
    """What the experts run on after prepare moved the tokens (scattered them into the batched layout, or
    received them from other ranks): the given token side and ``a1_scale``, and ``x``'s weights, weight scales,
    ``a2_scale`` and biases."""
    return ExpertsInputs(
        hidden_states,
        x.w1,
        x.w2,
        topk_weights,
        topk_ids,
        expert_map,
        expert_num_tokens,
        x.w1_scale,
        x.w2_scale,
        a1_scale,
        x.a2_scale,
        x.w1_bias,
        x.w2_bias,
    )


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
            isinstance(max_tokens_per_expert, bool)
            or not isinstance(max_tokens_per_expert, int)
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

    def buffers(self, p: MoEProblem) -> list[BufferSpec]:
        if p.M == 0:
            return []
        T = self.tokens_per_expert(p.M)
        y = BufferSpec("b_y_batched", (p.E * T, p.H), p.dtype, region="2")
        return [*scatter_plan(p.slots, p.H, p.E, T, p.dtype), y, *gather_plan("b_", p.slots, p.H, p.dtype)]

    def prepare_steps(self, p: MoEProblem):
        return [] if p.M == 0 else [_scatter]

    def finalize_steps(self, p: MoEProblem):
        return [] if p.M == 0 else [_gather]

    def exports(self, p: MoEProblem) -> tuple[str, ...]:
        return () if p.M == 0 else ("b_a_batched", "b_num_tokens", "b_y_batched")

    def max_count(self, device: torch.device | str) -> torch.Tensor:
        """int64 [1] on ``device``: the largest per-expert token count (before capping) of the last call there.

        A persistent tensor written (not accumulated) by every call; read it after a CUDA-graph replay to
        detect a capacity overflow without a sync inside the graph.
        """
        return max_count_tensor(self._max_count, device)

    def expert_output(self, output: torch.Tensor, inner: MoEProblem, ws: Workspace) -> torch.Tensor:
        return ws["b_y_batched"].view(inner.E, inner.max_tokens_per_expert, inner.H)


@step(group=SCATTER_BUFFERS)
def _scatter(c, *b):
    x, p, pf = c.x, c.p, c.component
    T = pf.tokens_per_expert(p.M)
    ids = x.topk_ids if x.topk_ids.is_contiguous() else x.topk_ids.contiguous()
    mc = pf.max_count(x.hidden_states.device)
    a, num_tokens = scatter_batched(
        ScatterBuffers(*b),
        x.hidden_states,
        ids,
        x.topk_weights,
        E=p.E,
        global_E=p.global_E,
        T=T,
        top_k=p.top_k,
        expert_map=x.expert_map,
        weight_on_input=p.apply_router_weight_on_input,
        max_count_out=mc,
    )
    if pf.check_capacity and not _capturing(mc):
        worst = int(mc.item())  # the one host sync, only with check_capacity
        if worst > T:
            raise BatchedCapacityError(
                f"an expert received {worst} tokens but max_tokens_per_expert is {T}: raise the cap (or "
                f"pass max_tokens_per_expert=None for the static bound M={p.M}); the excess was dropped"
            )
    c.prepared = prepared_inputs(x, a, expert_num_tokens=num_tokens, a1_scale=x.a1_scale)


@step
def _gather(c, b_y_batched, b_slot_dest, b_g_index, b_g_invalid, b_g_rows):
    p = c.p
    w = None if p.apply_router_weight_on_input else c.x.topk_weights
    gather_batched(GatherBuffers(b_g_index, b_g_invalid, b_g_rows), b_y_batched, b_slot_dest, w, c.out, p.top_k)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


__all__ = [
    "SCATTER_BUFFERS",
    "BatchedCapacityError",
    "BatchedPrepareFinalize",
    "GatherBuffers",
    "ScatterBuffers",
    "gather_batched",
    "gather_plan",
    "prepared_inputs",
    "scatter_batched",
    "scatter_plan",
]
