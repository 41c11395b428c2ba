"""Grouped GEMMs over expert-aligned blocks (the output of :func:`fusedmoe.ops.align.moe_align`).

- :func:`moe_gemm1`: ``act[slot, n] = act_fn(x[slot // k] @ w1[e, n].T) * (x[slot // k] @ w1[e, I + n].T)``.
  Each program owns one BLOCK_M block of sorted slots and one BLOCK_N tile of I and keeps a gate and an up
  accumulator, so the [M*k, 2I] GEMM1 output never exists in memory.
- :func:`moe_gemm2`: ``y[slot, :] = (act[slot] @ w2[e].T) * topk_weight[slot]`` (weight unless applied on input).

Both launch one kernel, ``_moe_gemm`` (``GATED`` tells them apart; compiled, they are named ``_moe_gemm1`` and
``_moe_gemm2``, which is what profilers show), built from the parts in :mod:`fusedmoe.ops.expert_gemm`.

Optional expert biases (``HAS_BIAS``, a constexpr: without bias the kernels compile exactly as before): GEMM1 adds
``b1[e, n]`` / ``b1[e, I + n]`` to the gate / up accumulators before the activation; GEMM2 adds ``b2[e, :]``
before the routing weight multiplies the row.

Programs whose block has expert -1 (past ``num_padded``) exit at once; non-local slots sit in no block, so
their ``act`` / ``y`` rows are never written (the top-k reduce skips them by the same rule). Rows of a valid
block whose sorted id is the sentinel are masked on load and store. Pointer offsets are int64.

fp8 (e4m3, w8a8) scales by ``numerics.mode`` (:class:`fusedmoe.ops.expert_gemm.Numerics`): ``fp8_tensor``
a_scale [1], w_scale [E]; ``fp8_token`` a_scale [rows, 1], w_scale [E, N]; ``fp8_block`` a_scale
[rows, cdiv(K, gk)], w_scale [E, cdiv(N, gn), cdiv(K, gk)] (``block_shape = (gn, gk)``), where rows are the
activation rows (tokens for GEMM1, slots for GEMM2) and N the weight rows (2I for GEMM1, H for GEMM2).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..mxfp4_layout import padded_k
from ._util import cdiv
from .configs import GemmConfig
from .expert_gemm import (
    MIN_DOT_BLOCK_M,
    Numerics,
    check_operands,
    columns,
    epilogue,
    k_loop,
    scale_ptrs,
    scale_strides,
    tile_meta,
    weight_descriptor,
    weight_k,
    weights_first_fp8,
)
from .launcher import launch


@triton.jit
def _tile_ids(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering of tile ``pid``: GROUP_M consecutive M blocks sweep the N tiles together (weight reuse
    in L2)."""
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


def _gemm_name(spec) -> str:
    """Compiled name of ``_moe_gemm``: ``_moe_gemm1`` (gated, GEMM1) or ``_moe_gemm2``."""
    return "_moe_gemm1" if spec.constants["GATED"] else "_moe_gemm2"


# n_slots and num_pid_m change with every token count; specializing on them (== 1, % 16) would compile up to
# nine variants of each config across M for no benefit (they only bound masks and the tile order).
@triton.jit(do_not_specialize=["n_slots", "num_pid_m"], repr=_gemm_name)
def _moe_gemm(
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
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
    A_SORTED: tl.constexpr = False,
    preact_ptr=None,
    stride_pm=0,
    STORE_PREACT: tl.constexpr = False,
    w_desc=None,
    NUM_SMS: tl.constexpr = 0,
    PERSISTENT: tl.constexpr = 0,
    INTERLEAVE: tl.constexpr = False,
    TILE_W_SCALE: tl.constexpr = False,
    WEIGHTS_FIRST: tl.constexpr = False,
    out_scale_ptr=None,
    stride_osm=0,
    stride_osk=0,
    OUT_FP8: tl.constexpr = 0,
):
    """Output rows are slots; activation (and activation-scale) rows are ``slot // top_k``: tokens for GEMM1,
    the slots themselves for GEMM2 (top_k = 1), or with ``A_SORTED`` the aligned positions themselves.
    ``w_desc``: the weights' TMA descriptor (``GemmConfig.tma``), else None (pointer loads).

    ``NUM_SMS`` 0: one program per tile. Else persistent: NUM_SMS programs walk the tiles of the valid blocks
    (a prefix of ``block_expert``: the blocks past ``num_padded`` hold -1), ``PERSISTENT`` 2 with the tile loop
    flattened into the K loop (the next tile's loads overlap this one's epilogue), 3 also warp-specialized.
    ``INTERLEAVE`` (GEMM1, ``GemmConfig.interleave``): gate and up as one dot (``expert_gemm._k_loop_gate_up``).
    ``OUT_FP8`` (fp8_block GEMM1): the output is stored as fp8 with one scale per row and GROUP_K columns, written
    to ``out_scale_ptr`` (``expert_gemm.epilogue``)."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # the runtime arguments a tile reads besides its coordinates, handed to _gemm_tile as one tuple
    args = (
        a_ptr,
        w_ptr,
        out_ptr,
        sorted_ptr,
        topk_w_ptr,
        a_scale_ptr,
        w_scale_ptr,
        bias_ptr,
        preact_ptr,
        w_desc,
        n_slots,
        N,
        K,
        top_k,
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
        stride_pm,
        (out_scale_ptr, stride_osm, stride_osk),
    )
    if NUM_SMS == 0:
        pid_m, pid_n = _tile_ids(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        _gemm_tile(
            pid_m,
            pid_n,
            expert,
            args,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            QUANT,
            GROUP_N,
            GROUP_K,
            GATED,
            ACTIVATION,
            WEIGHT_ON_INPUT,
            MUL_WEIGHT,
            IEEE,
            EVEN_K,
            HAS_BIAS,
            A_SORTED,
            STORE_PREACT,
            INTERLEAVE,
            TILE_W_SCALE,
            WEIGHTS_FIRST,
            OUT_FP8,
        )
    else:
        valid_m = _valid_blocks(block_expert_ptr, num_pid_m)
        for tile in tl.range(
            tl.program_id(0), valid_m * num_pid_n, NUM_SMS, flatten=PERSISTENT >= 2, warp_specialize=PERSISTENT == 3
        ):
            pid_m, pid_n = _tile_ids(tile, valid_m, num_pid_n, GROUP_M)
            expert = tl.load(block_expert_ptr + pid_m)
            _gemm_tile(
                pid_m,
                pid_n,
                expert,
                args,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                QUANT,
                GROUP_N,
                GROUP_K,
                GATED,
                ACTIVATION,
                WEIGHT_ON_INPUT,
                MUL_WEIGHT,
                IEEE,
                EVEN_K,
                HAS_BIAS,
                A_SORTED,
                STORE_PREACT,
                INTERLEAVE,
                TILE_W_SCALE,
                WEIGHTS_FIRST,
                OUT_FP8,
            )


@triton.jit
def _valid_blocks(block_expert_ptr, num_blocks):
    """How many leading entries of ``block_expert`` [num_blocks] are experts (>= 0)."""
    count = 0
    for i in range(0, num_blocks, 1024):
        offs = i + tl.arange(0, 1024)
        e = tl.load(block_expert_ptr + offs, mask=offs < num_blocks, other=-1)
        count += tl.sum((e >= 0).to(tl.int32), axis=0)
    return count


@triton.jit
def _gemm_tile(
    pid_m,
    pid_n,
    expert,
    args,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    A_SORTED: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    TILE_W_SCALE: tl.constexpr,
    WEIGHTS_FIRST: tl.constexpr,
    OUT_FP8: tl.constexpr,
):
    """One output tile of :func:`_moe_gemm`: BLOCK_M aligned slots of ``expert`` x BLOCK_N columns; ``args`` are
    the kernel's runtime arguments in the order :func:`_moe_gemm` packs them."""
    (
        a_ptr,
        w_ptr,
        out_ptr,
        sorted_ptr,
        topk_w_ptr,
        a_scale_ptr,
        w_scale_ptr,
        bias_ptr,
        preact_ptr,
        w_desc,
        n_slots,
        N,
        K,
        top_k,
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
        stride_pm,
        out_scale,
    ) = args
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ptr + offs_m)
    row_ok = slot < n_slots
    if A_SORTED:
        rows = offs_m.to(tl.int64)
    else:
        rows = tl.where(row_ok, slot // top_k, 0).to(tl.int64)
    offs_n, n_ok, offs_nw = columns(pid_n, N, BLOCK_N)
    a_op = (a_ptr, 0, rows, stride_am, stride_ak)
    w_op = (w_ptr, stride_we, offs_nw, N, K, stride_wn, stride_wk)
    scales = (a_scale_ptr, rows, stride_asm, stride_ask, w_scale_ptr, stride_wse, stride_wsn, stride_wsk)
    # read with w_desc only: the tile's first weight row of the flattened [E * R, K] descriptor, or its first
    # column of the interleaved [E, N, 2, K] one (and of the mma-layout MXFP4 weights, QUANT 6 and 7)
    if INTERLEAVE or QUANT == 6 or QUANT == 7:
        desc_row = pid_n * BLOCK_N
    else:
        desc_row = (expert * (stride_we // stride_wn) + pid_n * BLOCK_N).to(tl.int32)
    acc_g, acc_u = k_loop(
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
        INTERLEAVE,
        pid_n * BLOCK_N,
        TILE_W_SCALE,
        WEIGHTS_FIRST,
    )
    if STORE_PREACT:  # GEMM1's raw accumulators (before weight, bias, activation), saved for the backward
        pre_ptrs = preact_ptr + tl.where(row_ok, slot, 0).to(tl.int64)[:, None] * stride_pm + offs_n[None, :]
        pre_mask = row_ok[:, None] & n_ok[None, :]
        tl.store(pre_ptrs, acc_g.to(preact_ptr.dtype.element_ty), mask=pre_mask)
        tl.store(pre_ptrs + N, acc_u.to(preact_ptr.dtype.element_ty), mask=pre_mask)
    bias = (bias_ptr, stride_be, offs_nw, N, stride_bn)
    out = (out_ptr, 0, slot, stride_om, offs_n, stride_on, n_ok)
    weights = (topk_w_ptr, slot)
    epilogue(
        acc_g,
        acc_u,
        row_ok,
        expert,
        weights,
        bias,
        out,
        GATED,
        ACTIVATION,
        WEIGHT_ON_INPUT,
        HAS_BIAS,
        MUL_WEIGHT,
        OUT_FP8,
        GROUP_K,
        out_scale,
    )


# ---- wrappers ---------------------------------------------------------------------------------------------------
@functools.cache
def _sm_count(device: torch.device) -> int:
    """Programs of a persistent launch: the GPU's SMs (3 under the CPU interpreter, so that programs take several
    tiles each)."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def grid_blocks(n_slots: int, max_blocks: int) -> int:
    """Static bound on the number of non-empty blocks: each holds >= 1 slot, and there are max_blocks."""
    return min(n_slots, max_blocks)


def _bias_strides(bias):
    return (0, 0) if bias is None else (bias.stride(0), bias.stride(1))


def _check_bias(bias, shape):
    if bias is not None and tuple(bias.shape) != shape:
        raise ValueError(f"bias must have shape {list(shape)}, got {list(bias.shape)}")


def _fp8_output(scale: torch.Tensor) -> dict:
    """The keywords of a GEMM1 launch that quantizes its output to fp8 with scales ``scale`` [n_slots, groups]."""
    rounding = 2 if scale.device.type == "cpu" else 1  # rounded in float32 first, as quantize_activation does there
    return {"out_scale_ptr": scale, "stride_osm": scale.stride(0), "stride_osk": scale.stride(1), "OUT_FP8": rounding}


def tile_weight_scale(config: GemmConfig, num: Numerics, N: int) -> bool:
    """Whether each fp8_block tensor-core tile's gate columns (and up columns, N further on) lie in one weight scale
    group: BLOCK_N divides the group's rows and N is a multiple of them (``expert_gemm._k_loop_dense``)."""
    gn = num.block_shape[0]
    return num.mode == "fp8_block" and config.block_m >= MIN_DOT_BLOCK_M and gn % config.block_n == 0 and N % gn == 0


def fp8_output_fits(config: GemmConfig, group_k: int) -> bool:
    """Whether GEMM1 tiles of ``config`` can quantize their own output in ``group_k``-column groups: tensor-core
    tiles (at least 16 rows) whose BLOCK_N holds whole groups."""
    return config.block_m >= MIN_DOT_BLOCK_M and config.block_n % group_k == 0


def _check_fp8_output(out, out_scale, config: GemmConfig, num: Numerics, I: int) -> None:
    gk = num.block_shape[1]
    if num.mode != "fp8_block" or not fp8_output_fits(config, gk):
        raise ValueError(
            f"out_scale: fp8 output needs fp8_block numerics and tiles of >= {MIN_DOT_BLOCK_M} rows with BLOCK_N a "
            f"multiple of {gk}, got mode {num.mode!r}, tiles {config.block_m}x{config.block_n}"
        )
    if out.dtype != torch.float8_e4m3fn or out_scale.dtype != torch.float32:
        raise TypeError(
            f"out_scale: out must be float8_e4m3fn and out_scale float32, got {out.dtype}, {out_scale.dtype}"
        )
    if tuple(out_scale.shape) != (out.shape[0], cdiv(I, gk)):
        raise ValueError(f"out_scale must be {[out.shape[0], cdiv(I, gk)]}, got {list(out_scale.shape)}")


def _check(a, w, sorted_ids, block_expert, config, num: Numerics) -> None:
    check_operands(a, w, num, config)
    if sorted_ids.dtype != torch.int32 or block_expert.dtype != torch.int32:
        raise TypeError("sorted_ids and block_expert must be int32")


def _launch(
    a,
    w,
    out,
    sorted_ids,
    block_expert,
    N,
    K,
    top_k,
    num_blocks,
    config,
    activation,
    topk_weights,
    bias,
    num,
    a_sorted,
    preact=None,
    out_scale=None,
):
    """One ``_moe_gemm`` launch writing ``out`` [n_slots, N]: GEMM1 when ``activation`` is given (gated: ``w``
    holds gate rows then up rows; ``topk_weights`` scale the input rows), else GEMM2 (``topk_weights`` scale
    the output rows). Activation rows are ``slot // top_k``, or the aligned positions when ``a_sorted``."""
    grid = (num_blocks * cdiv(N, config.block_n),)
    if num_blocks == 0 or N == 0:
        return out
    persistent = {}
    if config.persistent:
        sms = _sm_count(a.device)
        grid = (min(grid[0], sms),)
        persistent = {"NUM_SMS": sms, "PERSISTENT": config.persistent}
    weighted = topk_weights is not None
    tile_scale = tile_weight_scale(config, num, N)
    interleave = config.interleave and activation is not None and config.block_m >= MIN_DOT_BLOCK_M
    interleave = interleave and (num.mode in (None, "fp8_tensor", "fp8_token") or tile_scale)
    launch(
        _moe_gemm,
        grid,
        a,
        w,
        out,
        sorted_ids,
        block_expert,
        topk_weights if weighted else a,
        *scale_ptrs(num, a),
        bias if bias is not None else a,
        out.shape[0],
        N,
        K,
        top_k,
        num_blocks,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        *scale_strides(num),
        *_bias_strides(bias),
        GROUP_M=config.group_m,
        WEIGHT_ON_INPUT=weighted and activation is not None,
        MUL_WEIGHT=weighted and activation is None,
        HAS_BIAS=bias is not None,
        A_SORTED=a_sorted,
        **({} if preact is None else {"preact_ptr": preact, "stride_pm": preact.stride(0), "STORE_PREACT": True}),
        **({"w_desc": desc} if (desc := weight_descriptor(w, config, num, interleave)) is not None else {}),
        **({"INTERLEAVE": True} if interleave else {}),
        **({"TILE_W_SCALE": True} if tile_scale else {}),
        **({"WEIGHTS_FIRST": True} if weights_first_fp8(num.mode, config, activation is not None) else {}),
        **({} if out_scale is None else _fp8_output(out_scale)),
        **persistent,
        **tile_meta(config, num, a.dtype, K, activation),
    )
    return out


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
    numerics: Numerics = Numerics(),
    bias: torch.Tensor | None = None,
    preact: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """GEMM1 with the gated activation fused; writes ``out`` rows of the slots in valid blocks.

    Args:
        a: [M, H] activations (fp32/fp16/bf16, or e4m3 when quantized); row of slot s is s // top_k.
        w1: [E, 2I, H] (gate rows then up rows), same dtype as ``a`` (e4m3 when quantized).
        out: [M*top_k, I] activation output (slot-indexed), any float dtype.
        sorted_ids, block_expert: from :func:`moe_align` with BLOCK_M == config.block_m.
        num_blocks: M blocks to launch (:func:`grid_blocks`).
        topk_weights: float32 [M, top_k]; if given, scales each slot's accumulators (router weight on input).
        numerics: quantization (fp8 scales: see the module docstring for shapes per mode) and fp32 dot precision.
        bias: [E, 2I] (gate then up), added to the accumulators before the activation.
        preact: [M*top_k, 2I] (slot-indexed, contiguous rows); when given, also receives the raw accumulators
            ``a @ w1[e].T`` (gate columns, then up), before the weight, the bias and the activation (training
            saves them for the backward). Unquantized calls only.
        out_scale: float32 [M*top_k, ceil(I / gk)] (``gk = numerics.block_shape[1]``); when given (fp8_block
            only, tiles of at least 16 rows with BLOCK_N a multiple of gk), ``out`` is float8_e4m3fn and receives
            the activation quantized from its float32 value, one scale per slot and gk columns written here: GEMM2's
            fp8_block input, with no separate quantization pass.
    """
    _check(a, w1, sorted_ids, block_expert, config, numerics)
    if preact is not None and (
        numerics.mode is not None or preact.shape != (out.shape[0], w1.shape[1]) or preact.stride(-1) != 1
    ):
        raise ValueError(f"preact must be a row-contiguous [{out.shape[0]}, {w1.shape[1]}] of an unquantized call")
    E, two_i = w1.shape[:2]
    H, I = weight_k(w1, numerics), two_i // 2
    if numerics.mode == "mxfp4_mma":  # [E, 2I / 16, 8 Kp]: padded K; the output gives I
        H, I, two_i = a.shape[-1], out.shape[-1], 2 * out.shape[-1]
        if w1.shape[1] * 16 != two_i or w1.shape[2] != 8 * padded_k(H):
            raise ValueError(f"mxfp4_mma: w1 {tuple(w1.shape)} is not the layout of a [{two_i}, {H}] weight")
    if two_i != 2 * I or a.shape[-1] != H or out.shape[-1] != I or out.shape[0] != a.shape[0] * top_k:
        raise ValueError(f"shape mismatch: a {tuple(a.shape)}, w1 {tuple(w1.shape)}, out {tuple(out.shape)}")
    _check_bias(bias, (E, two_i))
    if out_scale is not None:
        _check_fp8_output(out, out_scale, config, numerics, I)
    return _launch(
        a,
        w1,
        out,
        sorted_ids,
        block_expert,
        I,
        H,
        top_k,
        num_blocks,
        config,
        activation,
        topk_weights,
        bias,
        numerics,
        a_sorted=False,
        preact=preact,
        out_scale=out_scale,
    )


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
    numerics: Numerics = Numerics(),
    bias: torch.Tensor | None = None,
    a_sorted: bool = False,
) -> torch.Tensor:
    """GEMM2: ``out[slot] = a[slot] @ w2[e].T`` (x topk_weights[slot] when given) for slots in valid blocks.

    Args:
        a: [M*k, I] slot-indexed activations (e4m3 when quantized), or with ``a_sorted`` one row per aligned
            position (row ``i`` belongs to ``sorted_ids[i]``; at least ``len(sorted_ids)`` rows). w2: [E, H, I].
        out: [M*k, H] slot-indexed output, any float dtype.
        topk_weights: float32 [M, k] (flat index = slot) or None (weights applied on input).
        numerics: as for :func:`moe_gemm1`.
        bias: [E, H], added before the routing weight.
    """
    _check(a, w2, sorted_ids, block_expert, config, numerics)
    E, H = w2.shape[:2]
    I = weight_k(w2, numerics)
    if numerics.mode == "mxfp4_mma":  # [E, H / 16, 8 Kp]: padded K; the output and activations give H and I
        H, I = out.shape[-1], a.shape[-1]
        if w2.shape[1] * 16 != H or w2.shape[2] != 8 * padded_k(I):
            raise ValueError(f"mxfp4_mma: w2 {tuple(w2.shape)} is not the layout of a [{H}, {I}] weight")
    rows = sorted_ids.shape[0] if a_sorted else out.shape[0]
    if a.shape[-1] != I or out.shape[-1] != H or (a.shape[0] < rows if a_sorted else a.shape[0] != rows):
        raise ValueError(f"shape mismatch: a {tuple(a.shape)}, w2 {tuple(w2.shape)}, out {tuple(out.shape)}")
    _check_bias(bias, (E, H))
    # activation rows are the slots themselves: top_k = 1
    return _launch(
        a, w2, out, sorted_ids, block_expert, H, I, 1, num_blocks, config, None, topk_weights, bias, numerics, a_sorted
    )


__all__ = ["grid_blocks", "moe_gemm1", "moe_gemm2"]
