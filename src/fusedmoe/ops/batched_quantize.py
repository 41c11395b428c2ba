"""fp8 (e4m3) quantization of batched activations ``[E*T, K]``, valid rows only.

Row ``r`` of expert ``e`` (flat row ``e*T + r``) is valid iff ``r < expert_num_tokens[e]``. Invalid (padded)
rows are never loaded, never enter a maximum, and their ``q`` and scale rows are never written: the batched
GEMMs never read them. This is what makes the batched path free of zero fills (vLLM had to zero its
intermediate cache because a per-tensor amax spanned the padded rows).

Rule (as :mod:`fusedmoe.ops.quantize`): ``scale = max(amax, MIN_AMAX) / 448``, ``q = rne(clamp(x / scale))``.

- ``fp8_tensor`` dynamic: launch 1, grid (E * C): program (e, c) writes the max of |x| over its chunk of the
  *valid* rows of expert e (0 when the chunk is empty) into ``partial[e*C + c]``: every entry written, no zeroed
  accumulator, no atomics. Launch 2 (one program per row) reduces the partials in every program, program 0
  stores the scale, and valid rows are quantized.
- ``fp8_tensor`` static: the caller's scale. ``fp8_token``: one scale per valid row. ``fp8_block``: one scale per
  valid row and group of ``group_k`` columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import FP8_DTYPE
from ._util import cdiv, next_pow2
from .launcher import launch
from .quantize import _fp8_scale, _to_fp8, scale_shape

_MODES = {"fp8_tensor": 1, "fp8_token": 2, "fp8_block": 3}
#: Most partial maxima of the per-tensor pass (at least one per expert).
MAX_PARTIALS = 256


def batched_num_partials(E: int, T: int) -> int:
    """Entries of the ``partial`` buffer of the dynamic per-tensor pass (E * chunks per expert)."""
    return E * _chunks(E, T)


def _chunks(E: int, T: int) -> int:
    return max(1, min(T, MAX_PARTIALS // max(E, 1)))


@triton.jit
def _batched_absmax_partial(
    x_ptr, count_ptr, partial_ptr, T, K, C, rows_per_chunk, stride_xm, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr
):
    pid = tl.program_id(0)
    e = pid // C
    c = pid % C
    count = tl.minimum(tl.load(count_ptr + e), T)
    start = c * rows_per_chunk
    stop = tl.minimum(start + rows_per_chunk, count)
    amax = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    base_e = x_ptr + e.to(tl.int64) * T * stride_xm
    for r0 in range(start, stop, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = rows < stop
        base = base_e + rows.to(tl.int64)[:, None] * stride_xm
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(base + cols[None, :], mask=ok[:, None] & (cols < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    tl.store(partial_ptr + pid, tl.max(tl.max(amax, axis=1), axis=0))


@triton.jit
def _batched_quant_rows(
    x_ptr,
    q_ptr,
    scale_ptr,
    count_ptr,
    partial_ptr,
    n_partial,
    T,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sk,
    MODE: tl.constexpr,
    DYNAMIC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    P_PAD: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    q_dtype = q_ptr.dtype.element_ty
    if MODE == 1:
        if DYNAMIC:
            offs_p = tl.arange(0, P_PAD)
            s = _fp8_scale(tl.max(tl.load(partial_ptr + offs_p, mask=offs_p < n_partial, other=0.0), axis=0))
            if row == 0:
                tl.store(scale_ptr, s)
        else:
            s = tl.load(scale_ptr)
    e = row // T
    if row - e * T >= tl.load(count_ptr + e):
        return
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if MODE == 2:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)))
        s = _fp8_scale(tl.max(amax, axis=0))
        tl.store(scale_ptr + row * stride_sm, s)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        if MODE == 3:  # BLOCK_K == group size: one scale per (row, group)
            s = _fp8_scale(tl.max(tl.abs(x), axis=0))
            tl.store(scale_ptr + row * stride_sm + (k0 // BLOCK_K) * stride_sk, s)
        tl.store(q_row + cols, _to_fp8(x, s, q_dtype, ROUND_IN_FP32), mask=cols < K)


def batched_quantize(
    x: torch.Tensor,
    expert_num_tokens: torch.Tensor,
    T: int,
    quant_mode: str,
    *,
    out: torch.Tensor,
    scale_out: torch.Tensor | None = None,
    static_scale: torch.Tensor | None = None,
    partial: torch.Tensor | None = None,
    group_k: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the valid rows of x [E*T, K] (contiguous along K) to e4m3.

    Args:
        expert_num_tokens: int32 [E]; T: rows per expert. out: e4m3 [E*T, K].
        scale_out: float32 of ``scale_shape(quant_mode, E*T, K, group_k)`` (unused with ``static_scale``).
        partial: float32 [batched_num_partials(E, T)] (dynamic fp8_tensor only).

    Returns:
        (q, scale).
    """
    if quant_mode not in _MODES:
        raise ValueError(f"unknown quant mode {quant_mode!r}")
    if x.dim() != 2 or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("x and out must be 2-D and contiguous along their last dim")
    R, K = x.shape
    E = expert_num_tokens.numel()
    if R != E * T:
        raise ValueError(f"x has {R} rows, expected E*T = {E}*{T}")
    mode = _MODES[quant_mode]
    dynamic = quant_mode == "fp8_tensor" and static_scale is None
    if static_scale is not None and quant_mode != "fp8_tensor":
        raise ValueError("a static activation scale is only defined for fp8_tensor")
    scale = static_scale if static_scale is not None else scale_out
    if scale is None:
        raise ValueError("scale_out is required for dynamic scales")
    if R == 0:
        return out, scale
    block_k = group_k if mode == 3 else max(16, min(1024, next_pow2(K)))
    C = _chunks(E, T)
    n_part = E * C
    if dynamic:
        if partial is None or partial.numel() < n_part:
            raise ValueError(f"dynamic fp8_tensor needs a float32 partial buffer of {n_part} entries")
        launch(
            _batched_absmax_partial,
            (n_part,),
            x,
            expert_num_tokens,
            partial,
            T,
            K,
            C,
            cdiv(T, C),
            x.stride(0),
            BLOCK_R=4,
            BLOCK_K=min(block_k, 256),
            num_warps=4,
        )
    sm, sk = (scale.stride(0), scale.stride(1)) if scale.dim() == 2 else (0, 0)
    launch(
        _batched_quant_rows,
        (R,),
        x,
        out,
        scale,
        expert_num_tokens,
        partial if dynamic else x,
        n_part,
        T,
        K,
        x.stride(0),
        out.stride(0),
        sm,
        sk,
        MODE=mode,
        DYNAMIC=dynamic,
        BLOCK_K=block_k,
        P_PAD=next_pow2(n_part),
        ROUND_IN_FP32=x.device.type == "cpu",
        num_warps=4,
    )
    return out, scale


__all__ = ["FP8_DTYPE", "batched_num_partials", "batched_quantize", "scale_shape"]
