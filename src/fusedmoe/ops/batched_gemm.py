"""GEMMs over the batched layout ``[E, T, K]`` that touch only the valid rows of each expert.

- :func:`batched_gemm1`: ``act[e, r, n] = act_fn(a[e, r] @ w1[e, n].T) * (a[e, r] @ w1[e, I + n].T)`` for
  ``r < expert_num_tokens[e]`` (gate and up accumulators per program; the [.., 2I] GEMM1 output never exists).
- :func:`batched_gemm2`: ``y[e, r, :] = act[e, r] @ w2[e].T`` for valid rows (finalize applies the weights).

Both launch ``_batched_gemm`` (``GATED`` for GEMM1), built from the parts in :mod:`fusedmoe.ops.expert_gemm`.
Grid: one program per (expert, BLOCK_M row block, BLOCK_N tile). A program loads ``expert_num_tokens[e]`` and
returns at once when its row block starts at or past it; otherwise rows ``>= count`` are masked out of every
load (never read, so garbage or NaN in padded rows cannot reach a result), out of the scale loads, and out of
the store (padded output rows are never written). Activation rows are addressed by ``e * stride_ae + r *
stride_ar`` (any strides), scale rows of per-token / block modes by the flat row ``e * T + r``.

fp8 (e4m3, w8a8) scales as in :mod:`fusedmoe.ops.grouped_gemm`, with activation scale rows ``e * T + r``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import cdiv
from .configs import GemmConfig
from .expert_gemm import (
    Numerics,
    check_operands,
    columns,
    epilogue,
    k_loop,
    scale_ptrs,
    scale_strides,
    tile_meta,
    weight_k,
)
from .launcher import launch


@triton.jit
def _batched_ids(T, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    num_mb = tl.cdiv(T, BLOCK_M)
    num_nb = tl.cdiv(N, BLOCK_N)
    per_e = num_mb * num_nb
    e = pid // per_e
    rem = pid % per_e
    return e, rem // num_nb, rem % num_nb


@triton.jit
def _batched_gemm(
    a_ptr,
    w_ptr,
    out_ptr,
    count_ptr,
    a_scale_ptr,
    w_scale_ptr,
    T,
    N,
    K,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_oe,
    stride_or,
    stride_on,
    stride_asf,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Row r of expert e: activations at ``e * stride_ae + r * stride_ar``, output at ``e * stride_oe + r *
    stride_or``, activation scales (fp8_token / fp8_block) at the flat row ``(e * T + r) * stride_asf``."""
    e, mb, nb = _batched_ids(T, N, BLOCK_M, BLOCK_N)
    count = tl.minimum(tl.load(count_ptr + e), T)
    if mb * BLOCK_M >= count:
        return
    e64 = e.to(tl.int64)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    rows64 = tl.where(row_ok, rows, 0).to(tl.int64)
    flat_row = e64 * T + rows64  # row index of per-row scales
    offs_n, n_ok, offs_nw = columns(nb, N, BLOCK_N)
    a_op = (a_ptr, stride_ae, rows64, stride_ar, stride_ak)
    w_op = (w_ptr, stride_we, offs_nw, N, K, stride_wn, stride_wk)
    scales = (a_scale_ptr, flat_row, stride_asf, stride_ask, w_scale_ptr, stride_wse, stride_wsn, stride_wsk)
    acc_g, acc_u = k_loop(a_op, w_op, scales, row_ok, e64, BLOCK_K, QUANT, GROUP_N, GROUP_K, GATED, IEEE, EVEN_K)
    out = (out_ptr, stride_oe, rows64, stride_or, offs_n, stride_on, n_ok)
    epilogue(acc_g, acc_u, row_ok, e64, None, None, out, GATED, ACTIVATION, False, False, False)


# ---- wrappers ---------------------------------------------------------------------------------------------------
def _launch(a, w, out, counts, N, config, activation, num: Numerics):
    """One ``_batched_gemm`` launch writing ``out`` [E, T, N]: GEMM1 when ``activation`` is given (gated: ``w``
    holds gate rows then up rows), else GEMM2."""
    check_operands(a, w, num, config)
    if a.dim() != 3 or out.dim() != 3 or w.dim() != 3:
        raise ValueError("a [E, T, K], w [E, N, K] and out [E, T, N] must be 3-D")
    if counts.dtype != torch.int32 or counts.numel() != a.shape[0]:
        raise TypeError("expert_num_tokens must be int32 [E]")
    E, T, K = a.shape
    w_rows = 2 * N if activation is not None else N
    if E != w.shape[0] or (w.shape[1], weight_k(w, num)) != (w_rows, K) or out.shape != (E, T, N):
        raise ValueError(f"shape mismatch: a {tuple(a.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}")
    if E == 0 or T == 0 or N == 0:
        return out
    grid = (E * cdiv(T, config.block_m) * cdiv(N, config.block_n),)
    launch(
        _batched_gemm,
        grid,
        a,
        w,
        out,
        counts,
        *scale_ptrs(num, a),
        T,
        N,
        K,
        *a.stride(),
        *w.stride(),
        *out.stride(),
        *scale_strides(num),
        **tile_meta(config, num, a.dtype, K, activation),
    )
    return out


def batched_gemm1(
    a: torch.Tensor,
    w1: torch.Tensor,
    out: torch.Tensor,
    expert_num_tokens: torch.Tensor,
    *,
    config: GemmConfig,
    activation: str = "silu",
    numerics: Numerics = Numerics(),
) -> torch.Tensor:
    """GEMM1 with the gated activation fused, valid rows only.

    Args:
        a: [E, T, H] (float, or e4m3 when quantized). w1: [E, 2I, H] gate rows then up rows.
        out: [E, T, I]; rows ``>= expert_num_tokens[e]`` are not written.
        expert_num_tokens: int32 [E] on the device (values above T are clamped to T).
        numerics: quantization and fp32 dot precision. Scales: a_scale fp8_tensor [1], fp8_token [E*T, 1],
            fp8_block [E*T, cdiv(H, gk)] (flat rows e*T + r); w_scale as for
            :func:`fusedmoe.ops.grouped_gemm.moe_gemm1`.
    """
    return _launch(a, w1, out, expert_num_tokens, w1.shape[1] // 2, config, activation, numerics)


def batched_gemm2(
    a: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
    expert_num_tokens: torch.Tensor,
    *,
    config: GemmConfig,
    numerics: Numerics = Numerics(),
) -> torch.Tensor:
    """GEMM2 ``out[e, r] = a[e, r] @ w2[e].T`` for valid rows. a: [E, T, I]; w2: [E, H, I]; out: [E, T, H]."""
    return _launch(a, w2, out, expert_num_tokens, w2.shape[1], config, None, numerics)


__all__ = ["batched_gemm1", "batched_gemm2"]
