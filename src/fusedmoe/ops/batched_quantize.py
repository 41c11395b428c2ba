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
from ._util import cdiv
from .launcher import launch
from .quantize import (
    _absmax_meta,
    _absmax_rows,
    _mode,
    _quant_rows,
    _row_block_k,
    _row_meta,
    _row_strides,
    scale_shape,
)

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
    x_e = x_ptr + e.to(tl.int64) * T * stride_xm
    tl.store(partial_ptr + pid, _absmax_rows(x_e, start, stop, K, stride_xm, None, False, False, BLOCK_R, BLOCK_K))


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
    mode, dynamic = _mode(quant_mode, static_scale)
    if x.dim() != 2 or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("x and out must be 2-D and contiguous along their last dim")
    R, K = x.shape
    E = expert_num_tokens.numel()
    if R != E * T:
        raise ValueError(f"x has {R} rows, expected E*T = {E}*{T}")
    scale = static_scale if static_scale is not None else scale_out
    if scale is None:
        raise ValueError("scale_out is required for dynamic scales")
    if R == 0:
        return out, scale
    block_k = _row_block_k(mode, K, group_k)
    C = _chunks(E, T)
    n_part = E * C
    if dynamic:
        if partial is None or partial.numel() < n_part:
            raise ValueError(f"dynamic fp8_tensor needs a float32 partial buffer of {n_part} entries")
        args = (x, expert_num_tokens, partial, T, K, C, cdiv(T, C), x.stride(0))
        launch(_batched_absmax_partial, (n_part,), *args, **_absmax_meta(block_k))
    args = (x, out, scale, None, None, expert_num_tokens, partial if dynamic else x, n_part, T, K, None, None)
    meta = _row_meta(mode, dynamic, block_k, n_part, x)
    launch(_quant_rows, (R,), *args, *_row_strides(x, out, scale), HAS_IDS=False, HAS_MAP=False, BATCHED=True, **meta)
    return out, scale


__all__ = ["FP8_DTYPE", "batched_num_partials", "batched_quantize", "scale_shape"]
