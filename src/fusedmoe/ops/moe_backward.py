"""Backward kernels of the MoE layer over the forward's expert-aligned blocks (:func:`~fusedmoe.ops.align.moe_align`).

Notation per routed slot ``s = (t, j)`` of local expert ``e`` with routing weight ``w``: ``h = [gate, up]`` the
GEMM1 output (``x[t] W1[e]ᵀ``, times ``w`` with the weight on the input, plus ``b1[e]``), ``a = act(h)``,
``g = d out``.

- :func:`moe_bwd_act`: one program per (block of sorted slots, tile of I). One K loop over H runs three dots:
  the recomputed gate and up (``x[t] @ W1[e]ᵀ``) and ``g[t] @ W2[e]`` (the unweighted ``da``); or, given the
  forward's saved raw GEMM1 output (``preact``), only the last, the gate and up loaded in the epilogue. The epilogue
  applies the routing weight, forms ``a`` and the activation's backward, and writes, in the aligned order (row =
  the slot's position in ``sorted_ids``, padding rows zero), ``dh`` [P, 2I] (gate columns, then up) and ``a``
  [P, I] (for dW2), and the tile's share of ``d w`` into
  ``dw_partial[tile, slot]``:
  ``<a, g W2[e]>`` (plus ``<b2[e], g[t]>`` from the first tile), or with the weight on the input
  ``<dh, x[t] W1[e]ᵀ>``. The [S, 2I] GEMM1 output is never stored.
- :func:`moe_wgrad`: ``out[e] = Σ_s A[s]ᵀ B[s]`` over the slots of expert ``e`` (rows of A and B addressed by
  slot, by token or by aligned position), with the column sums of A as
  the bias gradient. One program per (expert, N tile, K tile) loops over that expert's contiguous rows of the
  aligned order: every output element is written exactly once, in a fixed order (deterministic; no atomics),
  including zeros for experts without slots.
- :func:`expert_block_ranges`: ``ranges[e] = (first block, number of blocks)`` of each expert (its blocks are
  contiguous in the aligned order).
- :func:`moe_dweights`: ``d w[s] = Σ_tile dw_partial[tile, s]`` for local slots, 0 for the others.

Rows of blocks past ``num_padded`` in ``dh`` and ``a``, and columns of non-local slots in ``dw_partial``, are never
written and never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import cdiv, next_pow2
from .align import _local_expert
from .expert_gemm import _SWIGLUOAI_ALPHA, _SWIGLUOAI_LIMIT, ACTIVATION_CODES, _activate, _mma
from .grouped_gemm import _tile_ids
from .launcher import launch


@triton.jit
def _activate_backward(gate, up, d, ACTIVATION: tl.constexpr):
    """(d gate, d up) of ``act(gate) * up`` for the incoming gradient ``d`` (float32 tiles)."""
    if ACTIVATION == 0:  # silu
        s = tl.sigmoid(gate)
        return d * up * (s * (1.0 + gate * (1.0 - s))), d * gate * s
    if ACTIVATION == 2:  # swigluoai: the clamps pass the gradient where they leave the value unchanged
        g = tl.minimum(gate, _SWIGLUOAI_LIMIT)
        u = tl.minimum(tl.maximum(up, -_SWIGLUOAI_LIMIT), _SWIGLUOAI_LIMIT)
        s = tl.sigmoid(_SWIGLUOAI_ALPHA * g)
        d_gate = tl.where(gate <= _SWIGLUOAI_LIMIT, d * (u + 1.0) * (s * (1.0 + _SWIGLUOAI_ALPHA * g * (1.0 - s))), 0.0)
        d_up = tl.where((up >= -_SWIGLUOAI_LIMIT) & (up <= _SWIGLUOAI_LIMIT), d * g * s, 0.0)
        return d_gate, d_up
    if ACTIVATION == 3:  # gelu_exact
        cdf = 0.5 * (1.0 + tl.erf(gate * 0.7071067811865476))
        return d * up * (cdf + gate * 0.3989422804014327 * tl.exp(-0.5 * gate * gate)), d * gate * cdf
    # gelu (tanh): gelu(g) = g * s with s = sigmoid(2z) = (1 + tanh z) / 2, z = c (g + 0.044715 g^3)
    z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    s = tl.sigmoid(2.0 * z)
    dz = 0.7978845608028654 * (1.0 + 0.134145 * gate * gate)
    return d * up * (s + gate * 2.0 * s * (1.0 - s) * dz), d * gate * s


@triton.jit(do_not_specialize=["n_slots", "num_pid_m"])
def _moe_bwd_act(
    x_ptr,
    g_ptr,
    w1_ptr,
    w2_ptr,
    b1_ptr,
    b2_ptr,
    topk_w_ptr,
    sorted_ptr,
    block_expert_ptr,
    dh_ptr,
    act_ptr,
    part_ptr,
    preact_ptr,
    n_slots,
    I,
    H,
    top_k,
    num_pid_m,
    stride_xm,
    stride_gm,
    stride_w1e,
    stride_w1n,
    stride_w1k,
    stride_w2e,
    stride_w2k,
    stride_w2n,
    stride_b1e,
    stride_b2e,
    stride_dhm,
    stride_am,
    stride_pn,
    stride_pm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SAVED: tl.constexpr,
    ACT_ONLY: tl.constexpr,  # SAVED only: store the activation and nothing else (no K loop)
    ACTIVATION: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr,
    HAS_BIAS1: tl.constexpr,
    HAS_BIAS2: tl.constexpr,
    STORE_ACT: tl.constexpr,
    STORE_DW: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    num_pid_n = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    e64 = expert.to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ptr + offs_m)
    row_ok = slot < n_slots
    slot64 = tl.where(row_ok, slot, 0).to(tl.int64)
    token = slot64 // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_nw = (offs_n % I).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = g_ptr + token[:, None] * stride_gm + offs_k[None, :]
    wg_ptrs = w1_ptr + e64 * stride_w1e + offs_nw[None, :] * stride_w1n + offs_k[:, None] * stride_w1k
    wu_ptrs = wg_ptrs + I * stride_w1n
    w2_ptrs = w2_ptr + e64 * stride_w2e + offs_nw[None, :] * stride_w2n + offs_k[:, None] * stride_w2k

    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_d = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g_b2 = tl.zeros([BLOCK_M], dtype=tl.float32)  # <g[t], b2[e]>, the bias share of d w
    for kt in range(0, 0 if ACT_ONLY else tl.cdiv(H, BLOCK_K)):
        if EVEN_K:
            k_ok = offs_k < BLOCK_K
            ga = tl.load(g_ptrs, mask=row_ok[:, None], other=0.0)
            w2t = tl.load(w2_ptrs)
            if not SAVED:
                xa = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                wg = tl.load(wg_ptrs)
                wu = tl.load(wu_ptrs)
        else:
            k_ok = offs_k < H - kt * BLOCK_K
            ga = tl.load(g_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w2t = tl.load(w2_ptrs, mask=k_ok[:, None], other=0.0)
            if not SAVED:
                xa = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(wg_ptrs, mask=k_ok[:, None], other=0.0)
                wu = tl.load(wu_ptrs, mask=k_ok[:, None], other=0.0)
        if not SAVED:
            acc_g = _mma(xa, wg, acc_g, IEEE)
            acc_u = _mma(xa, wu, acc_u, IEEE)
        acc_d = _mma(ga, w2t, acc_d, IEEE)
        if HAS_BIAS2 and STORE_DW and not WEIGHT_ON_INPUT:
            b2 = tl.load(b2_ptr + e64 * stride_b2e + kt * BLOCK_K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            g_b2 += tl.sum(ga.to(tl.float32) * b2[None, :], 1)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K * stride_w1k
        wu_ptrs += BLOCK_K * stride_w1k
        w2_ptrs += BLOCK_K * stride_w2k
    if SAVED:  # the forward's GEMM1 accumulators
        pre_ptrs = preact_ptr + slot64[:, None] * stride_pm + offs_n[None, :]
        acc_g = tl.load(pre_ptrs, mask=row_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        acc_u = tl.load(pre_ptrs + I, mask=row_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)

    w = tl.load(topk_w_ptr + slot64, mask=row_ok, other=0.0).to(tl.float32)
    raw_g = acc_g  # x W1ᵀ before the weight and the bias: d w's factor with the weight on the input
    raw_u = acc_u
    if WEIGHT_ON_INPUT:
        acc_g = acc_g * w[:, None]
        acc_u = acc_u * w[:, None]
        da = acc_d
    else:
        da = acc_d * w[:, None]
    if HAS_BIAS1:
        b_base = b1_ptr + e64 * stride_b1e
        acc_g += tl.load(b_base + offs_nw).to(tl.float32)[None, :]
        acc_u += tl.load(b_base + offs_nw + I).to(tl.float32)[None, :]
    a = _activate(acc_g, acc_u, ACTIVATION)
    # dh and the activation go to the block's own rows (aligned order), zero on padding rows
    pos64 = offs_m.to(tl.int64)
    mask = n_ok[None, :]
    if STORE_ACT:
        a_ptrs = act_ptr + pos64[:, None] * stride_am + offs_n[None, :]
        tl.store(a_ptrs, tl.where(row_ok[:, None], a, 0.0).to(act_ptr.dtype.element_ty), mask=mask)
    if ACT_ONLY:
        return
    d_gate, d_up = _activate_backward(acc_g, acc_u, da, ACTIVATION)
    dh_ptrs = dh_ptr + pos64[:, None] * stride_dhm + offs_n[None, :]
    tl.store(dh_ptrs, tl.where(row_ok[:, None], d_gate, 0.0).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptrs + I, tl.where(row_ok[:, None], d_up, 0.0).to(dh_ptr.dtype.element_ty), mask=mask)
    if STORE_DW:
        if WEIGHT_ON_INPUT:
            share = tl.sum(tl.where(n_ok[None, :], d_gate * raw_g + d_up * raw_u, 0.0), 1)
        else:
            # the forward's GEMM2 reads the activation rounded to the input dtype
            a_r = a.to(act_ptr.dtype.element_ty).to(tl.float32)
            share = tl.sum(tl.where(n_ok[None, :], a_r * acc_d, 0.0), 1)
            if HAS_BIAS2:
                share += tl.where(pid_n == 0, g_b2, 0.0)
        tl.store(part_ptr + pid_n * stride_pn + slot64, share, mask=row_ok)


@triton.jit(do_not_specialize=["max_blocks"])
def _expert_block_ranges(block_expert_ptr, ranges_ptr, max_blocks, SCAN: tl.constexpr):
    e = tl.program_id(0)
    first = tl.zeros([], dtype=tl.int32) + max_blocks
    count = tl.zeros([], dtype=tl.int32)
    for c in range(0, tl.cdiv(max_blocks, SCAN)):
        idx = c * SCAN + tl.arange(0, SCAN)
        hit = tl.load(block_expert_ptr + idx, mask=idx < max_blocks, other=-1) == e
        first = tl.minimum(first, tl.min(tl.where(hit, idx, max_blocks)))
        count += tl.sum(hit.to(tl.int32))
    tl.store(ranges_ptr + 2 * e, first)
    tl.store(ranges_ptr + 2 * e + 1, count)


#: How :func:`moe_wgrad` addresses an operand's rows: by slot, by token (slot // k), or by position in the aligned
#: order (a buffer with one row per entry of ``sorted_ids``, its padding rows zero).
ROW_MODES = {"slot": 0, "token": 1, "sorted": 2}


@triton.jit
def _rows(pos, slot64, top_k, MODE: tl.constexpr):
    if MODE == 0:
        return slot64
    if MODE == 1:
        return slot64 // top_k
    return pos.to(tl.int64)


@triton.jit(do_not_specialize=["n_slots"])
def _moe_wgrad(
    a_ptr,
    b_ptr,
    out_ptr,
    bias_out_ptr,
    sorted_ptr,
    ranges_ptr,
    n_slots,
    N,
    K,
    top_k,
    stride_am,
    stride_bm,
    stride_oe,
    stride_on,
    stride_be,
    A_ROWS: tl.constexpr,
    B_ROWS: tl.constexpr,
    HAS_BIAS_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    STEP_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    # one expert's tiles run together (its rows stay in L2), GROUP_N output rows of tiles sweeping K together
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    e = pid // (num_n * num_k)
    t = pid % (num_n * num_k)
    first_n = (t // (GROUP_N * num_k)) * GROUP_N
    size_n = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (t % (GROUP_N * num_k)) % size_n
    pid_k = (t % (GROUP_N * num_k)) // size_n
    begin = tl.load(ranges_ptr + 2 * e) * BLOCK_M
    end = begin + tl.load(ranges_ptr + 2 * e + 1) * BLOCK_M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = offs_k < K
    # both operands in aligned order: the K loop needs no slot ids (padding rows are zero)
    NEEDS_SLOT: tl.constexpr = A_ROWS != 2 or B_ROWS != 2
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    col = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r in range(begin, end, STEP_M):
        pos = r + tl.arange(0, STEP_M)
        ok = pos < end
        slot64 = pos.to(tl.int64)
        if NEEDS_SLOT:
            slot = tl.load(sorted_ptr + pos, mask=ok, other=n_slots)
            ok = slot < n_slots
            slot64 = tl.where(ok, slot, 0).to(tl.int64)
        ra = _rows(pos, slot64, top_k, A_ROWS)
        rb = _rows(pos, slot64, top_k, B_ROWS)
        a = tl.load(a_ptr + ra[:, None] * stride_am + offs_n[None, :], mask=ok[:, None] & n_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rb[:, None] * stride_bm + offs_k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        acc = _mma(tl.trans(a), b, acc, IEEE)
        if HAS_BIAS_OUT:
            col += tl.sum(a.to(tl.float32), 0)
    o_ptrs = out_ptr + e.to(tl.int64) * stride_oe + offs_n[:, None] * stride_on + offs_k[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])
    if HAS_BIAS_OUT:
        b_ptrs = bias_out_ptr + e.to(tl.int64) * stride_be + offs_n
        tl.store(b_ptrs, col.to(bias_out_ptr.dtype.element_ty), mask=n_ok & (pid_k == 0))


@triton.jit(do_not_specialize=["n_slots"])
def _gather_aligned(
    src_ptr,
    out_ptr,
    topk_w_ptr,
    sorted_ptr,
    block_expert_ptr,
    n_slots,
    H,
    top_k,
    stride_sm,
    stride_om,
    SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if tl.load(block_expert_ptr + pid_m) < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ptr + offs_m)
    ok = slot < n_slots
    slot64 = tl.where(ok, slot, 0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    v = tl.load(src_ptr + (slot64 // top_k)[:, None] * stride_sm + offs_h[None, :], mask=ok[:, None] & h_ok[None, :])
    if SCALE:
        v = v.to(tl.float32) * tl.load(topk_w_ptr + slot64, mask=ok, other=0.0).to(tl.float32)[:, None]
    v = tl.where(ok[:, None], v, 0.0)
    tl.store(
        out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_h[None, :],
        v.to(out_ptr.dtype.element_ty),
        mask=h_ok[None, :],
    )


@triton.jit
def _moe_dweights(
    part_ptr,
    ids_ptr,
    map_ptr,
    out_ptr,
    n_slots,
    n_tiles,
    global_E,
    E,
    stride_pn,
    HAS_MAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_slots
    local = _local_expert(tl.load(ids_ptr + offs, mask=ok, other=-1), map_ptr, global_E, E, HAS_MAP)
    live = ok & (local >= 0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for t in range(0, n_tiles):
        acc += tl.load(part_ptr + t * stride_pn + offs, mask=live, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ---- wrappers ---------------------------------------------------------------------------------------------------
def bwd_act_tiles(I: int, block_n: int) -> int:
    """Number of I tiles of :func:`moe_bwd_act` (the rows of its ``dw_partial``)."""
    return cdiv(I, block_n)


def moe_bwd_act(
    x: torch.Tensor,
    grad_out: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    dh: torch.Tensor | None,
    *,
    top_k: int,
    num_blocks: int,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int = 8,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    act: torch.Tensor | None = None,
    dw_partial: torch.Tensor | None = None,
    preact: torch.Tensor | None = None,
    fp32_ieee: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """Write the rows of valid blocks of ``dh`` [P, 2I] and ``act`` [P, I] (P >= the length of ``sorted_ids``; row
    = aligned position, padding rows zero), and ``dw_partial`` float32 [bwd_act_tiles(I, block_n), M*k] (by slot)
    when given. ``x``, ``grad_out`` [M, H] and the weights share one dtype and are contiguous along their last
    dimension; ``topk_weights`` is contiguous [M, k]. ``preact`` [M*k, 2I] (row-contiguous, by slot): the forward's
    saved raw GEMM1 output (:func:`~fusedmoe.ops.grouped_gemm.moe_gemm1`), read instead of recomputing it.
    ``dh=None`` (with ``preact`` and ``act``): only the activation, from the saved output (no GEMM)."""
    E, two_i, H = w1.shape
    I = two_i // 2
    if num_blocks == 0 or I == 0:
        return
    if dh is None and (preact is None or act is None or dw_partial is not None):
        raise ValueError("dh=None writes only the activation: it needs preact and act, and no dw_partial")
    rows = sorted_ids.shape[0]
    if (dh is not None and dh.shape[0] < rows) or (act is not None and act.shape[0] < rows):
        raise ValueError(f"dh and act need a row per aligned position ({rows})")
    for name, t in (("x", x), ("grad_out", grad_out), ("dh", dh), ("act", act)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension")
    if w2.stride(2) != 1 or w1.stride(2) != 1:
        raise ValueError("w1 and w2 must be contiguous along their last dimension")
    dummy = dh if dh is not None else act
    launch(
        _moe_bwd_act,
        (num_blocks * cdiv(I, block_n),),
        x,
        grad_out,
        w1,
        w2,
        w1_bias if w1_bias is not None else dummy,
        w2_bias if w2_bias is not None else dummy,
        topk_weights,
        sorted_ids,
        block_expert,
        dummy if dh is None else dh,
        act if act is not None else dummy,
        dw_partial if dw_partial is not None else dummy,
        preact if preact is not None else dummy,
        x.shape[0] * top_k,
        I,
        H,
        top_k,
        num_blocks,
        x.stride(0),
        grad_out.stride(0),
        w1.stride(0),
        w1.stride(1),
        w1.stride(2),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        w1_bias.stride(0) if w1_bias is not None else 0,
        w2_bias.stride(0) if w2_bias is not None else 0,
        dummy.stride(0) if dh is None else dh.stride(0),
        act.stride(0) if act is not None else 0,
        dw_partial.stride(0) if dw_partial is not None else 0,
        preact.stride(0) if preact is not None else 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        SAVED=preact is not None,
        ACT_ONLY=dh is None,
        ACTIVATION=ACTIVATION_CODES[activation],
        WEIGHT_ON_INPUT=apply_router_weight_on_input,
        HAS_BIAS1=w1_bias is not None,
        HAS_BIAS2=w2_bias is not None,
        STORE_ACT=act is not None,
        STORE_DW=dw_partial is not None,
        IEEE=fp32_ieee and x.dtype == torch.float32,
        EVEN_K=H % block_k == 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def expert_block_ranges(block_expert: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """Write int32 ``ranges`` [E, 2] = (first block, block count) of each local expert."""
    E = ranges.shape[0]
    if E:
        n = block_expert.shape[0]
        launch(_expert_block_ranges, (E,), block_expert, ranges, n, SCAN=max(16, min(1024, next_pow2(n))))
    return ranges


def moe_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    ranges: torch.Tensor,
    *,
    n_slots: int,
    top_k: int,
    block_m: int,
    a_rows: str,
    b_rows: str,
    bias_out: torch.Tensor | None = None,
    step_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    group_n: int = 8,
    fp32_ieee: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """``out[e] = Σ_s a[row(s)]ᵀ b[row(s)]`` [E, N, K] over the ``n_slots`` slots of each expert, rows addressed
    per operand as ``ROW_MODES`` says ("slot", "token" = slot // k, "sorted" = the slot's position in
    ``sorted_ids``, padding rows zero); ``bias_out[e] = Σ_s a[row(s)]`` [E, N] when given. The K loop steps
    ``step_m`` rows (a power of two; default ``block_m``). Writes every element of ``out`` (and
    ``bias_out``)."""
    E, N, K = out.shape
    if a.stride(-1) != 1 or b.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("a, b and out must be contiguous along their last dimension")
    step_m = step_m or block_m
    if step_m < 16 or step_m & (step_m - 1):
        raise ValueError(f"step_m must be a power of two >= 16, got {step_m}")
    if E == 0 or N == 0 or K == 0:
        return out
    launch(
        _moe_wgrad,
        (E * cdiv(N, block_n) * cdiv(K, block_k),),
        a,
        b,
        out,
        bias_out if bias_out is not None else out,
        sorted_ids,
        ranges,
        n_slots,
        N,
        K,
        top_k,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        out.stride(1),
        bias_out.stride(0) if bias_out is not None else 0,
        A_ROWS=ROW_MODES[a_rows],
        B_ROWS=ROW_MODES[b_rows],
        HAS_BIAS_OUT=bias_out is not None,
        BLOCK_M=block_m,
        STEP_M=step_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_N=group_n,
        IEEE=fp32_ieee and a.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def gather_aligned(
    src: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    *,
    top_k: int,
    num_blocks: int,
    block_m: int,
    topk_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[i] = src[sorted_ids[i] // top_k]`` (times the slot's weight when ``topk_weights`` is given; 0 on
    padding rows) for the rows of valid blocks: the token rows of ``src`` [M, H] in the aligned order of
    ``out`` [P, H], so the weight-gradient GEMMs read both operands contiguously."""
    M, H = src.shape
    if src.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("src and out must be contiguous along their last dimension")
    if num_blocks == 0 or H == 0:
        return out
    block_h = min(256, next_pow2(H))
    launch(
        _gather_aligned,
        (num_blocks, cdiv(H, block_h)),
        src,
        out,
        topk_weights if topk_weights is not None else src,
        sorted_ids,
        block_expert,
        M * top_k,
        H,
        top_k,
        src.stride(0),
        out.stride(0),
        SCALE=topk_weights is not None,
        BLOCK_M=block_m,
        BLOCK_H=block_h,
    )
    return out


def moe_dweights(
    dw_partial: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    num_experts: int,
    *,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
) -> torch.Tensor:
    """Write ``out`` [M, k] (any float dtype) = the sum over tiles of ``dw_partial`` [tiles, M*k] for local slots,
    0 elsewhere. ``topk_ids`` and ``out`` contiguous."""
    n = topk_ids.numel()
    if n == 0:
        return out
    if global_num_experts is None:
        global_num_experts = expert_map.numel() if expert_map is not None else num_experts
    block = 256
    launch(
        _moe_dweights,
        (cdiv(n, block),),
        dw_partial,
        topk_ids,
        expert_map if expert_map is not None else topk_ids,
        out,
        n,
        dw_partial.shape[0],
        global_num_experts,
        num_experts,
        dw_partial.stride(0),
        HAS_MAP=expert_map is not None,
        BLOCK=block,
    )
    return out


__all__ = ["bwd_act_tiles", "expert_block_ranges", "gather_aligned", "moe_bwd_act", "moe_dweights", "moe_wgrad"]
