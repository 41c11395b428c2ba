"""The parts every expert GEMM kernel is made of: the standard layout's (:mod:`.grouped_gemm`) and the batched
layout's (:mod:`.batched_gemm`).

A kernel maps its program to one expert, a BLOCK_M block of activation rows (``row_ok`` masks the rows that do
not exist) and a BLOCK_N tile of output columns, then runs, in this order:

- :func:`columns`: the tile's output columns, their store mask, and the wrapped columns the K loop reads
  (columns past N wrap onto valid ones, so the loop needs no N mask; they are computed and never stored).
- :func:`k_loop`: the K loop. fp32 accumulators of ``a[rows] @ w[e, cols].T`` and, when GATED, of the
  up columns ``cols + N`` (GEMM1: gate rows then up rows of ``w1``). A rows outside ``row_ok`` and, for a K that
  is not a multiple of BLOCK_K, the K tail are masked to zero on load; fp8 scales are applied by ``QUANT``.
- :func:`epilogue`: router weight on the input side, bias, the gated activation, router weight on the output
  side, then one masked store in the output's dtype.

All choices are constexprs, so every kernel compiles to the code it had with these lines written inline.

fp8 (e4m3, w8a8) scales by ``QUANT`` (codes of :data:`QUANT_CODES`):
  1 ``fp8_tensor``: acc * a_scale[0] * w_scale[e];   2 ``fp8_token``: acc * a_scale[row] * w_scale[e, col];
  3 ``fp8_block``: per K tile (BLOCK_K divides the group), acc += dot * a_scale[row, kg] * w_scale[e, col//gn, kg].
Tiles of fewer than 16 rows (BLOCK_M 1, 2, 4 or 8: decode-sized blocks) run :func:`_k_loop_fma`, the same
products summed by multiply-adds in float32 registers (no 16-row tensor-core tile that would be mostly padding).
MXFP4 weights (w4a16) by ``QUANT`` 4 (decoded in registers by integer bit assembly into the activation dtype, then
dots: float32 and fp16 activations and the CPU interpreter) or 5 (``tl.dot_scaled``, whose compiler-generated
upcast is cheaper: bf16 on the GPU); :func:`mxfp4_quant_code` picks. Below 16 rows both take the decode of 4 with
multiply-adds instead of dots.

The host half: :class:`Numerics` (quantization mode, scales, scale groups and fp32 dot precision of a GEMM's
operands, as the op wrappers take them), :func:`check_operands` (the dtype and scale rules of every wrapper),
:func:`scale_ptrs` and :func:`scale_strides` (the scale arguments as the kernels take them) and
:func:`tile_meta` (the constexprs and launch options of a config).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..mxfp4 import GROUP as MXFP4_GROUP  # weight elements per e8m0 scale
from .configs import GemmConfig
from .quantize import _fp8_scale, _to_fp8

QUANT_CODES = {None: 0, "fp8_tensor": 1, "fp8_token": 2, "fp8_block": 3, "mxfp4": 4, "mxfp4_mma": 6}
#: The kernel code of MXFP4 through ``tl.dot_scaled`` (see :func:`mxfp4_quant_code`).
MXFP4_SCALED_DOT = 5
#: The kernel code of mma-layout MXFP4 decoded by integer operations in float32 (the CPU interpreter, which runs no
#: inline assembly); QUANT_CODES["mxfp4_mma"] decodes with PTX (:func:`_k_loop_mxfp4_mma`).
MXFP4_MMA_PORTABLE = 7
#: BLOCK_M below this is too short for a tensor-core dot: such tiles take the multiply-add K loops.
MIN_DOT_BLOCK_M = 16
MIN_DOT_ROWS = tl.constexpr(MIN_DOT_BLOCK_M)
# (The multiply-add loops are not software-pipelined: `tl.range(..., num_stages=3)` stages their loads through
# shared memory and made the MXFP4 and fp8 one-row calls 10-60% slower on the H200, BENCHMARKS.md.)
#: Diagnostic switch: ``FUSEDMOE_MXFP4_DOT=decode`` keeps MXFP4 on the register decode everywhere (to compare).
ENV_MXFP4_DOT = "FUSEDMOE_MXFP4_DOT"

#: Gated activations of GEMM1's epilogue (``_activate``).
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "swigluoai": 2, "gelu_exact": 3}
# gpt-oss's clamped SwiGLU (fusedmoe.problem.SWIGLUOAI_ALPHA / SWIGLUOAI_LIMIT)
_SWIGLUOAI_ALPHA = tl.constexpr(1.702)
_SWIGLUOAI_LIMIT = tl.constexpr(7.0)


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


#: Diagnostic switch: ``FUSEDMOE_FP8_BLOCK_ACC=N`` makes each fp8_block K tile's tensor-core product add its partial
#: sums into float32 every N elements of K (Triton's ``max_num_imprecise_acc``); unset, the wgmma accumulates the
#: whole tile in its own fp8 accumulation precision.
ENV_FP8_BLOCK_ACC = "FUSEDMOE_FP8_BLOCK_ACC"
_FP8_BLOCK_ACC = tl.constexpr(int(os.environ[ENV_FP8_BLOCK_ACC]) if os.environ.get(ENV_FP8_BLOCK_ACC) else None)


@triton.jit
def _block_dot(a, b):
    """One fp8_block K tile's product ``a @ b`` in float32 (see :data:`ENV_FP8_BLOCK_ACC`)."""
    return tl.dot(a, b, max_num_imprecise_acc=_FP8_BLOCK_ACC)


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


@triton.jit
def columns(pid_n, N, BLOCK_N: tl.constexpr):
    """(offs_n, n_ok, offs_nw) of output tile ``pid_n``: the columns, their store mask, and the columns wrapped
    into [0, N) as int64 (what the K loop and the column-indexed loads read)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_n, offs_n < N, (offs_n % N).to(tl.int64)


@triton.jit
def k_loop(
    a_op,
    w_op,
    scales,
    row_ok,
    expert,
    BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    GATED: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    w_desc=None,
    desc_row=0,
    INTERLEAVE: tl.constexpr = False,
    first_col=0,
    TILE_W_SCALE: tl.constexpr = False,
    WEIGHTS_FIRST: tl.constexpr = False,
):
    """The K loop of one tile: for MXFP4 weights :func:`_k_loop_mxfp4_scaled` (QUANT 5) or :func:`_k_loop_mxfp4`
    (QUANT 4), else :func:`_k_loop_dense`. Tiles of fewer than 16 rows (BLOCK_M) take multiply-adds in every
    format: for MXFP4 :func:`_k_loop_mxfp4_row` (one row) or :func:`_k_loop_mxfp4` with FMA, :func:`_k_loop_fma`
    for the others. ``w_desc``: see :func:`_k_loop_dense` (only its tensor-core tiles take one). ``INTERLEAVE``
    (gated tensor-core tiles of dense, fp8_tensor or fp8_token weights): :func:`_k_loop_gate_up`. MXFP4 weights in
    the mma layout (QUANT 6, or 7 without inline assembly): :func:`_k_loop_mxfp4_mma`, whose tile starts at output
    column ``desc_row``. ``TILE_W_SCALE`` (fp8_block): the tile's gate columns, and its up columns, each lie in one
    weight scale group, found from the tile's first output column ``first_col``. ``WEIGHTS_FIRST`` (fp8 tiles of
    16-32 rows, :func:`weights_first_fp8`): :func:`_k_loop_fp8_weights_first`."""
    fma: tl.constexpr = row_ok.shape[0] < MIN_DOT_ROWS
    if QUANT == 6 or QUANT == 7:
        acc_g, acc_u = _k_loop_mxfp4_mma(a_op, w_op, scales, row_ok, expert, desc_row, BLOCK_K, GATED, IEEE, QUANT == 6)
    elif QUANT == 5 and not fma:
        acc_g, acc_u = _k_loop_mxfp4_scaled(a_op, w_op, scales, row_ok, expert, BLOCK_K, GATED)
    elif (QUANT == 4 or QUANT == 5) and row_ok.shape[0] == 1:
        acc_g, acc_u = _k_loop_mxfp4_row(a_op, w_op, scales, row_ok, expert, BLOCK_K, GATED)
    elif QUANT == 4 or QUANT == 5:
        acc_g, acc_u = _k_loop_mxfp4(a_op, w_op, scales, row_ok, expert, BLOCK_K, GATED, IEEE, fma)
    elif INTERLEAVE and GATED and (QUANT != 3 or TILE_W_SCALE) and not fma:
        acc_g, acc_u = _k_loop_gate_up(
            a_op, w_op, scales, row_ok, expert, BLOCK_K, QUANT, GROUP_N, GROUP_K, IEEE, EVEN_K, w_desc, desc_row
        )
    elif fma:
        acc_g, acc_u = _k_loop_fma(a_op, w_op, scales, row_ok, expert, BLOCK_K, QUANT, GROUP_N, GROUP_K, GATED)
    elif WEIGHTS_FIRST:
        acc_g, acc_u = _k_loop_fp8_weights_first(
            a_op, w_op, scales, row_ok, expert, BLOCK_K, QUANT, GROUP_N, GROUP_K, GATED, EVEN_K
        )
    else:
        acc_g, acc_u = _k_loop_dense(
            a_op,
            w_op,
            scales,
            row_ok,
            expert,
            BLOCK_K,
            QUANT,
            GROUP_N,
            GROUP_K,
            GATED,
            IEEE,
            EVEN_K,
            w_desc,
            desc_row,
            first_col,
            TILE_W_SCALE,
        )
    return acc_g, acc_u


@triton.jit
def _e2m1(code):
    """float32 value of e2m1 codes (integers in [0, 16)): sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0.
    The float32 bits are assembled with integer operations (no exp2: a special-function-unit instruction per
    element limited the decode): exponent e > 0 gives 2^(e-1) (1 + m/2), e = 0 gives m/2."""
    c = code.to(tl.int32)
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


#: :func:`_e2m1_shifted` decodes to 2^-14 of the e2m1 value; the multiply-add loop scales its sums back once.
_E2M1_SHIFT = tl.constexpr(16384.0)


@triton.jit
def _e2m1_shifted(code):
    """float32 value of e2m1 codes (integers in [0, 16)) times 2^-14, in fewer operations than :func:`_e2m1`: the
    code's exponent and mantissa bits placed under fp16's (bits 11-9, sign to bit 15) make the fp16 number
    2^-14 x the e2m1 value (exponent 0 lands on fp16's subnormals, as e2m1's does), then one conversion. The caller
    multiplies its sums by 2^14 (exact: a power of two)."""
    c = code.to(tl.int32)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e8m0(s):
    """float32 value 2^(s - 127) of e8m0 scale bytes ``s``, from their bits: exponent field s, or the subnormal
    2^-127 for s = 0 (255, NaN in the OCP format and never written by our quantizer, gives inf as in
    :func:`fusedmoe.mxfp4.dequantize_mxfp4`)."""
    s = s.to(tl.int32)
    bits = tl.where(s == 0, 1 << 22, s << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _k_loop_mxfp4(
    a_op,
    w_op,
    scales,
    row_ok,
    expert,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    IEEE: tl.constexpr,
    FMA: tl.constexpr,
):
    """:func:`k_loop` for MXFP4 weights (w4a16): ``w_ptr`` holds bytes [N(, 2N), K / 2], byte ``j`` of a row
    packing elements ``2j`` (low nibble) and ``2j + 1`` (high nibble); ``w_scale_ptr`` holds e8m0 bytes
    [N(, 2N), K / 32] (value ``2^(s - 127)``; strides ``stride_wse/wsn/wsk`` of ``scales``). Each K tile decodes
    its weight bytes in registers and multiplies the even K columns of ``a`` by the low nibbles, the odd ones by the
    high nibbles: two dots in the activation dtype, or with ``FMA`` float32 multiply-adds (any BLOCK_M) kept
    unreduced over K until the loop ends (:func:`_fma_accumulate`). BLOCK_K and K are multiples of 32."""
    a_ptr, stride_ae, rows, stride_am, stride_ak = a_op
    w_ptr, stride_we, offs_nw, N, K, stride_wn, stride_wk = w_op
    a_scale_ptr, scale_rows, stride_asm, stride_ask, w_scale_ptr, stride_wse, stride_wsn, stride_wsk = scales
    HALF: tl.constexpr = BLOCK_K // 2
    R: tl.constexpr = rows.shape[0]
    offs_j = tl.arange(0, HALF)  # byte columns of the tile
    a_even = a_ptr + expert.to(tl.int64) * stride_ae + rows[:, None] * stride_am + (2 * offs_j)[None, :] * stride_ak
    g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_nw[None, :] * stride_wn + offs_j[:, None] * stride_wk
    gs_ptrs = w_scale_ptr + expert.to(tl.int64) * stride_wse + offs_nw[None, :] * stride_wsn
    # one scale per 16 bytes (32 elements): FMA loads a [HALF / 16, BLOCK_N] tile and broadcasts it in registers
    offs_s = tl.arange(0, HALF // 16) if FMA else offs_j // 16
    gs_ptrs += offs_s[:, None] * stride_wsk
    if FMA:
        acc_g = _fma_zeros(R, HALF, offs_nw.shape[0])
        acc_u = _fma_zeros(R, HALF, offs_nw.shape[0])
    else:
        acc_g = tl.zeros([R, offs_nw.shape[0]], dtype=tl.float32)
        acc_u = tl.zeros([R, offs_nw.shape[0]], dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        j_ok = offs_j < (K - kt * BLOCK_K) // 2
        s_ok = offs_s < (K - kt * BLOCK_K) // 32 if FMA else j_ok
        a_e = tl.load(a_even, mask=row_ok[:, None] & j_ok[None, :], other=0.0)
        a_o = tl.load(a_even + stride_ak, mask=row_ok[:, None] & j_ok[None, :], other=0.0)
        acc_g = _mxfp4_products(a_e, a_o, g_ptrs, gs_ptrs, j_ok, s_ok, acc_g, IEEE, FMA)
        if GATED:
            u_ptrs = g_ptrs + N * stride_wn
            acc_u = _mxfp4_products(a_e, a_o, u_ptrs, gs_ptrs + N * stride_wsn, j_ok, s_ok, acc_u, IEEE, FMA)
        a_even += BLOCK_K * stride_ak
        g_ptrs += HALF * stride_wk
        gs_ptrs += (HALF // 16) * stride_wsk
    if FMA:
        acc_g, acc_u = _fma_sum(acc_g, R) * _E2M1_SHIFT, _fma_sum(acc_u, R) * _E2M1_SHIFT
    return acc_g, acc_u


@triton.jit
def _k_loop_mxfp4_row(a_op, w_op, scales, row_ok, expert, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
    """:func:`_k_loop_mxfp4` for one-row tiles, in fewer instructions per weight: the packed bytes are read as
    32-bit words (element ``8j + p`` of a K tile in bits ``4p``-``4p + 3`` of word ``j``; :func:`check_operands`
    requires rows of whole, aligned words), each integer operation decodes two codes into a pair of fp16 bit
    patterns (:func:`_e2m1_pair`), and a word's 8 products are summed before the e8m0 scale that the 8 share
    multiplies them, once. The float32 sums stay unreduced over the tile's words until the loop ends."""
    a_ptr, stride_ae, rows, stride_am, stride_ak = a_op
    w_ptr, stride_we, offs_nw, N, K, stride_wn, stride_wk = w_op
    a_scale_ptr, scale_rows, stride_asm, stride_ask, w_scale_ptr, stride_wse, stride_wsn, stride_wsk = scales
    WORDS: tl.constexpr = BLOCK_K // 8
    GROUPS: tl.constexpr = BLOCK_K // 32  # 4 words per e8m0 scale (32 elements)
    BLOCK_N: tl.constexpr = offs_nw.shape[0]
    offs_w = tl.arange(0, WORDS)
    e64 = expert.to(tl.int64)
    # [WORDS, 1]: element 8j of the row for word j (element 8j + p is p columns on)
    a_ptrs = a_ptr + e64 * stride_ae + rows[None, :] * stride_am + (8 * offs_w)[:, None] * stride_ak
    w_words = (w_ptr + e64 * stride_we).to(tl.pointer_type(tl.int32))
    g_ptrs = w_words + offs_nw[None, :] * (stride_wn // 4) + offs_w[:, None]
    gs_ptrs = w_scale_ptr + e64 * stride_wse + offs_nw[None, :] * stride_wsn
    gs_ptrs += tl.arange(0, GROUPS)[:, None] * stride_wsk
    acc_g = tl.zeros([WORDS, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([WORDS, BLOCK_N], dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        w_ok = offs_w < (K - kt * BLOCK_K) // 8
        a_ok = w_ok[:, None] & row_ok[None, :]
        s_ok = (tl.arange(0, GROUPS) < (K - kt * BLOCK_K) // 32)[:, None]
        g = tl.load(g_ptrs, mask=w_ok[:, None], other=0)
        sum_g = tl.zeros([WORDS, BLOCK_N], dtype=tl.float32)
        if GATED:
            u = tl.load(g_ptrs + N * (stride_wn // 4), mask=w_ok[:, None], other=0)
            sum_u = tl.zeros([WORDS, BLOCK_N], dtype=tl.float32)
        for p in tl.static_range(4):  # codes p and p + 4 of every word
            a_lo = tl.load(a_ptrs + p * stride_ak, mask=a_ok, other=0.0).to(tl.float32)
            a_hi = tl.load(a_ptrs + (p + 4) * stride_ak, mask=a_ok, other=0.0).to(tl.float32)
            lo, hi = _e2m1_pair(g, p)
            sum_g += a_lo * lo + a_hi * hi
            if GATED:
                lo, hi = _e2m1_pair(u, p)
                sum_u += a_lo * lo + a_hi * hi
        acc_g += sum_g * _word_scales(gs_ptrs, s_ok, WORDS)
        if GATED:
            acc_u += sum_u * _word_scales(gs_ptrs + N * stride_wsn, s_ok, WORDS)
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += WORDS
        gs_ptrs += GROUPS * stride_wsk
    acc_g = tl.sum(acc_g, axis=0)[None, :] * _E2M1_SHIFT
    acc_u = tl.sum(acc_u, axis=0)[None, :] * _E2M1_SHIFT
    return acc_g, acc_u


@triton.jit
def _e2m1_pair(words, p: tl.constexpr):
    """float32 values, times 2^-14, of codes ``p`` and ``p + 4`` (p < 4) of int32 ``words`` holding 8 e2m1 codes
    each (code ``i`` in bits ``4i``-``4i + 3``): both codes shifted under the fp16 exponent and mantissa of one
    16-bit half each (:func:`_e2m1_shifted`'s bits, two codes per integer operation), then one conversion each."""
    x = words >> (4 * p)  # code p in bits 0-3, code p + 4 in bits 16-19 (higher bits are masked off)
    h = ((x & 0x70007) << 9) | ((x & 0x80008) << 12)
    lo = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (h >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _word_scales(s_ptrs, s_ok, WORDS: tl.constexpr):
    """[WORDS, BLOCK_N] float32 e8m0 scales of a K tile's words: the [WORDS / 4, BLOCK_N] bytes at ``s_ptrs`` (one
    per 32 elements: 4 words), each repeated for its 4 words in registers."""
    s = _e8m0(tl.load(s_ptrs, mask=s_ok, other=127))
    return tl.reshape(tl.broadcast_to(s[:, None, :], [s.shape[0], 4, s.shape[1]]), [WORDS, s.shape[1]])


@triton.jit
def _mxfp4_products(a_e, a_o, w_ptrs, s_ptrs, j_ok, s_ok, acc, IEEE: tl.constexpr, FMA: tl.constexpr):
    """``acc + a_e @ lo + a_o @ hi`` for the weight bytes at ``w_ptrs`` [BLOCK_K / 2, BLOCK_N] decoded with the
    e8m0 scales at ``s_ptrs``; bytes past K (``j_ok``) decode to 0. ``FMA``: ``acc`` is the unreduced float32
    accumulator of :func:`_fma_accumulate` (no dot, so any number of rows), else two dots in the activation dtype."""
    b = tl.load(w_ptrs, mask=j_ok[:, None], other=0)
    scale = _e8m0(tl.load(s_ptrs, mask=s_ok[:, None], other=127))
    if FMA:  # scales [HALF / 16, BLOCK_N] -> [HALF, BLOCK_N]; 2^-14 of the weights (the caller scales sums back)
        G: tl.constexpr = scale.shape[0]
        scale = tl.reshape(tl.broadcast_to(scale[:, None, :], [G, 16, scale.shape[1]]), [G * 16, scale.shape[1]])
        acc = _fma_accumulate(acc, a_e, _e2m1_shifted(b & 15) * scale)
        acc = _fma_accumulate(acc, a_o, _e2m1_shifted(b >> 4) * scale)
    else:
        acc = _mma(a_e, (_e2m1(b & 15) * scale).to(a_e.dtype), acc, IEEE)
        acc = _mma(a_o, (_e2m1(b >> 4) * scale).to(a_e.dtype), acc, IEEE)
    return acc


@triton.jit
def _k_loop_mxfp4_scaled(a_op, w_op, scales, row_ok, expert, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
    """:func:`_k_loop_mxfp4` through ``tl.dot_scaled``: the same operands (bf16 activations), each K tile
    one scaled dot per accumulator on the packed bytes [BLOCK_K / 2, BLOCK_N] and their e8m0 scales
    [BLOCK_N, BLOCK_K / 32]; the compiler upcasts the e2m1 pairs to bf16 (the activations' dtype)."""
    a_ptr, stride_ae, rows, stride_am, stride_ak = a_op
    w_ptr, stride_we, offs_nw, N, K, stride_wn, stride_wk = w_op
    a_scale_ptr, scale_rows, stride_asm, stride_ask, w_scale_ptr, stride_wse, stride_wsn, stride_wsk = scales
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 32
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, HALF)
    offs_s = tl.arange(0, GROUPS)
    e64 = expert.to(tl.int64)
    a_ptrs = a_ptr + e64 * stride_ae + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    g_ptrs = w_ptr + e64 * stride_we + offs_nw[None, :] * stride_wn + offs_j[:, None] * stride_wk
    gs_ptrs = w_scale_ptr + e64 * stride_wse + offs_nw[:, None] * stride_wsn + offs_s[None, :] * stride_wsk
    acc_g = tl.zeros([rows.shape[0], offs_nw.shape[0]], dtype=tl.float32)
    acc_u = tl.zeros([rows.shape[0], offs_nw.shape[0]], dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kt * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k < k_left)[None, :], other=0.0)
        j_ok = (offs_j < k_left // 2)[:, None]
        s_ok = (offs_s < k_left // 32)[None, :]
        acc_g = _scaled_dot(a, tl.load(g_ptrs, mask=j_ok, other=0), tl.load(gs_ptrs, mask=s_ok, other=127), acc_g)
        if GATED:
            u = tl.load(g_ptrs + N * stride_wn, mask=j_ok, other=0)
            acc_u = _scaled_dot(a, u, tl.load(gs_ptrs + N * stride_wsn, mask=s_ok, other=127), acc_u)
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += HALF * stride_wk
        gs_ptrs += GROUPS * stride_wsk
    return acc_g, acc_u


@triton.jit
def _k_loop_mxfp4_mma(
    a_op,
    w_op,
    scales,
    row_ok,
    expert,
    first_col,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    IEEE: tl.constexpr,
    ASM: tl.constexpr,
):
    """:func:`k_loop` for MXFP4 weights in the mma layout (:mod:`fusedmoe.mxfp4_layout`), weights first: each K tile
    decodes a [W_ROWS, BLOCK_K] weight tile straight into the tensor cores' A-operand registers and accumulates
    ``acc^T += w @ a^T`` ([W_ROWS, BLOCK_M], float32); the transpose back happens once, after the loop.

    ``w_op``'s pointer and strides are the layout's values [E, R, 8 Kp] (row blocks of 16 weight rows), ``scales``'
    weight scales its [E, R, Kp / 2] bytes; ``N`` is the output width (I for GEMM1, H for GEMM2) and ``first_col``
    the tile's first output column. A GATED tile reads 2 x BLOCK_N weight rows (row block b holds the gate rows of
    output columns 8b..8b+7, then their up rows) and splits the accumulator into gate and up in registers; GEMM2's
    tile reads BLOCK_N rows. Row blocks past the weight and bytes past the layout's padded K load as zeros (code
    0). ``ASM``: decode with PTX into bf16 (one multiply per pair applies scale and bias); else integer operations
    into float32 (the interpreter). BLOCK_K is a multiple of 64, BLOCK_M at least 16."""
    a_ptr, stride_ae, rows, stride_am, stride_ak = a_op
    w_ptr, stride_we, offs_nw, N, K, stride_wn, stride_wk = w_op
    a_scale_ptr, scale_rows, stride_asm, stride_ask, w_scale_ptr, stride_wse, stride_wsn, stride_wsk = scales
    BLOCK_N: tl.constexpr = offs_nw.shape[0]
    BLOCK_M: tl.constexpr = rows.shape[0]
    COLS_PER_BLOCK: tl.constexpr = 8 if GATED else 16
    RB: tl.constexpr = BLOCK_N // COLS_PER_BLOCK
    W_ROWS: tl.constexpr = 16 * RB
    e64 = expert.to(tl.int64)
    rb = first_col // COLS_PER_BLOCK + tl.arange(0, RB)
    rb_ok = (rb < N // COLS_PER_BLOCK)[:, None]
    kp_bytes = tl.cdiv(K, 64) * 512  # the layout's bytes per row block (K padded to 64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + e64 * stride_ae + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_rows = w_ptr + e64 * stride_we + rb.to(tl.int64)[:, None] * stride_wn
    s_ptrs = (
        w_scale_ptr + e64 * stride_wse + rb.to(tl.int64)[:, None] * stride_wsn + tl.arange(0, BLOCK_K // 2)[None, :]
    )
    if ASM:
        offs_b = tl.arange(0, 8 * BLOCK_K)
        v_ptrs = w_rows + offs_b[None, :]
    else:  # 32-bit words: the decode below works on whole words
        offs_b = tl.arange(0, 2 * BLOCK_K)
        v_ptrs = w_rows.to(tl.pointer_type(tl.uint32)) + offs_b[None, :]
    acc = tl.zeros([W_ROWS, BLOCK_M], dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        left = kp_bytes - kt * (8 * BLOCK_K)  # bytes of this row block from the tile's first on
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k < K - kt * BLOCK_K)[None, :], other=0.0)
        s = tl.load(s_ptrs, mask=rb_ok & (tl.arange(0, BLOCK_K // 2) < left // 16)[None, :], other=0)
        if ASM:
            v = tl.load(v_ptrs, mask=rb_ok & (offs_b < left)[None, :], other=0)
            w = _mma_weights_ptx(v, s, W_ROWS, BLOCK_K)
        else:
            v = tl.load(v_ptrs, mask=rb_ok & (offs_b < left // 4)[None, :], other=0)
            w = _mma_weights_portable(v, s, W_ROWS, BLOCK_K)
        acc = _mma(w.to(a.dtype), a.trans(), acc, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        v_ptrs += offs_b.shape[0]
        s_ptrs += BLOCK_K // 2
    # (one return: Triton checks every return of a function against the others, constexpr branches included)
    if GATED:  # rows (block, gate/up, 8 columns) -> gate and up of the tile's BLOCK_N columns, in registers
        t = tl.permute(tl.reshape(acc, [RB, 2, 8, BLOCK_M]), (0, 2, 3, 1))
        acc_g, acc_u = tl.split(tl.reshape(t, [BLOCK_N, BLOCK_M, 2]))
    else:
        acc_g, acc_u = acc, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    return acc_g.trans(), acc_u.trans()


@triton.jit
def _mma_pairs_ptx(v):
    """bf16 values times 2^-126 of the e2m1 codes in a word of 4 layout bytes (``pack=4``): the first tensor holds
    slots 0 and 1 (each as the pair of halves 0, 1), the second slots 2 and 3 (:mod:`fusedmoe.mxfp4_layout`)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 s3, e3, m3;
        and.b32 $0, $4, 0x81C081C0;
        shl.b32 s3, $4, 3;
        and.b32 $1, s3, 0x81C081C0;
        shl.b32 s3, $4, 6;
        and.b32 $2, s3, 0x81C081C0;
        shl.b32 s3, $4, 1;
        shr.b32 e3, $4, 3;
        shr.b32 m3, $4, 7;
        and.b32 s3, s3, 0x80008000;
        and.b32 e3, e3, 0x01800180;
        and.b32 m3, m3, 0x00400040;
        or.b32 s3, s3, e3;
        or.b32 $3, s3, m3;
        }""",
        constraints="=r,=r,=r,=r,r",
        args=[v],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _mma_scales_ptx(s):
    """bf16 2^(s - 127) of layout scale bytes ``s`` (each byte moved under bf16's exponent field), 4 per word."""
    return tl.inline_asm_elementwise(
        asm="""{
        prmt.b32 $0, $2, 0, 0x5140;
        shl.b32 $0, $0, 7;
        prmt.b32 $1, $2, 0, 0x7362;
        shl.b32 $1, $1, 7;
        }""",
        constraints="=r,=r,r",
        args=[s],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _mma_weights_ptx(v, s, W_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [W_ROWS, BLOCK_K] bf16 weights of a K tile's layout bytes ``v`` [RB, 8 BLOCK_K] and scale bytes ``s``
    [RB, BLOCK_K / 2]. The reshapes only rename registers: each thread's decoded pairs already are its operand."""
    RB: tl.constexpr = W_ROWS // 16
    lo, hi = _mma_pairs_ptx(v)
    # byte (rb, kc, g, q, kt, h, t) of slot s = 2 j + h, j = which tensor -> rows (rb, h, g), columns (kc, kt, j, q, t)
    w = tl.reshape(tl.join(lo, hi), [RB, BLOCK_K // 64, 8, 4, 4, 2, 2, 2])
    w = tl.reshape(tl.permute(w, (0, 5, 2, 1, 4, 7, 3, 6)), [W_ROWS, BLOCK_K])
    return w * _mma_group_scales(_mma_scales_ptx(s), W_ROWS, BLOCK_K)


@triton.jit
def _mma_group_scales(scale, W_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per-element scales [W_ROWS, BLOCK_K] of a K tile's decoded scale bytes [RB, BLOCK_K / 2] (layout order
    (rb, kc, g, u, h); one scale per row and 32 columns)."""
    RB: tl.constexpr = W_ROWS // 16
    sc = tl.reshape(scale, [RB, BLOCK_K // 64, 8, 2, 2])
    sc = tl.reshape(tl.permute(sc, (0, 4, 2, 1, 3)), [W_ROWS, BLOCK_K // 32])
    return tl.reshape(tl.broadcast_to(sc[:, :, None], [W_ROWS, BLOCK_K // 32, 32]), [W_ROWS, BLOCK_K])


@triton.jit
def _half_f32(x, HIGH: tl.constexpr):
    """float32 whose bits are bf16 half ``HIGH`` of uint32 ``x`` (the bf16 widened exactly)."""
    if HIGH:
        bits = x & 0xFFFF0000
    else:
        bits = x << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mma_weights_portable(words, s, W_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`_mma_weights_ptx` in float32 from the layout's uint32 ``words`` [RB, 2 BLOCK_K], by the same shifts and
    masks in Triton integer operations (no inline assembly: runs under the CPU interpreter)."""
    RB: tl.constexpr = W_ROWS // 16
    s0 = words & 0x81C081C0
    s1 = (words << 3) & 0x81C081C0
    s2 = (words << 6) & 0x81C081C0
    s3 = ((words << 1) & 0x80008000) | ((words >> 3) & 0x01800180) | ((words >> 7) & 0x00400040)
    j0 = tl.join(tl.join(_half_f32(s0, False), _half_f32(s0, True)), tl.join(_half_f32(s1, False), _half_f32(s1, True)))
    j1 = tl.join(tl.join(_half_f32(s2, False), _half_f32(s2, True)), tl.join(_half_f32(s3, False), _half_f32(s3, True)))
    # word (rb, kc, g, q, kt) x (t, h, j) -> rows (rb, h, g), columns (kc, kt, j, q, t)
    w = tl.reshape(tl.join(j0, j1), [RB, BLOCK_K // 64, 8, 4, 4, 2, 2, 2])
    w = tl.reshape(tl.permute(w, (0, 6, 2, 1, 4, 7, 3, 5)), [W_ROWS, BLOCK_K])
    scale = (s.to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    return w * _mma_group_scales(scale, W_ROWS, BLOCK_K)


@triton.jit
def _scaled_dot(a, w_bytes, w_scales, acc):
    """``acc + a @ decode(w_bytes, w_scales)`` for bf16 ``a`` (Triton 3.6 fails to compile the fp16 form).
    ``fast_math`` leaves out the upcast's NaN handling of scale byte 255 (the OCP format's NaN, which neither our
    quantizer nor a checkpoint of finite weights holds): on sm90 11-18% fewer SASS instructions in the compiled
    kernel (``scripts/sass_stats.py``) and 1.13-1.23x faster at M >= 64 on the H200 (BENCHMARKS.md)."""
    return tl.dot_scaled(a, None, "bf16", w_bytes, w_scales, "e2m1", acc, fast_math=True)


@triton.jit
def _fma_zeros(R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The zero accumulator of :func:`_fma_accumulate`: [BLOCK_K, BLOCK_N] for one row, else [R, BLOCK_K, BLOCK_N]."""
    # (one return: Triton checks every return of a function against the others, constexpr branches included)
    if R == 1:
        acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([R, BLOCK_K, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit
def _fma_accumulate(acc, a, w):
    """``acc`` plus the float32 products ``a[r, k] * w[k, n]`` of a [R, BLOCK_K] and w [BLOCK_K, BLOCK_N], not yet
    summed over k: multiply-adds on the CUDA cores, each thread into its own registers. Summing over k in every K
    tile would be a cross-warp reduction (shared memory and a barrier) per tile; :func:`_fma_sum` does it once,
    after the loop. One row keeps a 2D accumulator (a [1, BLOCK_K, BLOCK_N] one costs layout conversions)."""
    if a.shape[0] == 1:
        acc += tl.reshape(a.to(tl.float32), [a.shape[1], 1]) * w.to(tl.float32)
    else:
        acc += a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _fma_sum(acc, R: tl.constexpr):
    """[R, BLOCK_N]: the accumulator of :func:`_fma_accumulate` summed over k."""
    if R == 1:
        out = tl.sum(acc, axis=0)[None, :]
    else:
        out = tl.sum(acc, axis=1)
    return out


@triton.jit
def _k_loop_fma(
    a_op,
    w_op,
    scales,
    row_ok,
    expert,
    BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    GATED: tl.constexpr,
):
    """:func:`_k_loop_dense` for tiles of fewer than 16 rows (decode-sized blocks): the same operands, scales and
    result, the products summed in float32 registers instead of a tensor-core dot (a dot tile has 16 rows at
    least; with one or a few real rows it would be mostly padding, and such a call is bound by reading the
    weights). fp8 operands are widened to float32 as loaded; their scales apply as in the dot loop. Activations
    may also be unquantized (float, no activation scales) under fp8 weights: weight-only fp8 (w8a16)."""
    a_ptr, stride_ae, rows, stride_am, stride_ak = a_op
    w_ptr, stride_we, offs_nw, N, K, stride_wn, stride_wk = w_op
    a_scale_ptr, scale_rows, stride_asm, stride_ask, w_scale_ptr, stride_wse, stride_wsn, stride_wsk = scales
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + expert.to(tl.int64) * stride_ae + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_nw[None, :] * stride_wn + offs_k[:, None] * stride_wk
    ws_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
    R: tl.constexpr = rows.shape[0]
    acc_g = _fma_zeros(R, BLOCK_K, offs_nw.shape[0])
    acc_u = _fma_zeros(R, BLOCK_K, offs_nw.shape[0])
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kt * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0).to(tl.float32)
        if GATED:
            u = tl.load(g_ptrs + N * stride_wn, mask=k_ok[:, None], other=0.0).to(tl.float32)
        if QUANT == 3:  # per K tile: the rows' group scales (fp8 activations), the columns' block scales
            kg = (kt * BLOCK_K) // GROUP_K
            if a_ptr.dtype.element_ty.is_fp8():
                a_s = tl.load(a_scale_ptr + scale_rows * stride_asm + kg * stride_ask, mask=row_ok, other=0.0)
                a = a * a_s[:, None]
            g = g * tl.load(ws_base + (offs_nw // GROUP_N) * stride_wsn + kg * stride_wsk)[None, :]
            if GATED:
                u = u * tl.load(ws_base + ((offs_nw + N) // GROUP_N) * stride_wsn + kg * stride_wsk)[None, :]
        acc_g = _fma_accumulate(acc_g, a, g)
        if GATED:
            acc_u = _fma_accumulate(acc_u, a, u)
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += BLOCK_K * stride_wk
    a_scaled: tl.constexpr = a_ptr.dtype.element_ty.is_fp8()
    acc_g, acc_u = _fma_sum(acc_g, R), _fma_sum(acc_u, R)
    return _scale_after_k(acc_g, acc_u, scales, row_ok, expert, offs_nw, N, QUANT, GATED, a_scaled)


@triton.jit
def _scale_after_k(
    acc_g, acc_u, scales, row_ok, expert, offs_nw, N, QUANT: tl.constexpr, GATED: tl.constexpr, A_SCALED: tl.constexpr
):
    """The fp8 scales that apply once, after the K loop: per tensor (QUANT 1: ``a_scale[0] * w_scale[e]``) or per
    row and column (QUANT 2: ``a_scale[row] * w_scale[e, col]``), the activation's factor only when A_SCALED (fp8
    activations); other modes return the accumulators as they are."""
    a_scale_ptr, scale_rows, stride_asm, stride_ask, w_scale_ptr, stride_wse, stride_wsn, stride_wsk = scales
    ws_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
    if QUANT == 1:
        s = tl.load(ws_base)
        if A_SCALED:
            s = s * tl.load(a_scale_ptr)
        acc_g = acc_g * s
        if GATED:
            acc_u = acc_u * s
    elif QUANT == 2:
        if A_SCALED:
            a_s = tl.load(a_scale_ptr + scale_rows * stride_asm, mask=row_ok, other=0.0)
            acc_g = acc_g * a_s[:, None]
            if GATED:
                acc_u = acc_u * a_s[:, None]
        acc_g = acc_g * tl.load(ws_base + offs_nw * stride_wsn)[None, :]
        if GATED:
            acc_u = acc_u * tl.load(ws_base + (offs_nw + N) * stride_wsn)[None, :]
    return acc_g, acc_u


@triton.jit
def _k_loop_dense(
    a_op,
    w_op,
    scales,
    row_ok,
    expert,
    BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    GATED: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    w_desc=None,
    desc_row=0,
    first_col=0,
    TILE_W_SCALE: tl.constexpr = False,
):
    """The K loop of one tile of ``expert`` with dense (or fp8) weights: ``(acc_g, acc_u)``, fp32 [BLOCK_M,
    BLOCK_N] (the lengths of ``rows`` and ``offs_nw``), scaled back from fp8 by ``QUANT``.

    Operands (tuples of runtime values; ``*_e`` strides step from one expert to the next):

    - ``a_op = (a_ptr, stride_ae, rows, stride_am, stride_ak)``: activation row i of the expert starts at
      ``a_ptr + expert * stride_ae + rows[i] * stride_am`` (``rows`` int64 [BLOCK_M]; ``stride_ae`` 0 when the
      rows index one shared matrix); rows outside ``row_ok`` load as 0, so their accumulators are 0.
    - ``w_op = (w_ptr, stride_we, offs_nw, N, K, stride_wn, stride_wk)``: column j reads the expert's weight row
      ``offs_nw[j]`` (int64 [BLOCK_N], in [0, N)) and, when GATED, row ``offs_nw[j] + N`` for ``acc_u`` (else
      ``acc_u`` is zeros, unused).
    - ``scales = (a_scale_ptr, scale_rows, stride_asm, stride_ask, w_scale_ptr, stride_wse, stride_wsn,
      stride_wsk)``: the activation scale of row i at ``a_scale_ptr + scale_rows[i] * stride_asm`` (fp8_token,
      fp8_block; fp8_tensor reads ``a_scale_ptr[0]``), the expert's weight scales at ``w_scale_ptr + expert *
      stride_wse``. Unread when QUANT is 0.

    ``acc_g[i, j] = sum_k a[i, k] * w[offs_nw[j], k]`` over ``k < K``; ``EVEN_K``: K is a multiple of BLOCK_K, so
    the loads need no K mask.

    ``w_desc`` (None: pointer loads): a TMA descriptor of the weights flattened to ``[E * R, K]`` (R rows per
    expert) with block ``[BLOCK_N, BLOCK_K]``, from :func:`weight_descriptor`. The tile then reads the rows
    ``desc_row + j`` (``expert * R`` + the tile's first column) and ``+ N`` for up instead of ``offs_nw``:
    columns past N read other rows (or zeros past the end), which are computed and never stored, like the
    wrapped columns; K past the end loads as zeros.

    fp8_block (QUANT 3) scales each K tile's product by its group's scales before adding it to the accumulator.
    ``TILE_W_SCALE``: the gate columns ``first_col ..`` of the tile (and the up columns ``first_col + N ..``) share
    one weight scale per K group (BLOCK_N divides GROUP_N, and N is a multiple of it), so the two scales combine
    per row first and each product joins its accumulator in one multiply-add per element; both dots are issued
    before either is scaled, so the up dot runs on the tensor cores while the gate product is scaled.
    """
    a_ptr, stride_ae, rows, stride_am, stride_ak = a_op
    w_ptr, stride_we, offs_nw, N, K, stride_wn, stride_wk = w_op
    a_scale_ptr, scale_rows, stride_asm, stride_ask, w_scale_ptr, stride_wse, stride_wsn, stride_wsk = scales
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + expert.to(tl.int64) * stride_ae + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    g_ptrs = w_base + offs_nw[None, :] * stride_wn + offs_k[:, None] * stride_wk
    if GATED:
        u_ptrs = g_ptrs + N * stride_wn

    acc_g = tl.zeros([rows.shape[0], offs_nw.shape[0]], dtype=tl.float32)
    acc_u = tl.zeros([rows.shape[0], offs_nw.shape[0]], dtype=tl.float32)
    if QUANT == 3:
        as_ptrs = a_scale_ptr + scale_rows * stride_asm
        ws_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
        if TILE_W_SCALE:
            gs_ptrs = ws_base + (first_col // GROUP_N) * stride_wsn
            us_ptrs = ws_base + ((first_col + N) // GROUP_N) * stride_wsn
        else:
            gs_ptrs = ws_base + (offs_nw // GROUP_N) * stride_wsn
            if GATED:
                us_ptrs = ws_base + ((offs_nw + N) // GROUP_N) * stride_wsn

    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if w_desc is not None:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k < K - kt * BLOCK_K)[None, :], other=0.0)
            g = w_desc.load([desc_row, kt * BLOCK_K]).T
            if GATED:
                u = w_desc.load([desc_row + N, kt * BLOCK_K]).T
        elif EVEN_K:
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
        if QUANT == 3 and TILE_W_SCALE:
            kg = (kt * BLOCK_K) // GROUP_K
            a_s = tl.load(as_ptrs + kg * stride_ask, mask=row_ok, other=0.0)
            d_g = _block_dot(a, g)
            if GATED:
                d_u = _block_dot(a, u)
            acc_g = tl.fma(d_g, (a_s * tl.load(gs_ptrs + kg * stride_wsk))[:, None], acc_g)
            if GATED:
                acc_u = tl.fma(d_u, (a_s * tl.load(us_ptrs + kg * stride_wsk))[:, None], acc_u)
        elif QUANT == 3:
            kg = (kt * BLOCK_K) // GROUP_K
            a_s = tl.load(as_ptrs + kg * stride_ask, mask=row_ok, other=0.0)
            g_s = tl.load(gs_ptrs + kg * stride_wsk)
            if GATED:
                u_s = tl.load(us_ptrs + kg * stride_wsk)
            acc_g += _block_dot(a, g) * a_s[:, None] * g_s[None, :]
            if GATED:
                acc_u += _block_dot(a, u) * a_s[:, None] * u_s[None, :]
        else:
            acc_g = _mma(a, g, acc_g, IEEE)
            if GATED:
                acc_u = _mma(a, u, acc_u, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += BLOCK_K * stride_wk
        if GATED:
            u_ptrs += BLOCK_K * stride_wk

    return _scale_after_k(acc_g, acc_u, scales, row_ok, expert, offs_nw, N, QUANT, GATED, True)


@triton.jit
def _k_loop_fp8_weights_first(
    a_op,
    w_op,
    scales,
    row_ok,
    expert,
    BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    GATED: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """:func:`_k_loop_dense` for fp8 tiles of 16-32 token rows, weights first: ``acc^T += w @ a^T`` with the tile's
    weight rows in the wgmma's M (64 at least: fp8 tensor-core ops take no fewer rows) and its tokens in N. Token
    rows in M would need a 64-row tile mostly of padding, or Triton's fallback for fewer rows, which widens every
    fp8 operand to fp16 in registers (an F2FP per pair) and runs the older mma.sync.

    A GATED tile reads its gate and up rows as one [2 BLOCK_N, BLOCK_K] tile, ordered in blocks of 8 columns (the 8
    gate rows, then their 8 up rows): rows r and r + 8 of a wgmma accumulator sit in one thread, so splitting gate
    from up after the loop moves no data. fp8_block scales each K tile's product by its rows' weight scales and its
    tokens' activation scales before it joins the accumulator; the other modes scale once, after the loop."""
    a_ptr, stride_ae, rows, stride_am, stride_ak = a_op
    w_ptr, stride_we, offs_nw, N, K, stride_wn, stride_wk = w_op
    a_scale_ptr, scale_rows, stride_asm, stride_ask, w_scale_ptr, stride_wse, stride_wsn, stride_wsk = scales
    BLOCK_M: tl.constexpr = rows.shape[0]
    BLOCK_N: tl.constexpr = offs_nw.shape[0]
    if GATED:  # (block of 8 columns, gate/up, column in block)
        RB: tl.constexpr = BLOCK_N // 8
        halves = tl.reshape(tl.arange(0, 2) * N, [1, 2, 1])
        w_rows = tl.reshape(tl.reshape(offs_nw, [RB, 1, 8]) + halves, [2 * BLOCK_N])
    else:
        w_rows = offs_nw
    W_ROWS: tl.constexpr = w_rows.shape[0]
    offs_k = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    a_ptrs = a_ptr + e64 * stride_ae + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + e64 * stride_we + w_rows[:, None] * stride_wn + offs_k[None, :] * stride_wk
    ws_base = w_scale_ptr + e64 * stride_wse
    acc = tl.zeros([W_ROWS, BLOCK_M], dtype=tl.float32)
    if QUANT == 3:
        as_ptrs = a_scale_ptr + scale_rows * stride_asm
        ws_ptrs = ws_base + (w_rows // GROUP_N) * stride_wsn
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        if QUANT == 3:
            kg = (kt * BLOCK_K) // GROUP_K
            a_s = tl.load(as_ptrs + kg * stride_ask, mask=row_ok, other=0.0)
            w_s = tl.load(ws_ptrs + kg * stride_wsk)
            acc = tl.fma(_block_dot(w, a.trans()), w_s[:, None] * a_s[None, :], acc)
        else:
            acc = tl.dot(w, a.trans(), acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if QUANT == 1:
        acc = acc * (tl.load(ws_base) * tl.load(a_scale_ptr))
    elif QUANT == 2:
        a_s = tl.load(a_scale_ptr + scale_rows * stride_asm, mask=row_ok, other=0.0)
        acc = acc * tl.load(ws_base + w_rows * stride_wsn)[:, None] * a_s[None, :]
    # (one return: Triton checks every return of a function against the others, constexpr branches included)
    if GATED:
        t = tl.permute(tl.reshape(acc, [BLOCK_N // 8, 2, 8, BLOCK_M]), (0, 2, 3, 1))
        acc_g, acc_u = tl.split(tl.reshape(t, [BLOCK_N, BLOCK_M, 2]))
    else:
        acc_g, acc_u = acc, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    return acc_g.trans(), acc_u.trans()


@triton.jit
def _k_loop_gate_up(
    a_op,
    w_op,
    scales,
    row_ok,
    expert,
    BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    w_desc=None,
    desc_row=0,
):
    """:func:`_k_loop_dense` of a gated tile (QUANT 0, 1 or 2, or 3 under ``TILE_W_SCALE``) as one dot per K tile:
    the gate and up rows of the tile's columns read as one [BLOCK_K, 2 * BLOCK_N] weight tile, interleaved (column
    2j is gate row ``offs_nw[j]``, 2j + 1 up row ``offs_nw[j] + N``), into one [BLOCK_M, 2 * BLOCK_N] accumulator
    (fp8_block: a fresh product per K tile, see below). A dot twice as
    wide reads the A tile once per K tile instead of twice, and the interleaving puts each gate value and its up
    value in the same thread, so the split after the loop moves no data.

    ``w_desc`` (None: pointer loads): a 4-D TMA descriptor of the weights viewed as [E, N, 2, K] (gate row j and
    up row j adjacent; :func:`weight_descriptor` with ``interleave``), block [1, BLOCK_N, 2, BLOCK_K], read at
    ``[expert, desc_row, 0, k]`` (``desc_row``: the tile's first column); columns past N load as zeros.

    fp8_block (the tile's gate columns and its up columns each in one weight scale group): each K tile's product
    splits into gate and up in registers and joins each accumulator in one multiply-add per element, by the row's
    activation scale times the group's weight scale."""
    a_ptr, stride_ae, rows, stride_am, stride_ak = a_op
    w_ptr, stride_we, offs_nw, N, K, stride_wn, stride_wk = w_op
    a_scale_ptr, scale_rows, stride_asm, stride_ask, w_scale_ptr, stride_wse, stride_wsn, stride_wsk = scales
    BLOCK_N: tl.constexpr = offs_nw.shape[0]
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + expert.to(tl.int64) * stride_ae + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_rows = tl.reshape(tl.join(offs_nw, offs_nw + N), [2 * BLOCK_N])
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + w_rows[None, :] * stride_wn + offs_k[:, None] * stride_wk
    if QUANT == 3:
        acc_g = tl.zeros([rows.shape[0], BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([rows.shape[0], BLOCK_N], dtype=tl.float32)
        as_ptrs = a_scale_ptr + scale_rows * stride_asm
        ws_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
        gs_ptr = ws_base + (desc_row // GROUP_N) * stride_wsn
        us_ptr = ws_base + ((desc_row + N) // GROUP_N) * stride_wsn
    else:
        acc = tl.zeros([rows.shape[0], 2 * BLOCK_N], dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k < K - kt * BLOCK_K)[None, :], other=0.0)
        if w_desc is not None:
            w = tl.reshape(w_desc.load([expert, desc_row, 0, kt * BLOCK_K]), [2 * BLOCK_N, BLOCK_K]).T
        elif EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=(offs_k < K - kt * BLOCK_K)[:, None], other=0.0)
        if QUANT == 3:
            kg = (kt * BLOCK_K) // GROUP_K
            a_s = tl.load(as_ptrs + kg * stride_ask, mask=row_ok, other=0.0)
            d_g, d_u = tl.split(tl.reshape(_block_dot(a, w), [rows.shape[0], BLOCK_N, 2]))
            acc_g = tl.fma(d_g, (a_s * tl.load(gs_ptr + kg * stride_wsk))[:, None], acc_g)
            acc_u = tl.fma(d_u, (a_s * tl.load(us_ptr + kg * stride_wsk))[:, None], acc_u)
        else:
            acc = _mma(a, w, acc, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if QUANT != 3:
        acc_g, acc_u = tl.split(tl.reshape(acc, [rows.shape[0], BLOCK_N, 2]))
    return _scale_after_k(acc_g, acc_u, scales, row_ok, expert, offs_nw, N, QUANT, True, True)


@triton.jit
def epilogue(
    acc_g,
    acc_u,
    row_ok,
    expert,
    weights,
    bias,
    out,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    OUT_FP8: tl.constexpr = 0,
    OUT_GROUP: tl.constexpr = 128,
    out_scale=None,
):
    """Finish a tile of :func:`k_loop` and store it.

    - ``weights = (topk_w_ptr, slot)``: router weight of row i at ``topk_w_ptr + slot[i]``; applied before the
      bias when WEIGHT_ON_INPUT (it scales the input row), after the activation when MUL_WEIGHT (the output row).
      Unread (may be None) when both are off.
    - ``bias = (bias_ptr, stride_be, offs_nw, N, stride_bn)``: the expert's bias at ``bias_ptr + expert *
      stride_be``; its entries ``offs_nw`` are added to ``acc_g`` and, when GATED, ``offs_nw + N`` to ``acc_u``.
      Unread (may be None) without HAS_BIAS.
    - ``out = (out_ptr, stride_oe, out_rows, stride_om, offs_n, stride_on, n_ok)``: stores
      ``out_ptr[expert * stride_oe + out_rows[i] * stride_om + offs_n[j] * stride_on]`` for ``row_ok[i]`` and
      ``n_ok[j]``, in ``out_ptr``'s element type (``stride_oe`` 0 when the rows index one shared matrix).

    GATED stores ``activation(gate, up)`` (``ACTIVATION``: a code of :data:`ACTIVATION_CODES`), else ``acc_g``.

    ``OUT_FP8`` (1; 2 rounds to e4m3 in float32 first, for the CPU interpreter's conversion): the result is
    quantized to fp8 from its float32 value, one scale per row and OUT_GROUP columns (BLOCK_N a multiple of
    OUT_GROUP), by the rule of :mod:`fusedmoe.ops.quantize`; ``out_scale = (scale_ptr, stride_sm, stride_sk)``
    receives each row's scale of group g at ``scale_ptr + out_rows[i] * stride_sm + g * stride_sk``.
    """
    if WEIGHT_ON_INPUT:
        topk_w_ptr, slot = weights
        wt = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0)
        acc_g = acc_g * wt[:, None]
        if GATED:
            acc_u = acc_u * wt[:, None]
    if HAS_BIAS:
        bias_ptr, stride_be, offs_nw, N, stride_bn = bias
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        acc_g += tl.load(b_base + offs_nw * stride_bn).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_base + (offs_nw + N) * stride_bn).to(tl.float32)[None, :]
    if GATED:
        res = _activate(acc_g, acc_u, ACTIVATION)
    else:
        res = acc_g
    if MUL_WEIGHT:
        topk_w_ptr, slot = weights
        res = res * tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0)[:, None]
    out_ptr, stride_oe, out_rows, stride_om, offs_n, stride_on, n_ok = out
    o_ptrs = out_ptr + expert.to(tl.int64) * stride_oe + out_rows.to(tl.int64)[:, None] * stride_om
    o_ptrs += offs_n[None, :] * stride_on
    if OUT_FP8:
        res = _quantize_groups(
            res, row_ok, out_rows, offs_n, n_ok, out_scale, out_ptr.dtype.element_ty, OUT_GROUP, OUT_FP8 == 2
        )
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _quantize_groups(
    res, row_ok, out_rows, offs_n, n_ok, out_scale, q_dtype, G: tl.constexpr, ROUND_IN_FP32: tl.constexpr
):
    """fp8 values [BLOCK_M, BLOCK_N] of float32 ``res``, quantized per row and G-column group (columns past N,
    ``n_ok`` false, count as 0), each group's scale stored through ``out_scale`` (see :func:`epilogue`)."""
    BM: tl.constexpr = res.shape[0]
    BN: tl.constexpr = res.shape[1]
    scale_ptr, stride_sm, stride_sk = out_scale
    groups = tl.reshape(tl.where(n_ok[None, :], res, 0.0), [BM, BN // G, G])
    scale = _fp8_scale(tl.max(tl.abs(groups), axis=2))
    q = tl.reshape(_to_fp8(groups, scale[:, :, None], q_dtype, ROUND_IN_FP32), [BM, BN])
    group_ids = tl.max(tl.reshape(offs_n // G, [BN // G, G]), axis=1)
    group_ok = tl.max(tl.reshape(n_ok.to(tl.int32), [BN // G, G]), axis=1) > 0
    s_ptrs = scale_ptr + out_rows.to(tl.int64)[:, None] * stride_sm + group_ids[None, :] * stride_sk
    tl.store(s_ptrs, scale, mask=row_ok[:, None] & group_ok[None, :])
    return q


# ---- host side --------------------------------------------------------------------------------------------------
class Numerics(NamedTuple):
    """How a GEMM's operands are stored and multiplied: ``mode`` (None, or a key of :data:`QUANT_CODES`) with its
    fp8 scales ``a_scale`` / ``w_scale`` and scale groups ``block_shape = (gn, gk)``, and ``fp32_ieee`` (IEEE
    instead of TF32 dots for float32 operands). The default is unquantized, TF32."""

    mode: str | None = None
    a_scale: torch.Tensor | None = None
    w_scale: torch.Tensor | None = None
    block_shape: tuple[int, int] = (128, 128)
    fp32_ieee: bool = False


def check_operands(a: torch.Tensor, w: torch.Tensor, num: Numerics, config: GemmConfig) -> None:
    """The dtype and scale rules of every expert GEMM: a known mode; fp8: both scales given and e4m3 operands;
    mxfp4: float activations, uint8 weights and e8m0 (uint8) weight scales [E, N, K / 32], BLOCK_K a multiple of
    32; else one dtype; fp8_block: BLOCK_K divides the K scale group. fp8 weights under float activations
    (weight-only, no a_scale) only with BLOCK_M < 16, the multiply-add K loop's tiles."""
    mode = num.mode
    if mode not in QUANT_CODES:
        raise ValueError(f"unknown quant_mode {mode!r}")
    if mode == "mxfp4_mma":
        _check_mma_operands(a, w, num, config)
        return
    if mode == "mxfp4":
        if w.dtype != torch.uint8 or num.w_scale is None or num.w_scale.dtype != torch.uint8:
            raise TypeError("mxfp4: weights and w_scale must be uint8 (packed e2m1 pairs, e8m0 exponents)")
        if num.a_scale is not None or not a.dtype.is_floating_point or a.dtype == torch.float8_e4m3fn:
            raise TypeError(f"mxfp4 takes unquantized activations (bf16/fp16/fp32) and no a_scale, got {a.dtype}")
        K = weight_k(w, num)
        if tuple(num.w_scale.shape) != (*w.shape[:-1], K // MXFP4_GROUP) or K % MXFP4_GROUP:
            raise ValueError(
                f"mxfp4: w_scale must be {[*w.shape[:-1], K // MXFP4_GROUP]} for weights {list(w.shape)} "
                f"(K = {K}, a multiple of {MXFP4_GROUP}), got {list(num.w_scale.shape)}"
            )
        if config.block_k % MXFP4_GROUP:
            raise ValueError(f"mxfp4: BLOCK_K must be a multiple of {MXFP4_GROUP}, got {config.block_k}")
        if w.stride(-1) != 1 or any(st % 4 for st in w.stride()[:-1]) or w.data_ptr() % 4:
            # the one-row K loop reads the bytes as aligned 32-bit words (_k_loop_mxfp4_row)
            raise ValueError(
                f"mxfp4: the packed weights must be contiguous along K with rows 4-byte aligned "
                f"(strides {tuple(w.stride())}; w.contiguous() gives that)"
            )
        return
    if mode is not None and weight_only_fp8(a, config):
        if num.a_scale is not None or num.w_scale is None or w.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{mode} weight-only (float activations): float8_e4m3fn weights, w_scale, no a_scale")
    elif mode is not None:
        if num.a_scale is None or num.w_scale is None:
            raise ValueError(f"{mode} needs a_scale and w_scale")
        if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{mode}: activations and weights must be float8_e4m3fn")
    elif a.dtype != w.dtype:
        raise TypeError(f"activation dtype {a.dtype} != weight dtype {w.dtype}")
    gk = num.block_shape[1]
    if mode == "fp8_block" and gk % config.block_k:
        raise ValueError(f"fp8_block: BLOCK_K {config.block_k} must divide the scale group {gk}")


def _check_mma_operands(a: torch.Tensor, w: torch.Tensor, num: Numerics, config: GemmConfig) -> None:
    """mma-layout MXFP4 (:mod:`fusedmoe.mxfp4_layout`): float activations, uint8 values [E, R, 8 Kp] and scale
    bytes [E, R, Kp / 2] with K-contiguous rows, tiles of at least 16 rows, BLOCK_N a multiple of 16 and BLOCK_K
    of 64."""
    s = num.w_scale
    if w.dtype != torch.uint8 or s is None or s.dtype != torch.uint8:
        raise TypeError("mxfp4_mma: weights and w_scale must be uint8 (mma-layout values and scale bytes)")
    if num.a_scale is not None or not a.dtype.is_floating_point or a.dtype == torch.float8_e4m3fn:
        raise TypeError(f"mxfp4_mma takes unquantized activations (bf16/fp16/fp32) and no a_scale, got {a.dtype}")
    if w.dim() != 3 or w.shape[-1] % 512 or tuple(s.shape) != (*w.shape[:2], w.shape[-1] // 16):
        raise ValueError(
            f"mxfp4_mma: values must be [E, R, 8 Kp] and w_scale [E, R, Kp/2], got {list(w.shape)}, {list(s.shape)}"
        )
    if w.stride(-1) != 1 or s.stride(-1) != 1 or w.data_ptr() % 4 or any(st % 4 for st in w.stride()[:-1]):
        raise ValueError("mxfp4_mma: values and scales must be contiguous along K, values in aligned 32-bit words")
    if config.block_m < MIN_DOT_BLOCK_M or config.block_n % 16 or config.block_k % 64:
        raise ValueError(
            f"mxfp4_mma needs BLOCK_M >= {MIN_DOT_BLOCK_M}, BLOCK_N a multiple of 16 and BLOCK_K of 64, got "
            f"{config.block_m}x{config.block_n}x{config.block_k}"
        )


def weights_first_fp8(mode: str | None, config: GemmConfig, gated: bool) -> bool:
    """Whether an fp8 GEMM's tensor-core tiles run :func:`_k_loop_fp8_weights_first`: 16 to 32 token rows (too
    few for a 64-row wgmma, so the tokens go in its N) and at least 64 weight rows (GEMM1: gate and up rows)."""
    rows = config.block_n * (2 if gated else 1)
    return mode in ("fp8_tensor", "fp8_token", "fp8_block") and MIN_DOT_BLOCK_M <= config.block_m < 64 and rows >= 64


def weight_only_fp8(a: torch.Tensor, config: GemmConfig) -> bool:
    """Whether an fp8 GEMM of activations ``a`` under ``config`` runs weight-only (w8a16): float activations,
    which only the multiply-add K loop (BLOCK_M < 16) takes unquantized."""
    return a.dtype != torch.float8_e4m3fn and config.block_m < MIN_DOT_BLOCK_M


def weight_k(w: torch.Tensor, num: Numerics) -> int:
    """The reduction length of expert weights ``w`` [..., N, K] (MXFP4 packs two elements per byte: 2 x the last
    dimension)."""
    return w.shape[-1] * (2 if num.mode == "mxfp4" else 1)


def scale_ptrs(num: Numerics, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a_scale, w_scale) kernel arguments: the scales, or ``dummy`` (never read) where there are none."""
    return (num.a_scale if num.a_scale is not None else dummy, num.w_scale if num.w_scale is not None else dummy)


def scale_strides(num: Numerics) -> tuple[int, int, int, int, int]:
    """(stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk) for the scale layouts of each mode."""
    a_scale, w_scale = num.a_scale, num.w_scale
    if num.mode is None:
        return 0, 0, 0, 0, 0
    if num.mode == "fp8_tensor":
        return 0, 0, w_scale.stride(0), 0, 0
    a_rows, a_cols = (0, 0) if a_scale is None else (a_scale.stride(0), a_scale.stride(-1))  # None: weight-only
    if num.mode == "fp8_token":
        return a_rows, 0, w_scale.stride(0), w_scale.stride(1), 0
    if num.mode in ("mxfp4", "mxfp4_mma"):
        return 0, 0, w_scale.stride(0), w_scale.stride(1), w_scale.stride(2)
    return a_rows, a_cols, w_scale.stride(0), w_scale.stride(1), w_scale.stride(2)


def weight_descriptor(w: torch.Tensor, config: GemmConfig, num: Numerics, interleave: bool = False):
    """The TMA descriptor :func:`_k_loop_dense` reads ``w`` [E, R, K] through when ``config.tma`` asks for one:
    ``w`` flattened to [E * R, K], block [BLOCK_N, BLOCK_K]; with ``interleave`` (a gated ``w``, R = 2N, read by
    :func:`_k_loop_gate_up`) ``w`` viewed as [E, N, 2, K] (gate row j, then up row j), block [1, BLOCK_N, 2,
    BLOCK_K]. None (pointer loads) for the tiles that do not take one (MXFP4, fewer than 16 rows) and where the
    hardware's rules are not met: K contiguous, experts packed back to back, a 16-byte aligned base and row
    stride, a K block of at least 16 bytes."""
    if not config.tma or num.mode in ("mxfp4", "mxfp4_mma") or config.block_m < MIN_DOT_BLOCK_M or w.dim() != 3:
        return None
    E, R, K = w.shape
    size = w.element_size()
    if (
        w.stride(2) != 1
        or (E > 1 and w.stride(0) != R * w.stride(1))
        or w.data_ptr() % 16
        or (w.stride(1) * size) % 16
        or config.block_k * size < 16
    ):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    if interleave:
        N = R // 2
        shape, strides = [E, N, 2, K], [R * w.stride(1), w.stride(1), N * w.stride(1), 1]
        return TensorDescriptor(w, shape, strides, [1, config.block_n, 2, config.block_k])
    flat = w.as_strided((E * R, K), (w.stride(1), 1))
    return TensorDescriptor(flat, [E * R, K], [w.stride(1), 1], [config.block_n, config.block_k])


def mxfp4_quant_code(dtype: torch.dtype) -> int:
    """The kernel code of MXFP4 weights with ``dtype`` activations: 5 (``tl.dot_scaled``) for bf16 on the GPU,
    else 4 (register decode: float32 and fp16, which Triton 3.6's ``dot_scaled`` does not compile; the CPU
    interpreter, which has no ``dot_scaled``; or ``FUSEDMOE_MXFP4_DOT=decode``). Tiles of fewer than 16 rows
    decode and multiply-add under either code (:func:`k_loop`)."""
    if dtype != torch.bfloat16 or os.environ.get("TRITON_INTERPRET") == "1":
        return QUANT_CODES["mxfp4"]
    return QUANT_CODES["mxfp4"] if os.environ.get(ENV_MXFP4_DOT) == "decode" else MXFP4_SCALED_DOT


def _quant_code(mode: str | None, dtype: torch.dtype) -> int:
    if mode == "mxfp4":
        return mxfp4_quant_code(dtype)
    return mma_quant_code() if mode == "mxfp4_mma" else QUANT_CODES[mode]


def mma_quant_code() -> int:
    """The kernel code of mma-layout MXFP4: the PTX decode on a GPU, the portable one under the CPU interpreter."""
    return MXFP4_MMA_PORTABLE if os.environ.get("TRITON_INTERPRET") == "1" else QUANT_CODES["mxfp4_mma"]


def tile_meta(config: GemmConfig, num: Numerics, dtype: torch.dtype, K: int, activation: str | None) -> dict:
    """The constexprs and launch options every expert GEMM takes: tiles and launch settings of ``config``,
    quantization of ``num``, IEEE dots (``dtype``: the activations'), ``EVEN_K`` (``K``: the reduction length),
    and GATED with its activation code (``activation`` None: not gated, GEMM2)."""
    return {
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "QUANT": _quant_code(num.mode, dtype),
        "GROUP_N": num.block_shape[0],
        "GROUP_K": num.block_shape[1],
        "GATED": activation is not None,
        "ACTIVATION": ACTIVATION_CODES[activation] if activation is not None else 0,
        "IEEE": num.fp32_ieee and dtype == torch.float32,
        "EVEN_K": K % config.block_k == 0,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }
