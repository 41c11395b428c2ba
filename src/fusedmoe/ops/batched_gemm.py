"""GEMMs over the batched layout ``[E, T, K]`` that touch only the valid rows of each expert.

- :func:`batched_gemm1`: ``act[e, r, n] = act_fn(a[e, r] @ w1[e, n].T) * (a[e, r] @ w1[e, I + n].T)`` for
  ``r < expert_num_tokens[e]`` (gate and up accumulators per program; the [.., 2I] GEMM1 output never exists).
- :func:`batched_gemm2`: ``y[e, r, :] = act[e, r] @ w2[e].T`` for valid rows (finalize applies the weights).

Grid: one program per (expert, BLOCK_M row block, BLOCK_N tile). A program loads ``expert_num_tokens[e]`` and
returns at once when its row block starts at or past it; otherwise rows ``>= count`` are masked out of every
load (never read, so garbage or NaN in padded rows cannot reach a result), out of the scale loads, and out of
the store (padded output rows are never written). Activation rows are addressed by ``e * stride_ae + r *
stride_am`` (any strides), scale rows of per-token / block modes by the flat row ``e * T + r``.

fp8 (e4m3, w8a8) epilogues as in :mod:`fusedmoe.ops.grouped_gemm`:
  ``fp8_tensor``: acc * a_scale[0] * w_scale[e];   ``fp8_token``: acc * a_scale[row] * w_scale[e, col];
  ``fp8_block``: per K tile, acc += dot * a_scale[row, kg] * w_scale[e, col // gn, kg].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import cdiv
from .configs import GemmConfig
from .grouped_gemm import _activate, _mma, _scale_strides
from .launcher import launch

_QUANT_CODES = {None: 0, "fp8_tensor": 1, "fp8_token": 2, "fp8_block": 3}
_ACTIVATIONS = {"silu": 0, "gelu": 1, "swigluoai": 2, "gelu_exact": 3}  # codes of grouped_gemm._activate


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
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_oe,
    stride_om,
    stride_on,
    stride_asm,
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
    e, mb, nb = _batched_ids(T, N, BLOCK_M, BLOCK_N)
    count = tl.minimum(tl.load(count_ptr + e), T)
    if mb * BLOCK_M >= count:
        return
    e64 = e.to(tl.int64)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    rows64 = tl.where(row_ok, rows, 0).to(tl.int64)
    flat_row = e64 * T + rows64  # row index of per-row scales

    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_nw = (offs_n % N).to(tl.int64)  # wrapped columns are computed but never stored
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + e64 * stride_ae + rows64[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_base = w_ptr + e64 * stride_we
    g_ptrs = w_base + offs_nw[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + N * stride_wn

    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if QUANT == 3:
        as_ptrs = a_scale_ptr + flat_row * stride_asm
        ws_base = w_scale_ptr + e64 * stride_wse
        gs_ptrs = ws_base + (offs_nw // GROUP_N) * stride_wsn
        us_ptrs = ws_base + ((offs_nw + N) // GROUP_N) * stride_wsn

    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs)
            if GATED:
                u = tl.load(u_ptrs)
        else:
            k_ok = offs_k < K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            if GATED:
                u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if QUANT == 3:
            kg = (kt * BLOCK_K) // GROUP_K
            a_s = tl.load(as_ptrs + kg * stride_ask, mask=row_ok, other=0.0)
            acc_g += tl.dot(a, g) * a_s[:, None] * tl.load(gs_ptrs + kg * stride_wsk)[None, :]
            if GATED:
                acc_u += tl.dot(a, u) * a_s[:, None] * tl.load(us_ptrs + kg * stride_wsk)[None, :]
        else:
            acc_g = _mma(a, g, acc_g, IEEE)
            if GATED:
                acc_u = _mma(a, u, acc_u, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += BLOCK_K * stride_wk
        if GATED:
            u_ptrs += BLOCK_K * stride_wk

    if QUANT == 1:
        s = tl.load(a_scale_ptr) * tl.load(w_scale_ptr + e64 * stride_wse)
        acc_g = acc_g * s
        if GATED:
            acc_u = acc_u * s
    elif QUANT == 2:
        a_s = tl.load(a_scale_ptr + flat_row * stride_asm, mask=row_ok, other=0.0)
        ws_base = w_scale_ptr + e64 * stride_wse
        acc_g = acc_g * a_s[:, None] * tl.load(ws_base + offs_nw * stride_wsn)[None, :]
        if GATED:
            acc_u = acc_u * a_s[:, None] * tl.load(ws_base + (offs_nw + N) * stride_wsn)[None, :]

    if GATED:
        res = _activate(acc_g, acc_u, ACTIVATION)
    else:
        res = acc_g
    o_ptrs = out_ptr + e64 * stride_oe + rows64[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# ---- wrappers ---------------------------------------------------------------------------------------------------
def _check(a, w, out, counts, quant_mode, a_scale, w_scale, block_shape, cfg):
    if quant_mode not in _QUANT_CODES:
        raise ValueError(f"unknown quant_mode {quant_mode!r}")
    if a.dim() != 3 or out.dim() != 3 or w.dim() != 3:
        raise ValueError("a [E, T, K], w [E, N, K] and out [E, T, N] must be 3-D")
    if counts.dtype != torch.int32 or counts.numel() != a.shape[0]:
        raise TypeError("expert_num_tokens must be int32 [E]")
    if a.shape[0] != w.shape[0] or out.shape[:2] != a.shape[:2]:
        raise ValueError(f"shape mismatch: a {tuple(a.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}")
    if quant_mode is not None:
        if a_scale is None or w_scale is None:
            raise ValueError(f"{quant_mode} needs a_scale and w_scale")
        if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{quant_mode}: activations and weights must be float8_e4m3fn")
    elif a.dtype != w.dtype:
        raise TypeError(f"activation dtype {a.dtype} != weight dtype {w.dtype}")
    if quant_mode == "fp8_block" and block_shape[1] % cfg.block_k:
        raise ValueError(f"fp8_block: BLOCK_K {cfg.block_k} must divide the scale group {block_shape[1]}")


def _launch(a, w, out, counts, N, K, gated, activation, config, quant_mode, a_scale, w_scale, block_shape, fp32_ieee):
    E, T = a.shape[0], a.shape[1]
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
        a_scale if a_scale is not None else a,
        w_scale if w_scale is not None else a,
        T,
        N,
        K,
        a.stride(0),
        a.stride(1),
        a.stride(2),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        *_scale_strides(quant_mode, a_scale, w_scale),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        QUANT=_QUANT_CODES[quant_mode],
        GROUP_N=block_shape[0],
        GROUP_K=block_shape[1],
        GATED=gated,
        ACTIVATION=_ACTIVATIONS[activation],
        IEEE=fp32_ieee and a.dtype == torch.float32,
        EVEN_K=K % config.block_k == 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
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
    quant_mode: str | None = None,
    a_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] = (128, 128),
    fp32_ieee: bool = False,
) -> torch.Tensor:
    """GEMM1 with the gated activation fused, valid rows only.

    Args:
        a: [E, T, H] (float, or e4m3 when quantized). w1: [E, 2I, H] gate rows then up rows.
        out: [E, T, I]; rows ``>= expert_num_tokens[e]`` are not written.
        expert_num_tokens: int32 [E] on the device (values above T are clamped to T).
        a_scale: fp8_tensor [1]; fp8_token [E*T, 1]; fp8_block [E*T, cdiv(H, gk)] (flat rows e*T + r).
        w_scale: as for :func:`fusedmoe.ops.grouped_gemm.moe_gemm1`.
    """
    _check(a, w1, out, expert_num_tokens, quant_mode, a_scale, w_scale, block_shape, config)
    I = w1.shape[1] // 2
    if w1.shape[1] != 2 * I or a.shape[2] != w1.shape[2] or out.shape[2] != I:
        raise ValueError(f"shape mismatch: a {tuple(a.shape)}, w1 {tuple(w1.shape)}, out {tuple(out.shape)}")
    return _launch(
        a,
        w1,
        out,
        expert_num_tokens,
        I,
        a.shape[2],
        True,
        activation,
        config,
        quant_mode,
        a_scale,
        w_scale,
        block_shape,
        fp32_ieee,
    )


def batched_gemm2(
    a: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
    expert_num_tokens: torch.Tensor,
    *,
    config: GemmConfig,
    quant_mode: str | None = None,
    a_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] = (128, 128),
    fp32_ieee: bool = False,
) -> torch.Tensor:
    """GEMM2 ``out[e, r] = a[e, r] @ w2[e].T`` for valid rows. a: [E, T, I]; w2: [E, H, I]; out: [E, T, H]."""
    _check(a, w2, out, expert_num_tokens, quant_mode, a_scale, w_scale, block_shape, config)
    H = w2.shape[1]
    if a.shape[2] != w2.shape[2] or out.shape[2] != H:
        raise ValueError(f"shape mismatch: a {tuple(a.shape)}, w2 {tuple(w2.shape)}, out {tuple(out.shape)}")
    return _launch(
        a,
        w2,
        out,
        expert_num_tokens,
        H,
        a.shape[2],
        False,
        "silu",
        config,
        quant_mode,
        a_scale,
        w_scale,
        block_shape,
        fp32_ieee,
    )


__all__ = ["batched_gemm1", "batched_gemm2"]
