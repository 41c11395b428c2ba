"""Grouped GEMMs over expert-aligned blocks (the output of :func:`fusedmoe.ops.align.moe_align`).

- :func:`moe_gemm1`: ``act[slot, n] = act_fn(x[slot // k] @ w1[e, n].T) * (x[slot // k] @ w1[e, I + n].T)``.
  Each program owns one BLOCK_M block of sorted slots and one BLOCK_N tile of I and keeps a gate and an up
  accumulator, so the [M*k, 2I] GEMM1 output never exists in memory.
- :func:`moe_gemm2`: ``y[slot, :] = (act[slot] @ w2[e].T) * topk_weight[slot]`` (weight unless applied on input).

Optional expert biases (``HAS_BIAS``, a constexpr: without bias the kernels compile exactly as before): GEMM1 adds
``b1[e, n]`` / ``b1[e, I + n]`` to the gate / up accumulators before the activation; GEMM2 adds ``b2[e, :]``
before the routing weight multiplies the row.

Programs whose block has expert -1 (past ``num_padded``) exit at once; non-local slots sit in no block, so
their ``act`` / ``y`` rows are never written (the top-k reduce skips them by the same rule). Rows of a valid
block whose sorted id is the sentinel are masked on load and store. Pointer offsets are int64.

fp8 (e4m3, w8a8) epilogues, by ``quant_mode``:
  ``fp8_tensor``: acc * a_scale[0] * w_scale[e];   ``fp8_token``: acc * a_scale[row] * w_scale[e, col];
  ``fp8_block``: per K tile (BLOCK_K divides the group), acc += dot * a_scale[row, kg] * w_scale[e, col//gn, kg].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import cdiv
from .configs import GemmConfig
from .launcher import launch

_QUANT_CODES = {None: 0, "fp8_tensor": 1, "fp8_token": 2, "fp8_block": 3}
_ACTIVATIONS = {"silu": 0, "gelu": 1, "swigluoai": 2, "gelu_exact": 3}
# gpt-oss's clamped SwiGLU (fusedmoe.problem.SWIGLUOAI_ALPHA / SWIGLUOAI_LIMIT)
_SWIGLUOAI_ALPHA = tl.constexpr(1.702)
_SWIGLUOAI_LIMIT = tl.constexpr(7.0)


@triton.jit
def _tile_ids(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M consecutive M blocks sweep the N tiles together (weight reuse in L2)."""
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _activate(gate, up, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:  # silu(g) * u
        return gate * tl.sigmoid(gate) * up
    if ACTIVATION == 2:  # swigluoai: g * sigmoid(alpha g) * (u + 1), g = min(gate, L), u = clamp(up, -L, L)
        g = tl.minimum(gate, _SWIGLUOAI_LIMIT)
        u = tl.minimum(tl.maximum(up, -_SWIGLUOAI_LIMIT), _SWIGLUOAI_LIMIT)
        return g * tl.sigmoid(_SWIGLUOAI_ALPHA * g) * (u + 1.0)
    if ACTIVATION == 3:  # gelu_exact: 0.5 g (1 + erf(g / sqrt(2))) * u
        return 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    # gelu_tanh(g) * u, using 0.5 * (1 + tanh(z)) == sigmoid(2z)
    z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    return gate * tl.sigmoid(2.0 * z) * up


# n_slots and num_pid_m change with every token count; specializing on them (== 1, % 16) would compile up to
# nine variants of each config across M for no benefit (they only bound masks and the tile order).
@triton.jit(do_not_specialize=["n_slots", "num_pid_m"])
def _moe_gemm1(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    topk_w_ptr,
    a_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    n_slots,
    N,
    K,
    top_k,
    num_pid_m,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
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
    GROUP_M: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
):
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_ids(num_pid_m, num_pid_n, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ptr + offs_m)
    row_ok = slot < n_slots
    token = tl.where(row_ok, slot // top_k, 0).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_nw = (offs_n % N).to(tl.int64)  # wrap: no N mask in the K loop, wrapped columns are not stored
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + token[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    g_ptrs = w_base + offs_nw[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + N * stride_wn

    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if QUANT == 3:
        as_ptrs = a_scale_ptr + token * stride_asm
        ws_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
        gs_ptrs = ws_base + (offs_nw // GROUP_N) * stride_wsn
        us_ptrs = ws_base + ((offs_nw + N) // GROUP_N) * stride_wsn

    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = offs_k < K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if QUANT == 3:
            kg = (kt * BLOCK_K) // GROUP_K
            a_s = tl.load(as_ptrs + kg * stride_ask, mask=row_ok, other=0.0)
            g_s = tl.load(gs_ptrs + kg * stride_wsk)
            u_s = tl.load(us_ptrs + kg * stride_wsk)
            acc_g += tl.dot(a, g) * a_s[:, None] * g_s[None, :]
            acc_u += tl.dot(a, u) * a_s[:, None] * u_s[None, :]
        else:
            acc_g = _mma(a, g, acc_g, IEEE)
            acc_u = _mma(a, u, acc_u, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk

    if QUANT == 1:
        s = tl.load(a_scale_ptr) * tl.load(w_scale_ptr + expert.to(tl.int64) * stride_wse)
        acc_g = acc_g * s
        acc_u = acc_u * s
    elif QUANT == 2:
        a_s = tl.load(a_scale_ptr + token * stride_asm, mask=row_ok, other=0.0)
        ws_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
        acc_g = acc_g * a_s[:, None] * tl.load(ws_base + offs_nw * stride_wsn)[None, :]
        acc_u = acc_u * a_s[:, None] * tl.load(ws_base + (offs_nw + N) * stride_wsn)[None, :]
    if WEIGHT_ON_INPUT:
        wt = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0)
        acc_g = acc_g * wt[:, None]
        acc_u = acc_u * wt[:, None]
    if HAS_BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        acc_g += tl.load(b_base + offs_nw * stride_bn).to(tl.float32)[None, :]
        acc_u += tl.load(b_base + (offs_nw + N) * stride_bn).to(tl.float32)[None, :]

    act = _activate(acc_g, acc_u, ACTIVATION)
    o_ptrs = out_ptr + slot.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["n_slots", "num_pid_m"])
def _moe_gemm2(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    topk_w_ptr,
    a_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    n_slots,
    N,
    K,
    num_pid_m,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
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
    GROUP_M: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
):
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_ids(num_pid_m, num_pid_n, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ptr + offs_m)
    row_ok = slot < n_slots
    row = tl.where(row_ok, slot, 0).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_nw = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_nw[None, :] * stride_wn + offs_k[:, None] * stride_wk

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if QUANT == 3:
        as_ptrs = a_scale_ptr + row * stride_asm
        ws_ptrs = w_scale_ptr + expert.to(tl.int64) * stride_wse + (offs_nw // GROUP_N) * stride_wsn

    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if QUANT == 3:
            kg = (kt * BLOCK_K) // GROUP_K
            a_s = tl.load(as_ptrs + kg * stride_ask, mask=row_ok, other=0.0)
            b_s = tl.load(ws_ptrs + kg * stride_wsk)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = _mma(a, b, acc, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    if QUANT == 1:
        acc = acc * (tl.load(a_scale_ptr) * tl.load(w_scale_ptr + expert.to(tl.int64) * stride_wse))
    elif QUANT == 2:
        a_s = tl.load(a_scale_ptr + row * stride_asm, mask=row_ok, other=0.0)
        w_s = tl.load(w_scale_ptr + expert.to(tl.int64) * stride_wse + offs_nw * stride_wsn)
        acc = acc * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + offs_nw * stride_bn).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0)[:, None]

    o_ptrs = out_ptr + slot.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# ---- wrappers ---------------------------------------------------------------------------------------------------
def grid_blocks(n_slots: int, max_blocks: int) -> int:
    """Static bound on the number of non-empty blocks: each holds >= 1 slot, and there are max_blocks."""
    return min(n_slots, max_blocks)


def _scale_strides(quant_mode, a_scale, w_scale):
    """(stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk) for the scale layouts of each mode."""
    if quant_mode is None:
        return 0, 0, 0, 0, 0
    if quant_mode == "fp8_tensor":
        return 0, 0, w_scale.stride(0), 0, 0
    if quant_mode == "fp8_token":
        return a_scale.stride(0), 0, w_scale.stride(0), w_scale.stride(1), 0
    return a_scale.stride(0), a_scale.stride(1), w_scale.stride(0), w_scale.stride(1), w_scale.stride(2)


def _bias_strides(bias):
    return (0, 0) if bias is None else (bias.stride(0), bias.stride(1))


def _check_bias(bias, shape):
    if bias is not None and tuple(bias.shape) != shape:
        raise ValueError(f"bias must have shape {list(shape)}, got {list(bias.shape)}")


def _check_common(a, w, out, sorted_ids, block_expert, quant_mode, a_scale, w_scale, block_shape, cfg):
    if quant_mode not in _QUANT_CODES:
        raise ValueError(f"unknown quant_mode {quant_mode!r}")
    if sorted_ids.dtype != torch.int32 or block_expert.dtype != torch.int32:
        raise TypeError("sorted_ids and block_expert must be int32")
    if quant_mode is not None:
        if a_scale is None or w_scale is None:
            raise ValueError(f"{quant_mode} needs a_scale and w_scale")
        if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{quant_mode}: activations and weights must be float8_e4m3fn")
    elif a.dtype != w.dtype:
        raise TypeError(f"activation dtype {a.dtype} != weight dtype {w.dtype}")
    if quant_mode == "fp8_block":
        gk = block_shape[1]
        if gk % cfg.block_k:
            raise ValueError(f"fp8_block: BLOCK_K {cfg.block_k} must divide the scale group {gk}")


def moe_gemm1(
    a: torch.Tensor,
    w1: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    *,
    top_k: int,
    num_blocks: int,
    config: GemmConfig,
    activation: str = "silu",
    topk_weights: torch.Tensor | None = None,
    quant_mode: str | None = None,
    a_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] = (128, 128),
    fp32_ieee: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """GEMM1 with the gated activation fused; writes ``out`` rows of the slots in valid blocks.

    Args:
        a: [M, H] activations (fp32/fp16/bf16, or e4m3 when quantized); row of slot s is s // top_k.
        w1: [E, 2I, H] (gate rows then up rows), same dtype as ``a`` (e4m3 when quantized).
        out: [M*top_k, I] activation output (slot-indexed), any float dtype.
        sorted_ids, block_expert: from :func:`moe_align` with BLOCK_M == config.block_m.
        num_blocks: M blocks to launch (:func:`grid_blocks`).
        topk_weights: float32 [M, top_k]; if given, scales each slot's accumulators (router weight on input).
        a_scale, w_scale: fp8 scales (see module docstring for shapes per mode).
        bias: [E, 2I] (gate then up), added to the accumulators before the activation.
    """
    _check_common(a, w1, out, sorted_ids, block_expert, quant_mode, a_scale, w_scale, block_shape, config)
    E, two_i, H = w1.shape
    I = two_i // 2
    if two_i != 2 * I or a.shape[-1] != H or out.shape[-1] != I or out.shape[0] != a.shape[0] * top_k:
        raise ValueError(f"shape mismatch: a {tuple(a.shape)}, w1 {tuple(w1.shape)}, out {tuple(out.shape)}")
    _check_bias(bias, (E, two_i))
    n_slots = out.shape[0]
    grid = (num_blocks * cdiv(I, config.block_n),)
    if num_blocks == 0 or I == 0:
        return out
    launch(
        _moe_gemm1,
        grid,
        a,
        w1,
        out,
        sorted_ids,
        block_expert,
        topk_weights if topk_weights is not None else a,
        a_scale if a_scale is not None else a,
        w_scale if w_scale is not None else a,
        bias if bias is not None else a,
        n_slots,
        I,
        H,
        top_k,
        num_blocks,
        a.stride(0),
        a.stride(1),
        w1.stride(0),
        w1.stride(1),
        w1.stride(2),
        out.stride(0),
        out.stride(1),
        *_scale_strides(quant_mode, a_scale, w_scale),
        *_bias_strides(bias),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        QUANT=_QUANT_CODES[quant_mode],
        GROUP_N=block_shape[0],
        GROUP_K=block_shape[1],
        ACTIVATION=_ACTIVATIONS[activation],
        WEIGHT_ON_INPUT=topk_weights is not None,
        IEEE=fp32_ieee and a.dtype == torch.float32,
        EVEN_K=H % config.block_k == 0,
        HAS_BIAS=bias is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def moe_gemm2(
    a: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    *,
    num_blocks: int,
    config: GemmConfig,
    topk_weights: torch.Tensor | None = None,
    quant_mode: str | None = None,
    a_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] = (128, 128),
    fp32_ieee: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """GEMM2: ``out[slot] = a[slot] @ w2[e].T`` (x topk_weights[slot] when given) for slots in valid blocks.

    Args:
        a: [M*k, I] slot-indexed activations (e4m3 when quantized). w2: [E, H, I].
        out: [M*k, H] slot-indexed output, any float dtype.
        topk_weights: float32 [M, k] (flat index = slot) or None (weights applied on input).
        bias: [E, H], added before the routing weight.
    """
    _check_common(a, w2, out, sorted_ids, block_expert, quant_mode, a_scale, w_scale, block_shape, config)
    E, H, I = w2.shape
    if a.shape[-1] != I or out.shape[-1] != H or a.shape[0] != out.shape[0]:
        raise ValueError(f"shape mismatch: a {tuple(a.shape)}, w2 {tuple(w2.shape)}, out {tuple(out.shape)}")
    _check_bias(bias, (E, H))
    n_slots = out.shape[0]
    grid = (num_blocks * cdiv(H, config.block_n),)
    if num_blocks == 0 or H == 0:
        return out
    launch(
        _moe_gemm2,
        grid,
        a,
        w2,
        out,
        sorted_ids,
        block_expert,
        topk_weights if topk_weights is not None else a,
        a_scale if a_scale is not None else a,
        w_scale if w_scale is not None else a,
        bias if bias is not None else a,
        n_slots,
        H,
        I,
        num_blocks,
        a.stride(0),
        a.stride(1),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        out.stride(0),
        out.stride(1),
        *_scale_strides(quant_mode, a_scale, w_scale),
        *_bias_strides(bias),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        QUANT=_QUANT_CODES[quant_mode],
        GROUP_N=block_shape[0],
        GROUP_K=block_shape[1],
        MUL_WEIGHT=topk_weights is not None,
        IEEE=fp32_ieee and a.dtype == torch.float32,
        EVEN_K=I % config.block_k == 0,
        HAS_BIAS=bias is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


__all__ = ["grid_blocks", "moe_gemm1", "moe_gemm2"]
