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

Algorithm. Slots are cut into ``n_prog`` spans of ``span`` slots, each processed in sub-chunks of ``SUB``:
  launch 1 (``_align_count``): per-span histogram over experts -> ``partial`` [n_prog, E_PAD] (every entry);
  launch 2 (``_align_scatter``): every program sums the histograms (totals, and the prefix of earlier spans),
  scans padded counts into segment starts, and scatters its span; the rank of a slot inside its sub-chunk
  comes from a SUB x SUB comparison, so the order is deterministic. Programs also share the sentinel writes
  and the block_expert table.
Small problems (decode) fuse both into one single-program launch and need no ``partial`` buffer.

Static sizes: ``max_padded = M*k + E*(BLOCK_M-1)``, ``max_blocks = cdiv(max_padded, BLOCK_M)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: Up to this many slots, alignment is one single-program launch.
FUSED_MAX_SLOTS = 512
#: Slots per sub-chunk (the SUB x SUB rank comparison) in the multi-program path.
SUB_CHUNK = 128
#: Most programs of the multi-program path (each program re-reads all n_prog histograms).
MAX_PROGRAMS = 128


@triton.jit
def _local_expert(ids, map_ptr, global_E, E, HAS_MAP: tl.constexpr):
    """Local expert of global ids (any int tensor), -1 where non-local or out of range. Never reads OOB."""
    ids = ids.to(tl.int32)
    in_range = (ids >= 0) & (ids < global_E)
    if HAS_MAP:
        safe = tl.where(in_range, ids, 0)
        loc = tl.load(map_ptr + safe, mask=in_range, other=-1).to(tl.int32)
    else:
        loc = tl.where(in_range, ids, -1)
    return tl.where((loc >= 0) & (loc < E), loc, -1)


@triton.jit
def _span_histogram(ids_ptr, map_ptr, start, stop, global_E, E, HAS_MAP: tl.constexpr,
                    SUB: tl.constexpr, E_PAD: tl.constexpr):
    hist = tl.zeros([E_PAD], dtype=tl.int32)
    for s0 in range(start, stop, SUB):
        offs = s0 + tl.arange(0, SUB)
        m = offs < stop
        e = _local_expert(tl.load(ids_ptr + offs, mask=m, other=-1), map_ptr, global_E, E, HAS_MAP)
        hist += tl.histogram(tl.where(e >= 0, e, 0), E_PAD, mask=m & (e >= 0)).to(tl.int32)
    return hist


@triton.jit
def _align_count(ids_ptr, map_ptr, partial_ptr, n_slots, global_E, E, span,
                 HAS_MAP: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr):
    pid = tl.program_id(0)
    start = pid * span
    stop = tl.minimum(start + span, n_slots)
    hist = _span_histogram(ids_ptr, map_ptr, start, stop, global_E, E, HAS_MAP, SUB, E_PAD)
    tl.store(partial_ptr + pid * E_PAD + tl.arange(0, E_PAD), hist)


@triton.jit
def _align_scatter(ids_ptr, map_ptr, partial_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                   n_slots, global_E, E, span, n_prog, max_blocks,
                   HAS_MAP: tl.constexpr, FUSED: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, ROWS: tl.constexpr, EC: tl.constexpr, BC: tl.constexpr):
    pid = tl.program_id(0)
    start = pid * span
    stop = tl.minimum(start + span, n_slots)
    e_idx = tl.arange(0, E_PAD)

    # ---- per-expert totals and the prefix of earlier spans
    if FUSED:
        total = _span_histogram(ids_ptr, map_ptr, 0, n_slots, global_E, E, HAS_MAP, SUB, E_PAD)
        prefix = tl.zeros([E_PAD], dtype=tl.int32)
    else:
        total = tl.zeros([E_PAD], dtype=tl.int32)
        prefix = tl.zeros([E_PAD], dtype=tl.int32)
        for r0 in range(0, n_prog, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            tile = tl.load(partial_ptr + rows[:, None] * E_PAD + e_idx[None, :],
                           mask=(rows < n_prog)[:, None], other=0)
            total += tl.sum(tile, axis=0)
            prefix += tl.sum(tl.where((rows < pid)[:, None], tile, 0), axis=0)

    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    seg_end = tl.cumsum(padded, 0)
    seg_start = seg_end - padded
    num_padded = tl.sum(padded, axis=0)
    if pid == 0:
        tl.store(num_padded_ptr, num_padded)

    # ---- scatter this span's slots: dest = segment start + earlier spans + rank inside the sub-chunk
    base = seg_start + prefix
    sub = tl.arange(0, SUB)
    for s0 in range(start, stop, SUB):
        offs = s0 + sub
        m = offs < stop
        e = _local_expert(tl.load(ids_ptr + offs, mask=m, other=-1), map_ptr, global_E, E, HAS_MAP)
        ok = m & (e >= 0)
        e0 = tl.where(ok, e, 0)
        same = (e0[:, None] == e0[None, :]) & ok[None, :] & (sub[None, :] < sub[:, None])
        rank = tl.sum(same.to(tl.int32), axis=1)
        dest = tl.gather(base, e0, 0) + rank
        tl.store(sorted_ptr + dest, offs, mask=ok)
        base += tl.histogram(e0, E_PAD, mask=ok).to(tl.int32)

    # ---- sentinels in each expert's padding (experts spread over programs)
    j = tl.arange(0, BLOCK_M)
    for e0 in range(pid * EC, E, n_prog * EC):
        ex = e0 + tl.arange(0, EC)
        exc = tl.minimum(ex, E_PAD - 1)
        cnt = tl.gather(total, exc, 0)
        pad = tl.gather(padded, exc, 0) - cnt
        pos = tl.gather(seg_start, exc, 0) + cnt
        m = (ex < E)[:, None] & (j[None, :] < pad[:, None])
        tl.store(sorted_ptr + pos[:, None] + j[None, :], n_slots, mask=m)

    # ---- expert of every block; -1 at and past num_padded
    for b0 in range(pid * BC, max_blocks, n_prog * BC):
        b = b0 + tl.arange(0, BC)
        row0 = b * BLOCK_M
        owner = tl.sum((seg_end[None, :] <= row0[:, None]).to(tl.int32), axis=1)
        owner = tl.where(row0 < num_padded, owner, -1)
        tl.store(block_expert_ptr + b, owner, mask=b < max_blocks)


@dataclass(frozen=True)
class AlignParams:
    """Static launch parameters of one alignment (a pure function of slots, E and BLOCK_M)."""

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

    @property
    def partial_shape(self) -> tuple[int, int]:
        """Shape of the int32 histogram scratch (empty for the fused single-program path)."""
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
    max_blocks = triton.cdiv(max_padded, block_m)
    e_pad = triton.next_power_of_2(num_experts)
    if n_slots <= FUSED_MAX_SLOTS:
        sub = max(16, min(SUB_CHUNK, triton.next_power_of_2(max(n_slots, 1))))
        return AlignParams(n_slots, num_experts, block_m, max_padded, max_blocks, True, 1,
                           max(n_slots, 1), sub, e_pad)
    chunks = triton.cdiv(n_slots, SUB_CHUNK)
    per_prog = triton.cdiv(chunks, MAX_PROGRAMS)
    span = per_prog * SUB_CHUNK
    n_prog = triton.cdiv(n_slots, span)
    return AlignParams(n_slots, num_experts, block_m, max_padded, max_blocks, False, n_prog, span,
                       SUB_CHUNK, e_pad)


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
            ``align_params(...).partial_shape`` int32.

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
    if not p.fused:
        partial = buf(partial, p.partial_shape)
        _align_count[(p.n_prog,)](topk_ids, map_arg, partial, n, global_num_experts, num_experts, p.span,
                                  HAS_MAP=has_map, SUB=p.sub, E_PAD=p.e_pad, num_warps=4)
    else:
        partial = sorted_ids  # unused
    _align_scatter[(p.n_prog,)](
        topk_ids, map_arg, partial, sorted_ids, block_expert, num_padded,
        n, global_num_experts, num_experts, p.span, p.n_prog, p.max_blocks,
        HAS_MAP=has_map, FUSED=p.fused, SUB=p.sub, E_PAD=p.e_pad, BLOCK_M=block_m,
        ROWS=16, EC=16, BC=64, num_warps=4 if p.fused else 8,
    )
    return sorted_ids, block_expert, num_padded


def local_expert_reference(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None = None,
                           global_num_experts: int | None = None) -> torch.Tensor:
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


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int, *,
                    expert_map: torch.Tensor | None = None, global_num_experts: int | None = None,
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


__all__ = ["AlignParams", "align_params", "align_reference", "local_expert_reference", "max_padded_size",
           "moe_align"]
