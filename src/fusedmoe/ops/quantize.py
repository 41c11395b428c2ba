"""fp8 (e4m3) activation quantization, by the same rule as :func:`fusedmoe.quant.fake_quantize_activation`:
``scale = max(amax, MIN_AMAX) / 448`` (IEEE division), ``q = rne(clamp(x / scale, -448, 448))``.

Rows may be *gated* by routing ids (``topk_ids`` given): row r is quantized only if slot r is local (the GEMM1
output rows of non-local slots were never written); gated-out rows of ``q`` and of the scales are not written
(GEMM2 never reads them) and never enter a per-tensor maximum.

Dynamic per-tensor scales need a max over all programs without a zeroed accumulator: launch 1 writes one partial
maximum per program into a planned ``partial`` buffer (every entry written); launch 2 reduces those partials in
every program, program 0 stores the scale, and all quantize their rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import FP8_DTYPE, FP8_MAX, MIN_AMAX
from ._util import cdiv, next_pow2
from .align import _local_expert
from .launcher import launch

_MODES = {"fp8_tensor": 1, "fp8_token": 2, "fp8_block": 3}
#: Most programs (partials) of the per-tensor max pass.
MAX_PARTIALS = 256
_MIN_AMAX: tl.constexpr = tl.constexpr(MIN_AMAX)
_FP8_MAX: tl.constexpr = tl.constexpr(FP8_MAX)


@triton.jit
def _fp8_scale(amax):
    return tl.math.div_rn(tl.maximum(amax, _MIN_AMAX), _FP8_MAX)


@triton.jit
def _round_e4m3(v):
    """Round fp32 v (|v| <= 448) to the nearest e4m3 value (ties to even), staying in fp32.

    Used under the CPU interpreter only, whose fp32->fp8 cast fails to carry into the exponent (1.98 -> 1.0);
    after this rounding the cast is exact. On the GPU the hardware conversion does the same rounding.
    """
    a = tl.abs(v)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)  # e4m3: 3 mantissa bits, min exponent -6
    ulp = ((e + 124) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((130 - e) << 23).to(tl.float32, bitcast=True)
    r = ((a * inv_ulp + 12582912.0) - 12582912.0) * ulp  # 1.5 * 2^23: round-to-nearest-even to an integer
    return tl.where(v < 0, -r, r)


@triton.jit
def _to_fp8(x, s, q_dtype, ROUND_IN_FP32: tl.constexpr):
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -_FP8_MAX), _FP8_MAX)
    if ROUND_IN_FP32:
        v = _round_e4m3(v)
    return v.to(q_dtype)


@triton.jit
def _row_is_valid(row, ids_ptr, map_ptr, global_E, E, HAS_IDS: tl.constexpr, HAS_MAP: tl.constexpr):
    if HAS_IDS:
        return _local_expert(tl.load(ids_ptr + row), map_ptr, global_E, E, HAS_MAP) >= 0
    return row >= 0


@triton.jit
def _absmax_partial(
    x_ptr,
    ids_ptr,
    map_ptr,
    partial_ptr,
    R,
    K,
    rows_per_prog,
    global_E,
    E,
    stride_xm,
    HAS_IDS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    start = pid * rows_per_prog
    stop = tl.minimum(start + rows_per_prog, R)
    amax = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for r0 in range(start, stop, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = rows < stop
        if HAS_IDS:
            loc = _local_expert(tl.load(ids_ptr + rows, mask=ok, other=-1), map_ptr, global_E, E, HAS_MAP)
            ok = ok & (loc >= 0)
        base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(base + cols[None, :], mask=ok[:, None] & (cols < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    tl.store(partial_ptr + pid, tl.max(tl.max(amax, axis=1), axis=0))


@triton.jit
def _quant_rows(
    x_ptr,
    q_ptr,
    scale_ptr,
    ids_ptr,
    map_ptr,
    partial_ptr,
    n_partial,
    K,
    global_E,
    E,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sk,
    MODE: tl.constexpr,
    DYNAMIC: tl.constexpr,
    HAS_IDS: tl.constexpr,
    HAS_MAP: tl.constexpr,
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
    if not _row_is_valid(row, ids_ptr, map_ptr, global_E, E, HAS_IDS, HAS_MAP):
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


def num_partials(rows: int) -> int:
    """Programs (= partial maxima) of the dynamic per-tensor max pass over ``rows`` rows."""
    return max(1, min(rows, MAX_PARTIALS))


def scale_shape(quant_mode: str, rows: int, K: int, group_k: int = 128) -> tuple[int, ...]:
    """Shape of the float32 activation scales our kernels write for [rows, K] activations."""
    if quant_mode == "fp8_tensor":
        return (1,)
    if quant_mode == "fp8_token":
        return (rows, 1)
    return (rows, cdiv(K, group_k))


def quantize_activation(
    x: torch.Tensor,
    quant_mode: str,
    *,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    static_scale: torch.Tensor | None = None,
    partial: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    num_experts: int | None = None,
    global_num_experts: int | None = None,
    group_k: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [R, K] (float, contiguous along K) to e4m3.

    Args:
        out: e4m3 [R, K]. scale_out: float32 of :func:`scale_shape` (unused with ``static_scale``).
        static_scale: fp8_tensor only: float32 [1] given by the caller.
        partial: float32 [num_partials(R)] scratch for the dynamic per-tensor max.
        topk_ids: int [R // k, k] (flat index = row): gate rows to local slots (see module docstring), with
            ``expert_map`` / ``num_experts`` / ``global_num_experts`` as in alignment.
        group_k: fp8_block column group (a power of two).

    Returns:
        (q, scale): ``scale`` is ``static_scale`` when given, else ``scale_out``.
    """
    if quant_mode not in _MODES:
        raise ValueError(f"unknown quant mode {quant_mode!r}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be 2-D and contiguous along its last dim")
    R, K = x.shape
    mode = _MODES[quant_mode]
    dynamic = quant_mode == "fp8_tensor" and static_scale is None
    if static_scale is not None and quant_mode != "fp8_tensor":
        raise ValueError("a static activation scale is only defined for fp8_tensor")
    if out is None:
        out = torch.empty((R, K), dtype=FP8_DTYPE, device=x.device)
    if static_scale is not None:
        scale = static_scale
    else:
        scale = (
            scale_out
            if scale_out is not None
            else torch.empty(scale_shape(quant_mode, R, K, group_k), dtype=torch.float32, device=x.device)
        )
    if R == 0:
        return out, scale
    has_ids = topk_ids is not None
    if has_ids:
        if topk_ids.numel() != R or not topk_ids.is_contiguous():
            raise ValueError("topk_ids must be contiguous with one id per row of x")
        num_experts = int(num_experts)
        if global_num_experts is None:
            global_num_experts = expert_map.numel() if expert_map is not None else num_experts
    ids_arg = topk_ids if has_ids else x
    map_arg = expert_map if expert_map is not None else ids_arg
    gE, E = (global_num_experts or 0), (num_experts or 0)
    block_k = group_k if mode == 3 else max(16, min(1024, next_pow2(K)))
    n_part = num_partials(R)
    if dynamic:
        if partial is None:
            partial = torch.empty(n_part, dtype=torch.float32, device=x.device)
        rpp = cdiv(R, n_part)
        launch(
            _absmax_partial,
            (n_part,),
            x,
            ids_arg,
            map_arg,
            partial,
            R,
            K,
            rpp,
            gE,
            E,
            x.stride(0),
            HAS_IDS=has_ids,
            HAS_MAP=expert_map is not None,
            BLOCK_R=4,
            BLOCK_K=min(block_k, 256),
            num_warps=4,
        )
    sm, sk = (scale.stride(0), scale.stride(1)) if scale.dim() == 2 else (0, 0)
    launch(
        _quant_rows,
        (R,),
        x,
        out,
        scale,
        ids_arg,
        map_arg,
        partial if dynamic else x,
        n_part,
        K,
        gE,
        E,
        x.stride(0),
        out.stride(0),
        sm,
        sk,
        MODE=mode,
        DYNAMIC=dynamic,
        HAS_IDS=has_ids,
        HAS_MAP=expert_map is not None,
        BLOCK_K=block_k,
        P_PAD=next_pow2(n_part),
        ROUND_IN_FP32=x.device.type == "cpu",
        num_warps=4,
    )
    return out, scale


__all__ = ["num_partials", "quantize_activation", "scale_shape"]
