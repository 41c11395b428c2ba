"""fp8 (e4m3) activation quantization, by the same rule as :func:`fusedmoe.quant.fake_quantize_activation`:
``scale = max(amax, MIN_AMAX) / 448`` (IEEE division), ``q = rne(clamp(x / scale, -448, 448))``.

Rows may be *gated* by routing ids (``topk_ids`` given): row r is quantized only if slot r is local (the GEMM1
output rows of non-local slots were never written); gated-out rows of ``q`` and of the scales are not written
(GEMM2 never reads them) and never enter a per-tensor maximum.

Dynamic per-tensor scales need a max over all programs without a zeroed accumulator: launch 1 writes one partial
maximum per program into a planned ``partial`` buffer (every entry written); launch 2 reduces those partials in
every program, program 0 stores the scale, and all quantize their rows.

The parts are shared with :mod:`fusedmoe.ops.batched_quantize`: ``_absmax_rows`` (the maximum over a range of
rows), ``_tensor_scale`` (the per-tensor scale of launch 2) and ``_quantize_row`` (the fp8 row quantizer); launch
2 is one kernel for both layouts, ``_quant_rows``, which differ only in which rows are valid (``BATCHED``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import FP8_DTYPE, FP8_MAX, MIN_AMAX
from ._util import cdiv, next_pow2
from .align import _load_local_expert, _local_expert, _program_span
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
def _absmax_rows(
    x_ptr,
    start,
    stop,
    K,
    stride_xm,
    gate,
    HAS_IDS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """max |x[r, k]| (fp32) over rows ``start <= r < stop`` and ``k < K`` of x (row r at ``x_ptr + r *
    stride_xm``), 0 when there are none. HAS_IDS: only rows whose slot is local, ``gate = (ids_ptr, map_ptr,
    global_E, E)`` as for :func:`fusedmoe.ops.align._local_expert` (unread, may be None, otherwise)."""
    if HAS_IDS:
        ids_ptr, map_ptr, global_E, E = gate
    amax = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for r0 in range(start, stop, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = rows < stop
        if HAS_IDS:
            ok = ok & (_load_local_expert(ids_ptr, rows, ok, map_ptr, global_E, E, HAS_MAP) >= 0)
        base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(base + cols[None, :], mask=ok[:, None] & (cols < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    return tl.max(tl.max(amax, axis=1), axis=0)


@triton.jit
def _tensor_scale(
    scale_ptr, partial_ptr, n_partial, row, MODE: tl.constexpr, DYNAMIC: tl.constexpr, P_PAD: tl.constexpr
):
    """fp8_tensor (MODE 1): the per-tensor scale, either the reduction of the ``n_partial`` partial maxima
    (DYNAMIC; program ``row`` 0 stores it to ``scale_ptr``) or the caller's, read from ``scale_ptr``. Other modes:
    1.0 (their scales are per row or per group: :func:`_quantize_row`)."""
    s = 1.0
    if MODE == 1:
        if DYNAMIC:
            offs_p = tl.arange(0, P_PAD)
            s = _fp8_scale(tl.max(tl.load(partial_ptr + offs_p, mask=offs_p < n_partial, other=0.0), axis=0))
            if row == 0:
                tl.store(scale_ptr, s)
        else:
            s = tl.load(scale_ptr)
    return s


@triton.jit
def _quantize_row(
    x_row,
    q_row,
    scale_ptr,
    row,
    stride_sm,
    stride_sk,
    s,
    K,
    MODE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    """Quantize one row: ``q_row[k] = e4m3(x_row[k] / scale)`` for ``k < K``.

    The scale: MODE 1, ``s`` (per tensor); MODE 2, the row's own (from its max |x|), stored to
    ``scale_ptr[row * stride_sm]``; MODE 3, one per BLOCK_K-column group g (BLOCK_K is the group size), stored to
    ``scale_ptr[row * stride_sm + g * stride_sk]``.
    """
    q_dtype = q_row.dtype.element_ty
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
        if MODE == 3:
            s_group = _fp8_scale(tl.max(tl.abs(x), axis=0))
            tl.store(scale_ptr + row * stride_sm + (k0 // BLOCK_K) * stride_sk, s_group)
            tl.store(q_row + cols, _to_fp8(x, s_group, q_dtype, ROUND_IN_FP32), mask=cols < K)
        else:
            tl.store(q_row + cols, _to_fp8(x, s, q_dtype, ROUND_IN_FP32), mask=cols < K)


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
    pid, start, stop = _program_span(rows_per_prog, R)
    gate = (ids_ptr, map_ptr, global_E, E)
    tl.store(
        partial_ptr + pid, _absmax_rows(x_ptr, start, stop, K, stride_xm, gate, HAS_IDS, HAS_MAP, BLOCK_R, BLOCK_K)
    )


def _rows_name(spec) -> str:
    """Compiled name of ``_quant_rows``: ``_batched_quant_rows`` for the batched layout (what profilers show)."""
    return "_batched_quant_rows" if spec.constants.get("BATCHED") else "_quant_rows"


@triton.jit(repr=_rows_name)
def _quant_rows(
    x_ptr,
    q_ptr,
    scale_ptr,
    ids_ptr,
    map_ptr,
    count_ptr,
    partial_ptr,
    n_partial,
    T,
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
    BATCHED: tl.constexpr = False,
):
    """One program per row: the per-tensor scale (fp8_tensor), then, if the row is valid, its quantization.

    Valid rows: BATCHED, row ``e*T + r`` with ``r < count[e]`` (``ids_ptr``, ``map_ptr``, ``global_E`` and ``E``
    unread, may be None); else every row, or with HAS_IDS the rows whose slot is local (``count_ptr`` and ``T``
    unread, may be None).
    """
    row = tl.program_id(0).to(tl.int64)
    s = _tensor_scale(scale_ptr, partial_ptr, n_partial, row, MODE, DYNAMIC, P_PAD)
    if BATCHED:
        e = row // T
        if row - e * T >= tl.load(count_ptr + e):
            return
    elif not _row_is_valid(row, ids_ptr, map_ptr, global_E, E, HAS_IDS, HAS_MAP):
        return
    x_row, q_row = x_ptr + row * stride_xm, q_ptr + row * stride_qm
    _quantize_row(x_row, q_row, scale_ptr, row, stride_sm, stride_sk, s, K, MODE, BLOCK_K, ROUND_IN_FP32)


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


def _mode(quant_mode: str, static_scale: torch.Tensor | None) -> tuple[int, bool]:
    """(MODE code, dynamic per-tensor scale?) of a quantization; ValueError for an unknown mode or a static scale
    outside fp8_tensor."""
    if quant_mode not in _MODES:
        raise ValueError(f"unknown quant mode {quant_mode!r}")
    if static_scale is not None and quant_mode != "fp8_tensor":
        raise ValueError("a static activation scale is only defined for fp8_tensor")
    return _MODES[quant_mode], quant_mode == "fp8_tensor" and static_scale is None


def _row_block_k(mode: int, K: int, group_k: int) -> int:
    """Columns per step of the row quantizer: the scale group (fp8_block), else K's power of two in [16, 1024]."""
    return group_k if mode == 3 else max(16, min(1024, next_pow2(K)))


def _absmax_meta(block_k: int) -> dict:
    """Launch keywords of the partial-maximum kernels: 4 rows by up to 256 columns per step, 4 warps."""
    return {"BLOCK_R": 4, "BLOCK_K": min(block_k, 256), "num_warps": 4}


def _row_strides(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, int, int]:
    """(stride_xm, stride_qm, stride_sm, stride_sk) of the row-quantizer kernels (a [1] scale: 0, 0)."""
    sm, sk = (scale.stride(0), scale.stride(1)) if scale.dim() == 2 else (0, 0)
    return x.stride(0), out.stride(0), sm, sk


def _row_meta(mode: int, dynamic: bool, block_k: int, n_partial: int, x: torch.Tensor) -> dict:
    """Launch keywords of the row-quantizer kernels."""
    return {
        "MODE": mode,
        "DYNAMIC": dynamic,
        "BLOCK_K": block_k,
        "P_PAD": next_pow2(n_partial),
        "ROUND_IN_FP32": x.device.type == "cpu",
        "num_warps": 4,
    }


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
    mode, dynamic = _mode(quant_mode, static_scale)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be 2-D and contiguous along its last dim")
    R, K = x.shape
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
    gates = {"HAS_IDS": has_ids, "HAS_MAP": expert_map is not None}
    gE, E = (global_num_experts or 0), (num_experts or 0)
    block_k = _row_block_k(mode, K, group_k)
    n_part = num_partials(R)
    if dynamic:
        if partial is None:
            partial = torch.empty(n_part, dtype=torch.float32, device=x.device)
        args = (x, ids_arg, map_arg, partial, R, K, cdiv(R, n_part), gE, E, x.stride(0))
        launch(_absmax_partial, (n_part,), *args, **gates, **_absmax_meta(block_k))
    args = (x, out, scale, ids_arg, map_arg, None, partial if dynamic else x, n_part, None, K, gE, E)
    launch(
        _quant_rows, (R,), *args, *_row_strides(x, out, scale), **gates, **_row_meta(mode, dynamic, block_k, n_part, x)
    )
    return out, scale


__all__ = ["num_partials", "quantize_activation", "scale_shape"]
