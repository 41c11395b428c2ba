"""Expert GEMMs over the top-k slots in their own order: the decode path of one-row tiles, with no alignment and
(for float and fp8 weights) no separate top-k reduce.

A tile of one row (BLOCK_M = 1, the multiply-add K loops of :mod:`fusedmoe.ops.expert_gemm`) holds one slot, so
sorting the slots by expert (:func:`fusedmoe.ops.align.moe_align`) gives its programs nothing they need: each finds
its expert in the top-k ids. The four launches align, GEMM1, GEMM2, reduce become two:

- :func:`moe_gemm1_slots`: one program per (slot, BLOCK_N columns of I): ``act[slot] = act_fn(x[slot // k] @
  w1[e].T gate) * (... up)``, the K loop and epilogue of :func:`fusedmoe.ops.grouped_gemm.moe_gemm1`.
- :func:`moe_gemm2_reduce`: one program per (token, BLOCK_N columns of H). Each K tile loads the weight tiles of
  all the token's slots at once ([slots, BLOCK_K, BLOCK_N]) and sums their weighted products over the slots in
  float32 registers, so a program keeps as many loads in flight as the k one-slot programs it replaces; the row is
  stored once, in the output's dtype (GEMM2 and :func:`fusedmoe.ops.reduce.moe_reduce` in one launch). Float and
  fp8 weights (weight-only: the activations stay float, the fp8 scales multiply the weight tiles). With few
  tokens it narrows the tile's columns and widens its K (:func:`token_tile`) until its programs cover the SMs.

MXFP4 weights decode words per expert row (``expert_gemm._k_loop_mxfp4_row``): their GEMM2 is
:func:`moe_gemm2_slots` (one program per slot, the rows into a float32 buffer) followed by the top-k reduce, three
launches. Non-local slots (expert id outside the range, or -1 in ``expert_map``; the rule of
``fusedmoe.ops.align._local_expert``) are skipped: no ``act`` row is written for them and none is read; a token
with no local slot gets a zero row. Every element of the output is written, so nothing needs zeroing. The
mma-layout MXFP4 weights need 16-row tiles and are refused.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import triton
import triton.language as tl

from ._util import cdiv
from .align import _local_expert
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
def _one_row(slot):
    """(rows, row_ok) of a one-row tile holding int64 ``slot``: [1] tensors."""
    rows = tl.zeros([1], dtype=tl.int64) + slot
    return rows, rows >= 0


@triton.jit
def _slot_gemm(
    a_ptr,
    w_ptr,
    out_ptr,
    ids_ptr,
    map_ptr,
    topk_w_ptr,
    a_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    preact_ptr,
    N,
    K,
    top_k,
    global_E,
    E,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_pm,
    stride_asm,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_be,
    stride_bn,
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
    WEIGHT_ON_INPUT: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    STORE_PREACT: tl.constexpr,
):
    """Program (slot, pid_n): one slot's BLOCK_N output columns (``N``) of GEMM1 (GATED: the activation of gate
    and up, activation row ``slot // top_k``) or GEMM2 (top_k 1: the slot's own row, weighted when MUL_WEIGHT);
    nothing for a non-local slot. BLOCK_M is 1 (:func:`tile_meta` passes it, as to every GEMM)."""
    slot = tl.program_id(0).to(tl.int64)
    expert = _local_expert(tl.load(ids_ptr + slot), map_ptr, global_E, E, HAS_MAP)
    if expert < 0:
        return
    slots, row_ok = _one_row(slot)
    rows = slots // top_k
    offs_n, n_ok, offs_nw = columns(tl.program_id(1), N, BLOCK_N)
    a_op = (a_ptr, 0, rows, stride_am, stride_ak)
    w_op = (w_ptr, stride_we, offs_nw, N, K, stride_wn, stride_wk)
    scales = (a_scale_ptr, rows, stride_asm, stride_ask, w_scale_ptr, stride_wse, stride_wsn, stride_wsk)
    acc_g, acc_u = k_loop(a_op, w_op, scales, row_ok, expert, BLOCK_K, QUANT, GROUP_N, GROUP_K, GATED, IEEE, EVEN_K)
    if STORE_PREACT:  # the raw accumulators, saved for the backward (as the grouped GEMM1 stores them)
        pre_ptrs = preact_ptr + slots[:, None] * stride_pm + offs_n[None, :]
        tl.store(pre_ptrs, acc_g.to(preact_ptr.dtype.element_ty), mask=n_ok[None, :])
        tl.store(pre_ptrs + N, acc_u.to(preact_ptr.dtype.element_ty), mask=n_ok[None, :])
    bias = (bias_ptr, stride_be, offs_nw, N, stride_bn)
    out = (out_ptr, 0, slots, stride_om, offs_n, 1, n_ok)
    weights = (topk_w_ptr, slots)
    epilogue(acc_g, acc_u, row_ok, expert, weights, bias, out, GATED, ACTIVATION, WEIGHT_ON_INPUT, HAS_BIAS, MUL_WEIGHT)


@triton.jit
def _token_slot(
    ids_ptr,
    map_ptr,
    topk_w_ptr,
    token,
    j,
    global_E,
    E,
    TOP_K: tl.constexpr,
    HAS_MAP: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
):
    """(slot, expert, weight) of the token's ``j``-th slot: expert -1 when it is not local; the router weight
    (float32), or 1 when MUL_WEIGHT is off (weights applied on the input)."""
    slot = token * TOP_K + j
    expert = _local_expert(tl.load(ids_ptr + slot), map_ptr, global_E, E, HAS_MAP)
    weight = 1.0
    if MUL_WEIGHT:
        weight = tl.load(topk_w_ptr + slot).to(tl.float32)
    return slot, expert, weight


@triton.jit
def _token_gemm2(
    a_ptr,
    w_ptr,
    out_ptr,
    ids_ptr,
    map_ptr,
    topk_w_ptr,
    a_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    N,
    K,
    global_E,
    E,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_asm,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_be,
    stride_bn,
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
    MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    TOP_K: tl.constexpr,
):
    """Program (token, pid_n): the sum over the token's local slots of their GEMM2 rows' BLOCK_N columns of H
    (``N``), weighted when MUL_WEIGHT, stored once (zeros when no slot is local). BLOCK_M, GATED, ACTIVATION, IEEE
    and EVEN_K are :func:`tile_meta`'s settings, unused here.

    Each K tile loads the [BLOCK_K, BLOCK_N] weight tile of every slot (the slot loop is unrolled, so the TOP_K
    loads are independent and in flight together) and adds its products, the activation row scaled by the slot's
    router weight (and fp8 tensor scale), into one float32 [BLOCK_K, BLOCK_N] accumulator, as the one-row K loop
    does (``expert_gemm._fma_accumulate``): no exchange between threads until the sum over K after the loop. Weight
    tiles of non-local slots are not read. fp8 weights (QUANT 1-3) are weight-only: their scales multiply the
    activation row (per tensor) or the weight tile (per channel, per 128x128 block)."""
    token = tl.program_id(0).to(tl.int64)
    offs_n, n_ok, offs_nw = columns(tl.program_id(1), N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kt * BLOCK_K
        k_ok = offs_k < K - k0
        for j in tl.static_range(TOP_K):
            slot, expert, weight = _token_slot(
                ids_ptr, map_ptr, topk_w_ptr, token, j, global_E, E, TOP_K, HAS_MAP, MUL_WEIGHT
            )
            local = expert >= 0
            e64 = tl.where(local, expert, 0).to(tl.int64)
            # the activation row broadcast to the weight tile's shape, so that it loads in the tile's layout (a
            # [BLOCK_K] or [BLOCK_K, 1] load takes another one, converted through shared memory every tile); the
            # repeated elements are L1 hits
            a_ptrs = tl.broadcast_to(a_ptr + slot * stride_am + (k0 + offs_k)[:, None] * stride_ak, [BLOCK_K, BLOCK_N])
            a = tl.load(a_ptrs, mask=k_ok[:, None] & local, other=0.0).to(tl.float32)
            w_ptrs = w_ptr + e64 * stride_we + offs_nw[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk
            w = tl.load(w_ptrs, mask=k_ok[:, None] & local, other=0.0).to(tl.float32)
            ws_base = w_scale_ptr + e64 * stride_wse
            if QUANT == 1:
                weight = weight * tl.load(ws_base, mask=local, other=0.0)
            if QUANT == 2:
                w = w * tl.load(ws_base + offs_nw * stride_wsn, mask=local, other=0.0)[None, :]
            if QUANT == 3:
                if BLOCK_K <= GROUP_K:  # the tile lies in one scale group along K
                    s_ptrs = ws_base + (offs_nw // GROUP_N) * stride_wsn + (k0 // GROUP_K) * stride_wsk
                    w = w * tl.load(s_ptrs, mask=local, other=0.0)[None, :]
                else:  # a widened tile (token_tile) spans groups: each K row its own (L1-resident) scale
                    s_ptrs = ws_base + (offs_nw // GROUP_N)[None, :] * stride_wsn
                    s_ptrs += ((k0 + offs_k) // GROUP_K)[:, None] * stride_wsk
                    w = w * tl.load(s_ptrs, mask=k_ok[:, None] & local, other=0.0)
            acc += (a * weight) * w
    total = tl.sum(acc, axis=0)
    if HAS_BIAS:  # each local slot's expert bias, times the slot's router weight
        for j in tl.static_range(TOP_K):
            slot, expert, weight = _token_slot(
                ids_ptr, map_ptr, topk_w_ptr, token, j, global_E, E, TOP_K, HAS_MAP, MUL_WEIGHT
            )
            b_ptrs = bias_ptr + tl.where(expert >= 0, expert, 0).to(tl.int64) * stride_be + offs_nw * stride_bn
            total += tl.load(b_ptrs, mask=expert >= 0, other=0.0).to(tl.float32) * weight
    tl.store(out_ptr + token * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


# ---- wrappers ---------------------------------------------------------------------------------------------------
def _check(a, w, topk_ids, config: GemmConfig, num: Numerics, expert_map) -> None:
    if config.block_m != 1:
        raise ValueError(f"config: the slot-order GEMMs take one-row tiles (BLOCK_M 1), got BLOCK_M {config.block_m}")
    if num.mode == "mxfp4_mma":
        raise ValueError("numerics: mma-layout MXFP4 weights need tiles of 16 rows, not the slot-order GEMMs")
    check_operands(a, w, num, config)
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64) or not topk_ids.is_contiguous():
        raise ValueError(
            f"topk_ids must be a contiguous int32/int64 [M, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    if expert_map is not None and (expert_map.dtype != torch.int32 or not expert_map.is_contiguous()):
        raise ValueError(f"expert_map must be contiguous int32, got {expert_map.dtype}")


def _common(a, topk_ids, topk_weights, bias, num: Numerics, expert_map, num_experts, global_num_experts):
    """The kernels' arguments from ``ids_ptr`` to ``bias_ptr`` (absent ones as ``a``, never read) and the number
    of global experts."""
    if global_num_experts is None:
        global_num_experts = expert_map.numel() if expert_map is not None else num_experts
    ptrs = (
        topk_ids,
        expert_map if expert_map is not None else topk_ids,
        topk_weights if topk_weights is not None else a,
        *scale_ptrs(num, a),
        bias if bias is not None else a,
    )
    return ptrs, global_num_experts


def _bias_strides(bias) -> tuple[int, int]:
    return (0, 0) if bias is None else (bias.stride(0), bias.stride(1))


def _launch_slots(
    a,
    w,
    out,
    topk_ids,
    N,
    K,
    top_k,
    config,
    activation,
    topk_weights,
    on_input,
    bias,
    preact,
    num,
    expert_map,
    num_experts,
    global_num_experts,
):
    """One ``_slot_gemm`` launch over the ``topk_ids.numel()`` slots (see :func:`moe_gemm1_slots`)."""
    ptrs, global_e = _common(a, topk_ids, topk_weights, bias, num, expert_map, num_experts, global_num_experts)
    weighted = topk_weights is not None
    launch(
        _slot_gemm,
        (topk_ids.numel(), cdiv(N, config.block_n)),
        a,
        w,
        out,
        *ptrs,
        preact if preact is not None else a,
        N,
        K,
        top_k,
        global_e,
        num_experts,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        preact.stride(0) if preact is not None else 0,
        *scale_strides(num),
        *_bias_strides(bias),
        WEIGHT_ON_INPUT=weighted and on_input,
        MUL_WEIGHT=weighted and not on_input,
        HAS_BIAS=bias is not None,
        HAS_MAP=expert_map is not None,
        STORE_PREACT=preact is not None,
        **tile_meta(config, num, a.dtype, K, activation),
    )
    return out


def moe_gemm1_slots(
    a: torch.Tensor,
    w1: torch.Tensor,
    out: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    num_experts: int,
    config: GemmConfig,
    activation: str = "silu",
    topk_weights: torch.Tensor | None = None,
    numerics: Numerics = Numerics(),
    bias: torch.Tensor | None = None,
    preact: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
) -> torch.Tensor:
    """GEMM1 with the gated activation, one program per slot and BLOCK_N columns (``config.block_m`` must be 1).

    Args:
        a: [M, H] activations (float, or e4m3 with ``numerics.a_scale`` under fp8); slot s reads row s // k.
        w1: [E, 2I, H] (gate rows then up rows; e4m3 under fp8; packed uint8 [E, 2I, H / 2] under MXFP4).
        out: [M*k, I] slot-indexed activation output, any float dtype; rows of non-local slots are not written.
        topk_ids: int32/int64 [M, k], contiguous; ids are global (``expert_map`` maps them to local experts).
        topk_weights: [M, k], any float dtype; if given, scales each slot's accumulators (router weight on input).
        numerics, bias, preact: as for :func:`fusedmoe.ops.grouped_gemm.moe_gemm1`.
    """
    _check(a, w1, topk_ids, config, numerics, expert_map)
    M, k = topk_ids.shape
    E, two_i = w1.shape[:2]
    H, I = weight_k(w1, numerics), two_i // 2
    if two_i != 2 * I or a.shape != (M, H) or out.shape != (M * k, I) or out.stride(1) != 1:
        raise ValueError(
            f"shape mismatch: a {tuple(a.shape)}, w1 {tuple(w1.shape)}, topk_ids {tuple(topk_ids.shape)}, out "
            f"{tuple(out.shape)} (row-contiguous)"
        )
    if bias is not None and tuple(bias.shape) != (E, two_i):
        raise ValueError(f"bias must have shape {[E, two_i]}, got {list(bias.shape)}")
    if preact is not None and (numerics.mode is not None or preact.shape != (M * k, two_i) or preact.stride(-1) != 1):
        raise ValueError(f"preact must be a row-contiguous [{M * k}, {two_i}] of an unquantized call")
    if M == 0 or I == 0:
        return out
    return _launch_slots(
        a,
        w1,
        out,
        topk_ids,
        I,
        H,
        k,
        config,
        activation,
        topk_weights,
        True,
        bias,
        preact,
        numerics,
        expert_map,
        num_experts,
        global_num_experts,
    )


def _check_gemm2(a, w2, out, topk_ids, bias, numerics, out_rows: int) -> tuple[int, int]:
    E, H = w2.shape[:2]
    I = weight_k(w2, numerics)
    M, k = topk_ids.shape
    if a.shape != (M * k, I) or out.shape != (out_rows, H) or out.stride(1) != 1:
        raise ValueError(
            f"shape mismatch: a {tuple(a.shape)}, w2 {tuple(w2.shape)}, topk_ids {tuple(topk_ids.shape)}, out "
            f"{tuple(out.shape)} (row-contiguous)"
        )
    if bias is not None and tuple(bias.shape) != (E, H):
        raise ValueError(f"bias must have shape {[E, H]}, got {list(bias.shape)}")
    return H, I


def moe_gemm2_slots(
    a: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    num_experts: int,
    config: GemmConfig,
    topk_weights: torch.Tensor | None = None,
    numerics: Numerics = Numerics(),
    bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
) -> torch.Tensor:
    """GEMM2 per slot: ``out[s] = (a[s] @ w2[e].T + bias[e]) * topk_weights[s]`` for the local slots (others not
    written), one program per slot and BLOCK_N columns; the top-k sum is :func:`fusedmoe.ops.reduce.moe_reduce`'s.
    For the formats :func:`moe_gemm2_reduce` does not take (MXFP4 weights).

    Args:
        out: [M*k, H] slot-indexed, any float dtype, row-contiguous. Others as for :func:`moe_gemm2_reduce`.
    """
    _check(a, w2, topk_ids, config, numerics, expert_map)
    H, I = _check_gemm2(a, w2, out, topk_ids, bias, numerics, topk_ids.numel())
    if a.shape[0] == 0 or H == 0:
        return out
    return _launch_slots(
        a,
        w2,
        out,
        topk_ids,
        H,
        I,
        1,
        config,
        None,
        topk_weights,
        False,
        bias,
        None,
        numerics,
        expert_map,
        num_experts,
        global_num_experts,
    )


def moe_gemm2_reduce(
    a: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    num_experts: int,
    config: GemmConfig,
    topk_weights: torch.Tensor | None = None,
    numerics: Numerics = Numerics(),
    bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
) -> torch.Tensor:
    """GEMM2 and the top-k reduce: ``out[t] = sum over local slots s of t of (a[s] @ w2[e].T + bias[e]) *
    topk_weights[s]``, summed in float32 and rounded once to ``out``'s dtype; every element written (a token
    without a local slot gets zeros). One program per token and BLOCK_N columns of the tile :func:`token_tile`
    makes of ``config``.

    Args:
        a: [M*k, I] slot-indexed float activations (GEMM1's output); rows of non-local slots are not read.
        w2: [E, H, I], the activations' dtype, or e4m3 with ``numerics`` fp8 weight scales (weight-only: ``a``
            stays float). Not MXFP4 (:func:`moe_gemm2_slots` takes it).
        out: [M, H], any float dtype, row-contiguous.
        topk_ids, expert_map, global_num_experts: as for :func:`moe_gemm1_slots`.
        topk_weights: [M, k] any float dtype, or None (the weights were applied on the input).
        bias: [E, H], added to each slot's row before its weight.
    """
    if numerics.mode == "mxfp4":
        raise ValueError("numerics: mxfp4 weights take moe_gemm2_slots and the top-k reduce")
    _check(a, w2, topk_ids, config, numerics, expert_map)
    if a.dtype == torch.float8_e4m3fn:
        raise TypeError("a: moe_gemm2_reduce takes float activations (fp8 weights run weight-only)")
    M, k = topk_ids.shape
    H, I = _check_gemm2(a, w2, out, topk_ids, bias, numerics, M)
    if M == 0 or H == 0:
        return out
    ptrs, global_e = _common(a, topk_ids, topk_weights, bias, numerics, expert_map, num_experts, global_num_experts)
    config = token_tile(config, M, H, I, _sm_count(a.device))
    launch(
        _token_gemm2,
        (M, cdiv(H, config.block_n)),
        a,
        w2,
        out,
        *ptrs,
        H,
        I,
        global_e,
        num_experts,
        a.stride(0),
        a.stride(1),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        out.stride(0),
        *scale_strides(numerics),
        *_bias_strides(bias),
        MUL_WEIGHT=topk_weights is not None,
        HAS_BIAS=bias is not None,
        HAS_MAP=expert_map is not None,
        TOP_K=k,
        **tile_meta(config, numerics, a.dtype, I, None),
    )
    return out


#: Narrowest BLOCK_N of the token GEMM2 (a multiply-add tile: no tensor-core minimum).
MIN_TOKEN_BLOCK_N = 4


def token_tile(config: GemmConfig, M: int, H: int, I: int, sms: int) -> GemmConfig:
    """The tile :func:`moe_gemm2_reduce` launches for ``config``: BLOCK_N halved (down to MIN_TOKEN_BLOCK_N) while
    its M x cdiv(H, BLOCK_N) programs number fewer than twice the ``sms``, BLOCK_K doubled each time (up to I rounded
    up to a power of two), so a program keeps the tile's elements and registers. One program per token leaves a
    decode call of a few tokens a fraction of the SMs with the tuned tile (M = 1, H = 2048, BLOCK_N 16: 128
    programs, one K tile's loads in flight per SM), where the aligned GEMM2 it replaces ran k times as many."""
    bn, bk = config.block_n, config.block_k
    k_cap = 1 << max(I - 1, 0).bit_length()
    while bn > MIN_TOKEN_BLOCK_N and M * cdiv(H, bn) < 2 * sms:
        bn //= 2
        bk = min(2 * bk, max(k_cap, config.block_k))
    return config if bn == config.block_n else replace(config, block_n=bn, block_k=bk)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """The GPU's SMs; 0 under the CPU interpreter (the tuned tile as it is)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def token_reduces(mode: str | None) -> bool:
    """Whether GEMM2 of weights in ``mode`` sums each token's slots itself (:func:`moe_gemm2_reduce`): float and
    fp8 weights; MXFP4 weights take :func:`moe_gemm2_slots` and the top-k reduce."""
    return mode is None or mode in ("fp8_tensor", "fp8_token", "fp8_block")


__all__ = ["moe_gemm1_slots", "moe_gemm2_reduce", "moe_gemm2_slots", "token_reduces", "token_tile"]
