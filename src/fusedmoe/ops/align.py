"""Align (token, expert) slots to experts in BLOCK_M-row blocks: a deterministic counting sort.

Outputs, all written by the kernels themselves (no fill, no zeros, no host sync, CUDA-graph capturable):

- ``sorted_ids`` int32 [max_padded]: flat slot indices ``token * k + j`` grouped by local expert (in slot order
  within an expert), each expert's segment padded to a multiple of BLOCK_M with the sentinel ``M * k``.
  Entries at positions ``>= num_padded`` are not written (no consumer reads them).
- ``block_expert`` int32 [max_blocks]: local expert of each BLOCK_M block; -1 for every block at or past
  ``num_padded``. Every entry is written.
- ``num_padded`` int32 [1]: total padded length (a multiple of BLOCK_M).

Non-local slots (id outside [0, global_E), or expert_map[id] == -1) are *skipped*: they appear in no block,
so the GEMMs never compute them and the top-k reduce skips them by the same rule (``_local_expert``).

Algorithm: three regimes by slot count ``n`` (``AlignParams.mode``), all free of data-dependent loops:

- ``"pairs"`` (n <= PAIRS_MAX_SLOTS, decode): one launch, one program, no per-expert vectors at all. All slots
  are loaded at once; one [S, S] reduction gives, per slot, the count of its expert and its rank among earlier
  slots of that expert (packed as ``count + rank << 16``); a second [S, S] reduction gives its destination
  ``sum of padded counts of smaller experts (counted once, by each expert's first slot) + rank``. Each slot
  writes ``sorted_ids[dest]`` and ``block_expert[dest // BLOCK_M]`` (every block below num_padded holds at
  least one real slot, so this writes every live block entry; duplicate writes carry the same value); the
  last slot of each expert writes its segment's sentinels; a masked store writes -1 to the blocks at/after
  num_padded. The cost is O(S^2) with S <= 64, independent of E; 1-4 warps.
- ``"single"`` (n <= SINGLE_MAX_SLOTS): one launch, ``n_prog`` programs of ``span`` (= ``sub``, 32-64) slots
  (``sub = next_pow2(n / TARGET_PROGRAMS)`` clamped to [MIN_SUB, MAX_SUB], at most MAX_PROGRAMS). Every program loads
  *all* slots at once and builds two histograms (``tl.histogram`` over E_PAD bins): totals, and the prefix
  of the slots before its span; a cumsum of padded totals gives the segment starts. It ranks its own span
  with a [span, span] comparison and scatters it (``sorted_ids`` and ``block_expert[dest // BLOCK_M]``).
  The sentinels (experts split evenly over programs, [EC, BLOCK_M] tiles) and the -1 tail of
  ``block_expert`` (blocks split evenly) are shared. Redundant histograms are cheaper than a second launch
  while n is moderate (each program's histograms cost ~n / threads ballots; at n = 8192 that outweighs a launch).
- ``"two"`` (larger n): launch 1 (``_align_count``, ``n_prog`` programs) writes the histogram of each span to
  ``partial`` [n_prog, E_PAD]; launch 2 (``_align_scatter``, same grid) is the "single" program with totals
  and prefix read from ``partial`` in [ROWS, E_PAD] tiles instead. Spans are ``sub``-slot sub-chunks
  (<= 128, ranked by a [sub, sub] comparison); n_prog <= MAX_PROGRAMS keeps each program's ``partial`` read
  small (<= MAX_PROGRAMS * E_PAD int32). Launch 2 loads and ranks its first sub-chunk before reading
  ``partial``; with ``USE_PDL`` (env FUSEDMOE_ALIGN_PDL=1, Hopper+) launch 2 is a programmatic dependent
  launch that does this prologue while launch 1 runs, then waits (``griddepcontrol.wait``).

Thresholds can be overridden from the environment (FUSEDMOE_ALIGN_PAIRS_MAX, FUSEDMOE_ALIGN_SINGLE_MAX) to
compare regimes on a GPU. Static sizes: ``max_padded = M*k + E*(BLOCK_M-1)``,
``max_blocks = cdiv(max_padded, BLOCK_M)``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._util import cdiv, next_pow2
from .launcher import launch

#: Up to this many slots: one single-program launch with [S, S] slot-pair reductions (S <= 64 keeps them cheap).
PAIRS_MAX_SLOTS = int(os.environ.get("FUSEDMOE_ALIGN_PAIRS_MAX", "64"))
#: Up to this many slots: one multi-program launch, every program histogramming all slots.
SINGLE_MAX_SLOTS = int(os.environ.get("FUSEDMOE_ALIGN_SINGLE_MAX", "4096"))
#: Sub-chunk (ranked by a [sub, sub] comparison) = next_pow2(n / TARGET_PROGRAMS) clamped to [MIN_SUB, MAX_SUB].
MIN_SUB = 32
MAX_SUB = 128
TARGET_PROGRAMS = 128
#: Most programs of the multi-program regimes (launch 2 re-reads all n_prog histogram rows).
MAX_PROGRAMS = 128
#: Launch 2 of the "two" regime as a programmatic dependent launch (Hopper+; off under the interpreter).
USE_PDL = os.environ.get("FUSEDMOE_ALIGN_PDL", "0") == "1"
#: Element budget of one 2-D register tile (sentinel and -1 tiles are cut to stay under it).
_TILE = 4096


@triton.jit
def _local_expert(ids, map_ptr, global_E, E, HAS_MAP: tl.constexpr):
    """Local expert of global ids (any int tensor), -1 where non-local or out of range. Never reads OOB."""
    # range-check in the ids' own dtype: casting int64 first would wrap 2**32 + 1 onto expert 1
    in_range = (ids >= 0) & (ids < global_E)
    ids = tl.where(in_range, ids, 0).to(tl.int32)
    if HAS_MAP:
        safe = tl.where(in_range, ids, 0)
        loc = tl.load(map_ptr + safe, mask=in_range, other=-1).to(tl.int32)
    else:
        loc = tl.where(in_range, ids, -1)
    return tl.where((loc >= 0) & (loc < E), loc, -1)


@triton.jit
def _load_local_expert(ids_ptr, offs, mask, map_ptr, global_E, E, HAS_MAP: tl.constexpr):
    """Local expert of the ids at ``ids_ptr + offs`` where ``mask`` (-1 elsewhere: masked-off ids are not read)."""
    return _local_expert(tl.load(ids_ptr + offs, mask=mask, other=-1), map_ptr, global_E, E, HAS_MAP)


@triton.jit
def _program_span(span, n):
    """(pid, start, stop): the items [start, stop) = [pid * span, min(pid * span + span, n)) of this program."""
    pid = tl.program_id(0)
    start = pid * span
    return pid, start, tl.minimum(start + span, n)


@triton.jit
def _tail_blocks(block_expert_ptr, num_padded, lo, hi, BLOCK_M: tl.constexpr, BB: tl.constexpr):
    """block_expert[b] = -1 for b in [lo, hi) at/after num_padded (entries below are written by their slots)."""
    first_free = num_padded // BLOCK_M
    for b0 in range(lo, hi, BB):
        b = b0 + tl.arange(0, BB)
        tl.store(block_expert_ptr + b, -1, mask=(b >= first_free) & (b < hi))


@triton.jit
def _align_pairs(
    ids_ptr,
    map_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    n_slots,
    global_E,
    E,
    max_blocks,
    HAS_MAP: tl.constexpr,
    S: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PW: tl.constexpr,
    BB: tl.constexpr,
):
    i = tl.arange(0, S)
    m = i < n_slots
    e = _load_local_expert(ids_ptr, i, m, map_ptr, global_E, E, HAS_MAP)
    ok = m & (e >= 0)
    e = tl.where(ok, e, -1)
    # per slot i: count of its expert (low 16 bits) and rank among earlier slots of that expert (high 16 bits)
    same = (e[:, None] == e[None, :]) & ok[:, None]
    packed = tl.sum(tl.where(same, tl.where(i[None, :] < i[:, None], 65537, 1), 0), axis=1)
    cnt = packed & 0xFFFF
    rank = packed >> 16
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    lead = tl.where(ok & (rank == 0), padded, 0)  # each expert's padded length, once (by its first slot)
    dest = tl.sum(tl.where(e[None, :] < e[:, None], lead[None, :], 0), axis=1) + rank
    num_padded = tl.sum(lead, axis=0)
    tl.store(num_padded_ptr, num_padded)
    tl.store(sorted_ptr + dest, i, mask=ok)
    tl.store(block_expert_ptr + dest // BLOCK_M, e, mask=ok)
    if BLOCK_M > 1:  # sentinels: the last slot of each expert pads its segment
        npad = tl.where(ok & (rank == cnt - 1), padded - cnt, 0)
        for t0 in tl.static_range(0, BLOCK_M - 1, PW):
            t = t0 + tl.arange(0, PW)
            tl.store(sorted_ptr + (dest + 1)[:, None] + t[None, :], n_slots, mask=t[None, :] < npad[:, None])
    _tail_blocks(block_expert_ptr, num_padded, 0, max_blocks, BLOCK_M, BB)


@triton.jit
def _sub_rank(ids_ptr, map_ptr, s0, stop, global_E, E, HAS_MAP: tl.constexpr, SUB: tl.constexpr):
    """Slots [s0, s0 + SUB) ∩ [.., stop): offsets, local expert (0 where skipped), ok, rank in the sub-chunk."""
    sub = tl.arange(0, SUB)
    offs = s0 + sub
    m = offs < stop
    e = _load_local_expert(ids_ptr, offs, m, map_ptr, global_E, E, HAS_MAP)
    ok = m & (e >= 0)
    e0 = tl.where(ok, e, 0)
    same = (e0[:, None] == e0[None, :]) & ok[None, :] & (sub[None, :] < sub[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)
    return offs, e0, ok, rank


@triton.jit
def _align_count(
    ids_ptr,
    map_ptr,
    partial_ptr,
    n_slots,
    global_E,
    E,
    span,
    HAS_MAP: tl.constexpr,
    SUB: tl.constexpr,
    E_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
    pid, start, stop = _program_span(span, n_slots)
    hist = tl.zeros([E_PAD], dtype=tl.int32)
    for s0 in range(start, stop, SUB):
        offs = s0 + tl.arange(0, SUB)
        m = offs < stop
        e = _load_local_expert(ids_ptr, offs, m, map_ptr, global_E, E, HAS_MAP)
        hist += tl.histogram(tl.where(e >= 0, e, 0), E_PAD, mask=m & (e >= 0)).to(tl.int32)
    tl.store(partial_ptr + pid * E_PAD + tl.arange(0, E_PAD), hist)


@triton.jit
def _align_scatter(
    ids_ptr,
    map_ptr,
    partial_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    n_slots,
    global_E,
    E,
    span,
    n_prog,
    max_blocks,
    HAS_MAP: tl.constexpr,
    SINGLE: tl.constexpr,
    N_ALL: tl.constexpr,
    SUB: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    EC: tl.constexpr,
    PW: tl.constexpr,
    BB: tl.constexpr,
    PDL: tl.constexpr,
):
    pid, start, stop = _program_span(span, n_slots)
    e_idx = tl.arange(0, E_PAD)
    # first sub-chunk first: its loads and rank do not depend on the histograms
    offs, e0, ok, rank = _sub_rank(ids_ptr, map_ptr, start, stop, global_E, E, HAS_MAP, SUB)

    # ---- per-expert totals and the prefix of the slots before this span
    if SINGLE:
        a = tl.arange(0, N_ALL)
        am = a < n_slots
        ea = _load_local_expert(ids_ptr, a, am, map_ptr, global_E, E, HAS_MAP)
        oka = am & (ea >= 0)
        ea = tl.where(oka, ea, 0)
        total = tl.histogram(ea, E_PAD, mask=oka).to(tl.int32)
        prefix = tl.histogram(ea, E_PAD, mask=oka & (a < start)).to(tl.int32)
    else:
        if PDL:
            gdc_wait()
        total = tl.zeros([E_PAD], dtype=tl.int32)
        prefix = tl.zeros([E_PAD], dtype=tl.int32)
        for r0 in range(0, n_prog, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            tile = tl.load(partial_ptr + rows[:, None] * E_PAD + e_idx[None, :], mask=(rows < n_prog)[:, None], other=0)
            total += tl.sum(tile, axis=0)
            prefix += tl.sum(tl.where((rows < pid)[:, None], tile, 0), axis=0)

    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    seg_start = tl.cumsum(padded, 0) - padded
    num_padded = tl.sum(padded, axis=0)
    if pid == 0:
        tl.store(num_padded_ptr, num_padded)

    # ---- scatter: dest = segment start + same-expert slots before this sub-chunk + rank inside it
    base = seg_start + prefix
    dest = tl.gather(base, e0, 0) + rank
    tl.store(sorted_ptr + dest, offs, mask=ok)
    tl.store(block_expert_ptr + dest // BLOCK_M, e0, mask=ok)
    for s0 in range(start + SUB, stop, SUB):
        base += tl.histogram(e0, E_PAD, mask=ok).to(tl.int32)
        offs, e0, ok, rank = _sub_rank(ids_ptr, map_ptr, s0, stop, global_E, E, HAS_MAP, SUB)
        dest = tl.gather(base, e0, 0) + rank
        tl.store(sorted_ptr + dest, offs, mask=ok)
        tl.store(block_expert_ptr + dest // BLOCK_M, e0, mask=ok)

    # ---- sentinels in the padding of this program's experts
    if BLOCK_M > 1:
        fill = seg_start + total
        npad = padded - total
        epp = tl.cdiv(E, n_prog)
        e_hi = tl.minimum(pid * epp + epp, E)
        for x0 in range(pid * epp, e_hi, EC):
            ex = x0 + tl.arange(0, EC)
            exc = tl.minimum(ex, E_PAD - 1)
            f = tl.gather(fill, exc, 0)
            c = tl.where(ex < e_hi, tl.gather(npad, exc, 0), 0)
            for t0 in tl.static_range(0, BLOCK_M - 1, PW):
                t = t0 + tl.arange(0, PW)
                tl.store(sorted_ptr + f[:, None] + t[None, :], n_slots, mask=t[None, :] < c[:, None])

    # ---- -1 for this program's share of the blocks at/after num_padded
    bpp = tl.cdiv(max_blocks, n_prog)
    _tail_blocks(block_expert_ptr, num_padded, pid * bpp, tl.minimum(pid * bpp + bpp, max_blocks), BLOCK_M, BB)


@dataclass(frozen=True)
class AlignParams:
    """Static launch parameters of one alignment (a pure function of slots, E and BLOCK_M).

    ``mode``: "pairs" | "single" (one launch, ``fused``) or "two" (count + scatter, needs ``partial``);
    ``n_prog`` programs per launch, each owning ``span`` slots ranked in ``sub``-slot sub-chunks.
    """

    n_slots: int
    num_experts: int
    block_m: int
    max_padded: int
    max_blocks: int
    fused: bool
    n_prog: int
    span: int
    sub: int
    e_pad: int
    mode: str
    num_warps: int

    @property
    def launches(self) -> int:
        return 1 if self.fused else 2

    @property
    def partial_shape(self) -> tuple[int, int]:
        """Shape of the int32 histogram scratch (empty when one launch does it all)."""
        return (0, self.e_pad) if self.fused else (self.n_prog, self.e_pad)


def max_padded_size(n_slots: int, num_experts: int, block_m: int) -> int:
    return n_slots + num_experts * (block_m - 1)


@functools.lru_cache(maxsize=4096)
def align_params(n_slots: int, num_experts: int, block_m: int) -> AlignParams:
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    max_padded = max_padded_size(n_slots, num_experts, block_m)
    max_blocks = cdiv(max_padded, block_m)
    e_pad = next_pow2(num_experts)
    common = (n_slots, num_experts, block_m, max_padded, max_blocks)
    if n_slots <= min(PAIRS_MAX_SLOTS, 1024):
        s = max(16, next_pow2(max(n_slots, 1)))
        warps = 1 if s <= 32 else 2 if s <= 64 else 4 if s <= 128 else 8
        return AlignParams(*common, True, 1, max(n_slots, 1), s, e_pad, "pairs", warps)
    sub = min(MAX_SUB, max(MIN_SUB, next_pow2(cdiv(n_slots, TARGET_PROGRAMS))))
    per_prog = cdiv(cdiv(n_slots, sub), MAX_PROGRAMS)
    span = per_prog * sub
    n_prog = cdiv(n_slots, span)
    if n_slots <= SINGLE_MAX_SLOTS:
        warps = 8 if n_slots > 4096 or sub >= 128 else 4
        return AlignParams(*common, True, n_prog, span, sub, e_pad, "single", warps)
    warps = 8 if sub >= 128 or e_pad >= 512 else 4
    return AlignParams(*common, False, n_prog, span, sub, e_pad, "two", warps)


def align_launches(n_slots: int, num_experts: int, block_m: int) -> int:
    """Kernel launches of one :func:`moe_align` call (1 or 2)."""
    return align_params(n_slots, num_experts, block_m).launches


def _use_pdl(dev: torch.device) -> bool:
    if not USE_PDL or dev.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return torch.cuda.get_device_capability(dev)[0] >= 9


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    *,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
    sorted_ids: torch.Tensor | None = None,
    block_expert: torch.Tensor | None = None,
    num_padded: torch.Tensor | None = None,
    partial: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the slots of ``topk_ids`` by local expert into BLOCK_M blocks (see the module docstring).

    Args:
        topk_ids: int32 [M, k] (contiguous) global expert ids.
        num_experts: local experts E (bins of the sort).
        block_m: BLOCK_M of the GEMMs that consume the blocks (power of two).
        expert_map: optional int32 [global_E] global -> local id (-1: not on this rank).
        global_num_experts: id range (default: len(expert_map) or num_experts).
        sorted_ids, block_expert, num_padded, partial: output / scratch tensors (from the workspace plan);
            allocated here when None (tests). Shapes: [max_padded], [max_blocks], [1] int32 and
            ``align_params(...).partial_shape`` int32 (unused by one-launch regimes).

    Returns:
        (sorted_ids, block_expert, num_padded).
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [M, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    topk_ids = topk_ids.contiguous()
    if global_num_experts is None:
        global_num_experts = expert_map.numel() if expert_map is not None else num_experts
    if expert_map is not None and expert_map.numel() < global_num_experts:
        raise ValueError(f"expert_map has {expert_map.numel()} entries, fewer than global_num_experts")
    n = topk_ids.numel()
    p = align_params(n, num_experts, block_m)
    dev = topk_ids.device

    def buf(t, shape):
        if t is None:
            return torch.empty(shape, dtype=torch.int32, device=dev)
        if t.dtype != torch.int32 or t.numel() < max(1, int(torch.Size(shape).numel())) or not t.is_contiguous():
            raise ValueError(f"scratch buffer must be contiguous int32 with >= {tuple(shape)} elements")
        return t

    sorted_ids = buf(sorted_ids, (p.max_padded,))
    block_expert = buf(block_expert, (p.max_blocks,))
    num_padded = buf(num_padded, (1,))
    map_arg = expert_map if expert_map is not None else topk_ids
    has_map = expert_map is not None
    pw = min(next_pow2(block_m), 64)
    if p.mode == "pairs":
        bb = min(next_pow2(p.max_blocks), _TILE)
        launch(
            _align_pairs,
            (1,),
            topk_ids,
            map_arg,
            sorted_ids,
            block_expert,
            num_padded,
            n,
            global_num_experts,
            num_experts,
            p.max_blocks,
            HAS_MAP=has_map,
            S=p.sub,
            BLOCK_M=block_m,
            PW=min(pw, max(1, _TILE // p.sub)),
            BB=bb,
            num_warps=p.num_warps,
        )
        return sorted_ids, block_expert, num_padded

    pdl = False
    if p.mode == "two":
        partial = buf(partial, p.partial_shape)
        pdl = _use_pdl(dev)
        launch(
            _align_count,
            (p.n_prog,),
            topk_ids,
            map_arg,
            partial,
            n,
            global_num_experts,
            num_experts,
            p.span,
            HAS_MAP=has_map,
            SUB=p.sub,
            E_PAD=p.e_pad,
            PDL=pdl,
            num_warps=4,
        )
    else:
        partial = sorted_ids  # unused
    ec = min(next_pow2(cdiv(num_experts, p.n_prog)), max(1, _TILE // pw))
    bb = min(next_pow2(cdiv(p.max_blocks, p.n_prog)), _TILE)
    rows = min(next_pow2(p.n_prog), max(1, 8192 // p.e_pad))
    launch(
        _align_scatter,
        (p.n_prog,),
        topk_ids,
        map_arg,
        partial,
        sorted_ids,
        block_expert,
        num_padded,
        n,
        global_num_experts,
        num_experts,
        p.span,
        p.n_prog,
        p.max_blocks,
        HAS_MAP=has_map,
        SINGLE=p.mode == "single",
        N_ALL=next_pow2(n),
        SUB=p.sub,
        E_PAD=p.e_pad,
        BLOCK_M=block_m,
        ROWS=rows,
        EC=ec,
        PW=pw,
        BB=bb,
        PDL=pdl,
        num_warps=p.num_warps,
        **({"launch_pdl": True} if pdl else {}),
    )
    return sorted_ids, block_expert, num_padded


def local_expert_reference(
    topk_ids: torch.Tensor,
    num_experts: int,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
) -> torch.Tensor:
    """Torch twin of ``_local_expert``: int64 local id per slot, -1 where non-local or out of range."""
    if global_num_experts is None:
        global_num_experts = expert_map.numel() if expert_map is not None else num_experts
    ids = topk_ids.long()
    in_range = (ids >= 0) & (ids < global_num_experts)
    if expert_map is not None:
        loc = expert_map.long()[ids.clamp(0, max(global_num_experts - 1, 0))]
    else:
        loc = ids
    loc = torch.where(in_range, loc, torch.full_like(loc, -1))
    return torch.where((loc >= 0) & (loc < num_experts), loc, torch.full_like(loc, -1))


def align_reference(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    *,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`moe_align` with the same output shapes; unwritten tail entries are -2
    in ``sorted_ids`` (the kernel leaves them unwritten)."""
    n = topk_ids.numel()
    p = align_params(n, num_experts, block_m)
    loc = local_expert_reference(topk_ids.reshape(-1), num_experts, expert_map, global_num_experts)
    sorted_ids = torch.full((p.max_padded,), -2, dtype=torch.int32)
    block_expert = torch.full((p.max_blocks,), -1, dtype=torch.int32)
    pos = 0
    for e in range(num_experts):
        slots = torch.nonzero(loc.cpu() == e).flatten()
        cnt = slots.numel()
        padded = -(-cnt // block_m) * block_m
        sorted_ids[pos : pos + cnt] = slots.to(torch.int32)
        sorted_ids[pos + cnt : pos + padded] = n
        block_expert[pos // block_m : (pos + padded) // block_m] = e
        pos += padded
    return sorted_ids, block_expert, torch.tensor([pos], dtype=torch.int32)


__all__ = [
    "AlignParams",
    "align_launches",
    "align_params",
    "align_reference",
    "local_expert_reference",
    "max_padded_size",
    "moe_align",
]
