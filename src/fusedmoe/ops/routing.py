"""Routing in one Triton launch: scores, optional group limit, top-k, renormalization, scaling.

The torch version (``fusedmoe.routing.route``) takes 4-8 kernels (softmax, topk, sum, div, casts); at decode
each costs a launch, which is a large share of a ~30 us layer. This kernel does the whole thing per block of
rows, with the same rules:

- ``scoring`` 0 = softmax over E, 1 = sigmoid, 2 = softmax over the chosen k logits (gpt-oss);
- selection uses ``score + correction_bias`` (when given); weights use the unbiased score;
- groups (``num_groups > 1``): a group's rank is the sum of its top-2 selection scores when scoring is sigmoid
  or a bias is given, else its best score; experts outside the ``topk_groups`` best groups are masked out;
- top-k by k int64 max-reductions over keys that pack the order-preserving bits of the score with the expert
  id (ties go to the lower id; the score comes back with the id), then renormalize (sum of the k weights)
  and multiply by ``routed_scaling_factor``. Softmax without a bias ranks by the logits themselves (same
  order) and exponentiates only the k winners (plus one sum over E when not renormalizing).

Non-finite logits follow :mod:`fusedmoe.routing`'s rule: NaN is read as -inf, +inf as the largest finite
float32, and a row without a logit above -inf gets ids ``0..k-1`` with weight 0.

Outputs: ``topk_weights`` float32 [M, k], ``topk_ids`` int32 [M, k]; every row < M is written.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._util import cdiv, next_pow2
from .launcher import launch

_SCORING = {"softmax": 0, "sigmoid": 1, "softmax_topk": 2}


@triton.jit
def _ordered(x):
    """float32 -> int32 whose signed order is the float order (NaN above +inf, as torch.topk ranks it)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _unordered(o):
    return tl.where(o < 0, o ^ 0x7FFFFFFF, o).to(tl.float32, bitcast=True)


@triton.jit
def _positive(d):
    """A denominator that is 1 where it would be 0 (rows whose numerators are all 0 then give 0, not NaN)."""
    return tl.where(d > 0, d, 1.0)


@triton.jit
def _router_logits(x_ptr, gate_ptr, gate_bias_ptr, rows, cols, row_ok, col_ok, H, stride_xm, stride_ge,
                   BLOCK_H: tl.constexpr, HAS_GATE_BIAS: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """``F.linear(x, gate, gate_bias)`` of the tile's rows in float32 [ROWS, E_PAD], rounded to x's dtype as that
    call's output is (float32 accumulation, the bias added before the rounding); rows or columns outside
    ``row_ok`` / ``col_ok`` are -inf."""
    offs_h = tl.arange(0, BLOCK_H)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_h[None, :]
    g_ptrs = gate_ptr + cols.to(tl.int64)[None, :] * stride_ge + offs_h[:, None]
    acc = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h_ok = offs_h < H - h0
        xa = tl.load(x_ptrs, mask=row_ok[:, None] & h_ok[None, :], other=0.0)
        ga = tl.load(g_ptrs, mask=h_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xa, ga, acc, input_precision="ieee")
        else:
            acc = tl.dot(xa, ga, acc)
        x_ptrs += BLOCK_H
        g_ptrs += BLOCK_H
    if HAS_GATE_BIAS:
        acc += tl.load(gate_bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    return tl.where(row_ok[:, None] & col_ok[None, :], logits, float("-inf"))


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    w_ptr,
    ids_ptr,
    M,
    E,
    stride_lm,
    scale,
    x_ptr,
    gate_ptr,
    gate_bias_ptr,
    H,
    stride_xm,
    stride_ge,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    SCORING: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    GROUP_RANK_TOP2: tl.constexpr,
    GEMM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_GATE_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < M
    col_ok = cols < E
    if GEMM:
        x = _router_logits(x_ptr, gate_ptr, gate_bias_ptr, rows, cols, row_ok, col_ok, H, stride_xm, stride_ge,
                           BLOCK_H, HAS_GATE_BIAS, IEEE)  # fmt: skip
    else:
        ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_lm + cols[None, :]
        x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=float("-inf")).to(tl.float32)
    neg_inf = float("-inf")
    x = tl.minimum(tl.where(x != x, neg_inf, x), 3.4028234663852886e38)  # NaN -> -inf, +inf -> float32 max
    x_max = tl.max(x, axis=1)
    dead = x_max == neg_inf  # nothing to choose: ids 0..k-1 with weight 0
    x_max = tl.where(dead, 0.0, x_max)

    # ``choose`` ranks experts; ``value`` is what a chosen expert's weight is made of. Without a bias, softmax
    # ranks like its logits (same denominator per row), so the full softmax is only needed with a bias.
    if SCORING == 1:
        value = tl.sigmoid(x)
    else:
        value = x
    if HAS_BIAS:
        if SCORING == 0:
            ex = tl.where(col_ok[None, :], tl.exp(x - x_max[:, None]), 0.0)
            score = ex / _positive(tl.sum(ex, axis=1))[:, None]
        else:
            score = value
        choose = score + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    else:
        choose = value
    choose = tl.where(col_ok[None, :], choose, neg_inf)

    if GROUPS > 1:
        PER: tl.constexpr = E_PAD // GROUPS
        cg = tl.reshape(choose, [ROWS, GROUPS, PER])
        top1 = tl.max(cg, axis=2)
        if GROUP_RANK_TOP2 and PER > 1:
            first = tl.argmax(cg, axis=2, tie_break_left=True)
            sub = tl.arange(0, PER)
            rest = tl.where(sub[None, None, :] == first[:, :, None], neg_inf, cg)
            rank = top1 + tl.max(rest, axis=2)
        else:
            rank = top1
        gids = tl.arange(0, GROUPS)
        keep = tl.zeros([ROWS, GROUPS], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            g = tl.argmax(rank, axis=1, tie_break_left=True)
            hit = gids[None, :] == g[:, None]
            keep = keep | hit
            rank = tl.where(hit, neg_inf, rank)
        keep_e = tl.reshape(tl.broadcast_to(keep[:, :, None], [ROWS, GROUPS, PER]), [ROWS, E_PAD])
        choose = tl.where(keep_e, choose, neg_inf)

    # One int64 max per pick: the ordered score in the high word, (E_PAD - 1 - id) in the low word, so the
    # lower id wins a tie and the score comes back with the id.
    key = (_ordered(choose).to(tl.int64) << 32) | (E_PAD - 1 - cols).to(tl.int64)[None, :]
    low_mask = 0xFFFFFFFF
    kcols = tl.arange(0, K_PAD)
    picked = tl.zeros([ROWS, K_PAD], dtype=tl.float32)
    ids = tl.zeros([ROWS, K_PAD], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(key, axis=1)
        idx = (E_PAD - 1 - (best & low_mask)).to(tl.int32)
        idx = tl.minimum(tl.maximum(idx, 0), E - 1)  # a row of NaN must still yield an in-range id
        sel = cols[None, :] == idx[:, None]
        if HAS_BIAS:
            val = tl.sum(tl.where(sel, value, 0.0), axis=1)
        else:
            val = _unordered((best >> 32).to(tl.int32))
        picked = tl.where(kcols[None, :] == j, val[:, None], picked)
        ids = tl.where(kcols[None, :] == j, idx[:, None], ids)
        key = tl.where(sel, -9223372036854775807 - 1, key)

    k_ok = kcols < K
    if SCORING == 1:
        weights = picked
    elif SCORING == 0:
        weights = tl.exp(picked - x_max[:, None])
        if not RENORM:
            ex_all = tl.where(col_ok[None, :], tl.exp(x - x_max[:, None]), 0.0)
            weights = weights / _positive(tl.sum(ex_all, axis=1))[:, None]
    else:
        top = tl.max(tl.where(k_ok[None, :], picked, neg_inf), axis=1)
        weights = tl.exp(picked - tl.where(dead, 0.0, top)[:, None])
    weights = tl.where(k_ok[None, :], weights, 0.0)
    if SCORING == 2:
        weights = weights / _positive(tl.sum(weights, axis=1))[:, None]
    elif RENORM:  # + 1e-20 as fusedmoe.routing: k scores that all underflow give 0, not NaN
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = tl.where(dead[:, None], 0.0, weights * scale)
    ids = tl.where(dead[:, None], kcols[None, :], ids)

    out = rows.to(tl.int64)[:, None] * K + kcols[None, :]
    mask = row_ok[:, None] & k_ok[None, :]
    tl.store(w_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def _rows_from_env(name: str, default: int) -> int:
    """The row count the environment variable ``name`` sets, ``default`` when it is unset; a value that is not a
    whole number raises ValueError naming the variable."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{name} must be a whole number of rows (0 turns the fused router GEMM off), got {raw!r}"
        ) from None


#: Launch shape (rows per program, warps); None = automatic. Module attributes so benchmarks can sweep them.
ROUTE_ROWS: int | None = None
ROUTE_WARPS: int | None = None

#: The most rows for which the routing launch also computes the router logits (:func:`router_gemm_applies`). One
#: program per 16 rows reads the whole gate, so the launch takes ~4-6 us more GPU time than routing from given
#: logits (one SM streams the gate where cuBLAS spreads it), and the layer saves ``F.linear``'s torch op and launch:
#: ~20-30 us of host time per call at every M measured up to 256 (BENCHMARKS.md, "Host time per call"). A model
#: run eagerly at these sizes is bound by the host, so the fused GEMM is the default there; callers who capture eager
#: layers in their own CUDA graphs, where only GPU time counts, set ``FUSEDMOE_ROUTER_GEMM_MAX_M=0`` (read at
#: import). The compiled path (the registered op) routes outside the kernel and is not affected.
ROUTER_GEMM_MAX_M = _rows_from_env("FUSEDMOE_ROUTER_GEMM_MAX_M", 256)
#: The largest gate matrix (bytes) the routing launch reads for its logits: one program streams all of it, at a
#: single SM's read rate (~0.15-0.2 TB/s), where cuBLAS spreads it over many; 512 KiB is qwen3-30b-a3b's
#: (128 x 2048 bf16), DeepSeek-V3's (256 x 7168) is 7x that.
ROUTER_GEMM_MAX_BYTES = 1 << 19
#: Rows per program of the fused router GEMM (the tensor cores' smallest M).
_GEMM_ROWS = 16
_GEMM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kernel_supports(E: int, top_k: int, num_expert_groups: int | None) -> bool:
    """Shapes the fused kernel handles (otherwise route() uses torch ops)."""
    if E > 1024 or top_k > 32:
        return False
    if num_expert_groups is not None and num_expert_groups > 1:
        e_pad = next_pow2(E)
        return e_pad == E and E % num_expert_groups == 0 and (num_expert_groups & (num_expert_groups - 1)) == 0
    return True


def router_gemm_applies(M: int, E: int, H: int, num_expert_groups: int | None, dtype: torch.dtype) -> bool:
    """Whether :func:`route_fused` computes ``F.linear(hidden, gate, gate_bias)`` itself for ``M`` rows of
    ``dtype`` and a gate [E, H] (the settings already pass :func:`kernel_supports`): up to
    :data:`ROUTER_GEMM_MAX_M` rows, a gate of up to :data:`ROUTER_GEMM_MAX_BYTES`, up to 256 experts (the logits
    of a 16-row tile stay in registers), and a grouped router only with at least 16 experts (the tile pads the
    experts to 16 columns, which would move group boundaries)."""
    grouped = (num_expert_groups or 1) > 1
    if dtype not in _GEMM_DTYPES or M > ROUTER_GEMM_MAX_M or E > 256 or (grouped and E < 16):
        return False
    return E * H * dtype.itemsize <= ROUTER_GEMM_MAX_BYTES


def route_fused(
    router_logits: torch.Tensor | None,
    top_k: int,
    *,
    scoring: str,
    renormalize: bool,
    num_expert_groups: int | None,
    topk_groups: int | None,
    correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
    weights: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    gate_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated arguments in, (topk_weights float32 [M, k], topk_ids int32 [M, k]) out; one launch.

    ``router_logits`` [M, E], or None with ``hidden`` [M, H] (rows contiguous), ``gate`` [E, H] contiguous of
    hidden's dtype and ``gate_bias`` [E] or None: the launch then computes the logits ``F.linear(hidden, gate,
    gate_bias)`` first (for shapes :func:`router_gemm_applies` accepts), rounded to hidden's dtype as that call
    returns them. ``weights`` / ``ids``: contiguous outputs to write (allocated when None)."""
    gemm = router_logits is None
    M, E = (hidden.shape[0], gate.shape[0]) if gemm else router_logits.shape
    dev = hidden.device if gemm else router_logits.device
    if weights is None:
        weights = torch.empty((M, top_k), dtype=torch.float32, device=dev)
    if ids is None:
        ids = torch.empty((M, top_k), dtype=torch.int32, device=dev)
    if M == 0:
        return weights, ids
    groups = num_expert_groups if (num_expert_groups or 1) > 1 else 1
    if gemm:
        logits = hidden  # unread: the kernel reads hidden and gate instead
        e_pad, rows = max(16, next_pow2(E)), _GEMM_ROWS
        H = hidden.shape[1]
        block_h = min(128 if e_pad <= 128 else 64, max(16, next_pow2(H)))
        gemm_args = (hidden, gate, gate_bias if gate_bias is not None else gate, H, hidden.stride(0), gate.stride(0))
    else:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        e_pad = next_pow2(E)
        rows = ROUTE_ROWS or max(1, min(4, 512 // e_pad))
        block_h = 16
        gemm_args = (logits, logits, logits, 0, 0, 0)
    launch(
        _route_kernel,
        (cdiv(M, rows),),
        logits,
        correction_bias if correction_bias is not None else logits,
        weights,
        ids,
        M,
        E,
        logits.stride(0),
        float(routed_scaling_factor),
        *gemm_args,
        K=top_k,
        K_PAD=next_pow2(top_k),
        E_PAD=e_pad,
        ROWS=rows,
        SCORING=_SCORING[scoring],
        RENORM=bool(renormalize),
        HAS_BIAS=correction_bias is not None,
        GROUPS=groups,
        TOPK_GROUPS=topk_groups or 1,
        GROUP_RANK_TOP2=scoring == "sigmoid" or correction_bias is not None,
        GEMM=gemm,
        BLOCK_H=block_h,
        HAS_GATE_BIAS=gemm and gate_bias is not None,
        IEEE=gemm and hidden.dtype == torch.float32,
        num_warps=ROUTE_WARPS or 4,
    )
    return weights, ids
