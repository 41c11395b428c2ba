"""Decode fast path: two launches, no alignment, no top-k reduce kernel, for a handful of (token, slot) pairs.

At decode (M·k up to ~16) the standard path spends a third of its launches on bookkeeping: sorting slots by
expert and reducing the k expert outputs of each token. Here:

- ``_decode_gemm1``: one program per (slot, tile of I): the slot's token row times the gate and up rows of
  its expert (a GEMV over H in fp32), activation in the epilogue, written to ``act`` [M·k, I]. Slots of
  non-local or out-of-range ids are skipped (their ``act`` rows are never read).
- ``_decode_gemm2``: one program per (token, tile of H): for each of the token's k slots with a local expert,
  ``w · act[slot] @ w2[e]ᵀ`` accumulated in fp32 registers, then stored once to the output row — the top-k
  reduce happens in registers, so neither the [M·k, H] buffer nor a reduce launch exists. A token with no
  local slot gets an exact zero row.

Every weight byte is read once per slot; slots of one token that share an expert cannot happen (top-k picks
distinct experts), and across tokens the duplicates are few at this size. Grids are sized so the 132 SMs of
an H200 all stream weights (e.g. M=1, k=8, I=768: 8 x 48 programs for GEMM1, 128 for GEMM2 with 16-wide
tiles).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._util import cdiv, next_pow2
from .align import _local_expert
from .grouped_gemm import _activate
from .launcher import launch

_ACTIVATIONS = {"silu": 0, "gelu": 1}

#: The decode path serves calls with at most this many (token, slot) pairs.
MAX_DECODE_SLOTS = 16
#: Opt-in until measured faster than the aligned path on the target GPU: FUSEDMOE_DECODE_PATH=1.
ENABLED = os.environ.get("FUSEDMOE_DECODE_PATH", "0") == "1"


@triton.jit
def _decode_gemm1(
    x_ptr,
    w1_ptr,
    act_ptr,
    ids_ptr,
    map_ptr,
    topk_w_ptr,
    top_k,
    global_E,
    E,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_am,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_MAP: tl.constexpr,
    ACTIVATION: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr,
):
    slot = tl.program_id(0)
    expert = _local_expert(tl.load(ids_ptr + slot), map_ptr, global_E, E, HAS_MAP)
    if expert < 0:
        return
    token = slot // top_k
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w1_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    x_row = x_ptr + token.to(tl.int64) * stride_xm
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        xv = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        mask = n_ok[:, None] & k_ok[None, :]
        g = tl.load(w_rows + k0 + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(w_rows + N * stride_wn + k0 + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        acc_g += tl.sum(g * xv[None, :], axis=1)
        acc_u += tl.sum(u * xv[None, :], axis=1)
    if WEIGHT_ON_INPUT:
        wt = tl.load(topk_w_ptr + slot).to(tl.float32)
        acc_g = acc_g * wt
        acc_u = acc_u * wt
    h = _activate(acc_g, acc_u, ACTIVATION)
    tl.store(act_ptr + slot.to(tl.int64) * stride_am + offs_n, h.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _decode_gemm2(
    act_ptr,
    w2_ptr,
    out_ptr,
    ids_ptr,
    map_ptr,
    topk_w_ptr,
    top_k,
    global_E,
    E,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_MAP: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
):
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, top_k):
        slot = token * top_k + j
        expert = _local_expert(tl.load(ids_ptr + slot), map_ptr, global_E, E, HAS_MAP)
        if expert >= 0:
            w_rows = w2_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
            a_row = act_ptr + slot.to(tl.int64) * stride_am
            part = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = offs_k < K - k0
                av = tl.load(a_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                w = tl.load(w_rows + k0 + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                part += tl.sum(w.to(tl.float32) * av[None, :], axis=1)
            if MUL_WEIGHT:
                part = part * tl.load(topk_w_ptr + slot).to(tl.float32)
            acc += part
    tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def decode_supported(n_slots: int, quant_mode: str | None, activation: str, has_bias: bool) -> bool:
    return 0 < n_slots <= MAX_DECODE_SLOTS and quant_mode is None and activation in _ACTIVATIONS and not has_bias


def moe_decode(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    act: torch.Tensor,
    *,
    expert_map: torch.Tensor | None,
    global_num_experts: int,
    activation: str,
    apply_router_weight_on_input: bool,
    block_n1: int = 16,
    block_n2: int = 16,
    block_k: int = 256,
) -> None:
    """The whole expert computation for a few tokens in two launches; writes ``out`` [M, H].

    Args: x [M, H]; w1 [E, 2I, H]; w2 [E, H, I] (same dtype as x); topk_weights float [M, k] (contiguous);
    topk_ids int32/int64 [M, k] (contiguous); ``act``: scratch [M·k, I] in x's dtype (from the plan; only
    rows of local slots are written and read).
    """
    M, H = x.shape
    k = topk_ids.shape[1]
    E, two_i, _ = w1.shape
    inter = two_i // 2
    if M == 0:
        return
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1)
    emap = expert_map if expert_map is not None else ids
    launch(
        _decode_gemm1,
        (M * k, cdiv(inter, block_n1)),
        x,
        w1,
        act,
        ids,
        emap,
        weights,
        k,
        global_num_experts,
        E,
        inter,
        H,
        x.stride(0),
        w1.stride(0),
        w1.stride(1),
        act.stride(0),
        BLOCK_N=block_n1,
        BLOCK_K=min(block_k, next_pow2(H)),
        HAS_MAP=expert_map is not None,
        ACTIVATION=_ACTIVATIONS[activation],
        WEIGHT_ON_INPUT=apply_router_weight_on_input,
        num_warps=4,
    )
    launch(
        _decode_gemm2,
        (M, cdiv(H, block_n2)),
        act,
        w2,
        out,
        ids,
        emap,
        weights,
        k,
        global_num_experts,
        E,
        H,
        inter,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        BLOCK_N=block_n2,
        BLOCK_K=min(block_k, next_pow2(inter)),
        HAS_MAP=expert_map is not None,
        MUL_WEIGHT=not apply_router_weight_on_input,
        num_warps=4,
    )
