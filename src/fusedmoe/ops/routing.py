"""Routing in one Triton launch: scores, optional group limit, top-k, renormalization, scaling.

The torch version (``fusedmoe.routing.route``) takes 4-8 kernels (softmax, topk, sum, div, casts); at decode
each costs a launch, which is a large share of a ~30 us layer. This kernel does the whole thing per block of
rows, with the same rules:

- ``scoring`` 0 = softmax over E, 1 = sigmoid, 2 = softmax over the chosen k logits (gpt-oss);
- selection uses ``score + correction_bias`` (when given); weights use the unbiased score;
- groups (``num_groups > 1``): a group's rank is the sum of its top-2 selection scores when scoring is sigmoid
  or a bias is given, else its best score; experts outside the ``topk_groups`` best groups are masked out;
- top-k by repeated arg-max (ties go to the lower expert id), then renormalize (sum of the k weights) and
  multiply by ``routed_scaling_factor``.

Outputs: ``topk_weights`` float32 [M, k], ``topk_ids`` int32 [M, k]; every row < M is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SCORING = {"softmax": 0, "sigmoid": 1, "softmax_topk": 2}


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr,
    M, E, stride_lm, scale,
    K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr,
    SCORING: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, GROUP_RANK_TOP2: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < M
    col_ok = cols < E
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_lm + cols[None, :]
    x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=float("-inf")).to(tl.float32)
    neg_inf = float("-inf")

    if SCORING == 0:
        x_max = tl.max(x, axis=1)
        ex = tl.exp(x - x_max[:, None])
        ex = tl.where(col_ok[None, :], ex, 0.0)
        score = ex / tl.sum(ex, axis=1)[:, None]
    elif SCORING == 1:
        score = tl.sigmoid(x)
    else:
        score = x
    choose = score
    if HAS_BIAS:
        choose = choose + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
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

    kcols = tl.arange(0, K_PAD)
    weights = tl.zeros([ROWS, K_PAD], dtype=tl.float32)
    ids = tl.zeros([ROWS, K_PAD], dtype=tl.int32)
    for j in tl.static_range(K):
        idx = tl.argmax(choose, axis=1, tie_break_left=True).to(tl.int32)
        idx = tl.minimum(idx, E - 1)  # a row of NaN/-inf must still yield an in-range id
        sel = cols[None, :] == idx[:, None]
        val = tl.sum(tl.where(sel, score, 0.0), axis=1)
        weights = tl.where(kcols[None, :] == j, val[:, None], weights)
        ids = tl.where(kcols[None, :] == j, idx[:, None], ids)
        choose = tl.where(sel, neg_inf, choose)

    k_ok = kcols < K
    if SCORING == 2:
        wmax = tl.max(tl.where(k_ok[None, :], weights, neg_inf), axis=1)
        ew = tl.where(k_ok[None, :], tl.exp(weights - wmax[:, None]), 0.0)
        weights = ew / tl.sum(ew, axis=1)[:, None]
    elif RENORM:  # + 1e-20 as fusedmoe.routing: k scores that all underflow give 0, not NaN
        weights = weights / (tl.sum(tl.where(k_ok[None, :], weights, 0.0), axis=1)[:, None] + 1e-20)
    weights = weights * scale

    out = rows.to(tl.int64)[:, None] * K + kcols[None, :]
    mask = row_ok[:, None] & k_ok[None, :]
    tl.store(w_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def kernel_supports(E: int, top_k: int, num_expert_groups: int | None) -> bool:
    """Shapes the fused kernel handles (otherwise route() uses torch ops)."""
    if E > 1024 or top_k > 32:
        return False
    if num_expert_groups is not None and num_expert_groups > 1:
        e_pad = triton.next_power_of_2(E)
        return e_pad == E and E % num_expert_groups == 0 and (num_expert_groups & (num_expert_groups - 1)) == 0
    return True


def route_fused(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str,
    renormalize: bool,
    num_expert_groups: int | None,
    topk_groups: int | None,
    correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated arguments in, (topk_weights float32 [M, k], topk_ids int32 [M, k]) out; one launch."""
    M, E = router_logits.shape
    dev = router_logits.device
    weights = torch.empty((M, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((M, top_k), dtype=torch.int32, device=dev)
    if M == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    e_pad = triton.next_power_of_2(E)
    rows = max(1, min(8, 1024 // e_pad))  # a [rows, E] tile per program, reduced within one warp
    groups = num_expert_groups if (num_expert_groups or 1) > 1 else 1
    _route_kernel[(triton.cdiv(M, rows),)](
        logits, correction_bias if correction_bias is not None else logits, weights, ids,
        M, E, logits.stride(0), float(routed_scaling_factor),
        K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, ROWS=rows,
        SCORING=_SCORING[scoring], RENORM=bool(renormalize), HAS_BIAS=correction_bias is not None,
        GROUPS=groups, TOPK_GROUPS=topk_groups or 1,
        GROUP_RANK_TOP2=scoring == "sigmoid" or correction_bias is not None,
        num_warps=1 if rows * e_pad <= 1024 else 4,
    )
    return weights, ids
