"""Top-k reduce: ``out[t] = sum_j y[t*k + j]`` over the local slots of token t (fp32 accumulate, one cast).

Non-local slots (same rule as alignment: :func:`fusedmoe.ops.align._local_expert`) are skipped without reading
their ``y`` rows, which no GEMM wrote; a token with no local slot gets a zero row. Every output element is
written, so neither ``y`` nor ``out`` needs zeroing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import cdiv, next_pow2
from .align import _local_expert
from .launcher import launch


@triton.jit
def _moe_reduce(
    y_ptr,
    ids_ptr,
    map_ptr,
    out_ptr,
    H,
    global_E,
    E,
    stride_ym,
    stride_om,
    TOP_K: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = t * TOP_K + j
        local = _local_expert(tl.load(ids_ptr + slot), map_ptr, global_E, E, HAS_MAP)
        y = tl.load(y_ptr + slot * stride_ym + offs, mask=h_ok & (local >= 0), other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + t * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def reduce_block_h(H: int) -> int:
    return max(16, min(1024, next_pow2(H)))


def moe_reduce(
    y: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    num_experts: int,
    *,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
) -> torch.Tensor:
    """Sum the weighted slot rows of each token.

    Args:
        y: [M*k, H] slot-indexed rows (already multiplied by routing weights), contiguous in H.
        topk_ids: int32/int64 [M, k] contiguous. out: [M, H] (any float dtype), written in full.
        num_experts, expert_map, global_num_experts: as for :func:`fusedmoe.ops.align.moe_align`.
    """
    M, k = topk_ids.shape
    H = out.shape[1]
    if y.shape[0] != M * k or y.shape[1] != H or out.shape[0] != M:
        raise ValueError(
            f"shape mismatch: y {tuple(y.shape)}, topk_ids {tuple(topk_ids.shape)}, out {tuple(out.shape)}"
        )
    if y.stride(1) != 1 or out.stride(1) != 1 or not topk_ids.is_contiguous():
        raise ValueError("y and out must be contiguous along H, topk_ids contiguous")
    if M == 0 or H == 0:
        return out
    if global_num_experts is None:
        global_num_experts = expert_map.numel() if expert_map is not None else num_experts
    bh = reduce_block_h(H)
    launch(
        _moe_reduce,
        (M, cdiv(H, bh)),
        y,
        topk_ids,
        expert_map if expert_map is not None else topk_ids,
        out,
        H,
        global_num_experts,
        num_experts,
        y.stride(0),
        out.stride(0),
        TOP_K=k,
        HAS_MAP=expert_map is not None,
        BLOCK_H=bh,
        num_warps=4,
    )
    return out


__all__ = ["moe_reduce"]
