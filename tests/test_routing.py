"""Tests of fusedmoe.routing.route: hand-worked examples per scoring mode, the output contract on the CPU and on
CUDA (where route() takes the Triton kernel), cross-checks against the transformers routers, M = 0, meta
tensors (no value reads) and every validation error."""

from __future__ import annotations

import math

import pytest
import torch
from devices import DEVICES

from fusedmoe.routing import ROUTING_PRESETS, route

try:
    import transformers
except ImportError:  # pragma: no cover - the cross-checks need the [hf] extra
    transformers = None

needs_hf = pytest.mark.skipif(transformers is None, reason="needs transformers")

ln = math.log


def logit(p: float) -> float:
    """Inverse sigmoid: sigmoid(logit(p)) == p."""
    return ln(p / (1 - p))


def T(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def check(out, ids, weights, atol=1e-6):
    """Exact expected ids (in order) and weights; also the output contract (dtype, contiguity)."""
    w, i = out
    assert i.dtype == torch.int32 and w.dtype == torch.float32
    assert i.is_contiguous() and w.is_contiguous()
    assert i.tolist() == ids
    torch.testing.assert_close(w, torch.tensor(weights, dtype=torch.float32), atol=atol, rtol=0)


# ----------------------------------------------------------------------------------------------------
# Hand-worked examples
# ----------------------------------------------------------------------------------------------------

# log-probabilities (shifted by an arbitrary constant: softmax ignores it) so softmax(L) == P exactly.
P4 = [0.1, 0.4, 0.2, 0.3]
L4 = [ln(p) + 1.7 for p in P4]


def test_softmax_renormalize_qwen3_mixtral():
    # softmax = [.1, .4, .2, .3]; top-2 = experts 1 (.4), 3 (.3); renormalized: .4/.7 = 4/7, .3/.7 = 3/7.
    check(route(T(L4), 2), [[1, 3]], [[4 / 7, 3 / 7]])
    check(route(T(L4), 2, **ROUTING_PRESETS["qwen3-moe"]), [[1, 3]], [[4 / 7, 3 / 7]])
    check(route(T(L4), 2, **ROUTING_PRESETS["mixtral"]), [[1, 3]], [[4 / 7, 3 / 7]])
    # top-3 adds expert 2 (.2): .4/.9, .3/.9, .2/.9.
    check(route(T(L4), 3), [[1, 3, 2]], [[4 / 9, 3 / 9, 2 / 9]])
    # top-1 renormalized is always 1.
    check(route(T(L4), 1), [[1]], [[1.0]])


def test_softmax_no_renormalize_deepseek_v2_lite():
    # Same choice, raw softmax probabilities .4 and .3.
    check(route(T(L4), 2, renormalize=False), [[1, 3]], [[0.4, 0.3]])
    check(route(T(L4), 2, **ROUTING_PRESETS["deepseek-v2-lite"]), [[1, 3]], [[0.4, 0.3]])
    # routed_scaling_factor multiplies: 2 * [.4, .3].
    check(route(T(L4), 2, renormalize=False, routed_scaling_factor=2.0), [[1, 3]], [[0.8, 0.6]])
    # ... also after renormalization: 3 * [4/7, 3/7].
    check(route(T(L4), 2, routed_scaling_factor=3.0), [[1, 3]], [[12 / 7, 9 / 7]])


def test_softmax_rows_are_independent():
    # Two tokens: the second is the first reversed, so its choice is the mirror image.
    out = route(T(L4, L4[::-1]), 2, renormalize=False)
    check(out, [[1, 3], [2, 0]], [[0.4, 0.3], [0.4, 0.3]])


def test_sigmoid_no_groups():
    # sigmoid -> [.5, .75, .25, .9]; top-2 = 3 (.9), 1 (.75); renormalized .9/1.65 = 6/11, .75/1.65 = 5/11.
    L = [logit(p) for p in (0.5, 0.75, 0.25, 0.9)]
    check(route(T(L), 2, scoring="sigmoid"), [[3, 1]], [[6 / 11, 5 / 11]])
    check(route(T(L), 2, scoring="sigmoid", renormalize=False), [[3, 1]], [[0.9, 0.75]])
    check(route(T(L), 2, scoring="sigmoid", routed_scaling_factor=2.5), [[3, 1]], [[15 / 11, 12.5 / 11]])


# DeepSeek-V3-like example: E = 8 in G = 4 groups of 2 ({0,1}, {2,3}, {4,5}, {6,7}), keep TG = 2, k = 2.
P8 = [0.9, 0.25, 0.75, 0.1, 0.6, 0.4, 0.5, 0.2]
L8 = [logit(p) for p in P8]
V3_SMALL = dict(scoring="sigmoid", num_expert_groups=4, topk_groups=2)


def test_sigmoid_groups_mask_experts():
    # Without groups, top-2 = 0 (.9), 2 (.75).
    check(route(T(L8), 2, scoring="sigmoid", renormalize=False), [[0, 2]], [[0.9, 0.75]])
    # Group ranks (sum of top-2): g0 = 1.15, g1 = .85, g2 = 1.0, g3 = .7 -> keep g0, g2; expert 2 (.75) is in
    # the dropped g1, so the choice among {0: .9, 1: .25, 4: .6, 5: .4} is 0, 4: renormalized .9/1.5, .6/1.5.
    check(route(T(L8), 2, **V3_SMALL), [[0, 4]], [[0.6, 0.4]])
    check(route(T(L8), 2, **V3_SMALL, renormalize=False), [[0, 4]], [[0.9, 0.6]])
    # Keeping every group is the same as no groups.
    check(
        route(T(L8), 2, scoring="sigmoid", renormalize=False, num_expert_groups=4, topk_groups=4),
        [[0, 2]],
        [[0.9, 0.75]],
    )


def test_sigmoid_groups_bias_changes_choice_not_weights():
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 0.5, 0.1])
    # Biased scores: [.9, .25, .75, .1, .6, .4, 1.0, .3]; group ranks g0 = 1.15, g1 = .85, g2 = 1.0, g3 = 1.3
    # -> keep g3, g0 (the bias swapped g2 out for g3). Biased choice among {0: .9, 1: .25, 6: 1.0, 7: .3}:
    # 6 then 0. Weights are the UNBIASED sigmoids .5 and .9: renormalized 5/14, 9/14,
    # times 2.5 = 25/28, 45/28.
    out = route(T(L8), 2, **V3_SMALL, correction_bias=bias, routed_scaling_factor=2.5)
    check(out, [[6, 0]], [[25 / 28, 45 / 28]])
    check(route(T(L8), 2, **V3_SMALL, correction_bias=bias, renormalize=False), [[6, 0]], [[0.5, 0.9]])
    # A float64 bias is accepted and gives the same answer.
    out = route(T(L8), 2, **V3_SMALL, correction_bias=bias.double(), renormalize=False)
    check(out, [[6, 0]], [[0.5, 0.9]])


# E = 6 in G = 2 groups of 3, keep TG = 1, k = 2: separates the group-rank rules.
P6_SIG = [0.9, 0.6, 0.6, 0.8, 0.75, 0.1]


def test_sigmoid_group_rank_is_sum_of_top2():
    # g0 = {.9, .6, .6}: top-2 sum 1.5, max .9, sum 2.1.
    # g1 = {.8, .75, .1}: top-2 sum 1.55, max .8, sum 1.65.
    # Only "sum of top-2" keeps g1 -> experts 3, 4 with .8/1.55 = 16/31, .75/1.55 = 15/31.
    L = [logit(p) for p in P6_SIG]
    out = route(T(L), 2, scoring="sigmoid", num_expert_groups=2, topk_groups=1)
    check(out, [[3, 4]], [[16 / 31, 15 / 31]])


P6_SM = [0.3, 0.06, 0.04, 0.25, 0.2, 0.15]  # sums to 1
L6_SM = [ln(p) for p in P6_SM]
V2_SMALL = dict(scoring="softmax", renormalize=False, num_expert_groups=2, topk_groups=1)


def test_softmax_groups_rank_is_max_group_limited_greedy():
    # g0 = {.3, .06, .04}: max .3, top-2 sum .36.  g1 = {.25, .2, .15}: max .25, top-2 sum .45.
    # softmax without bias ranks by max -> keeps g0 -> experts 0, 1 with .3, .06 (times 16 = 4.8, .96).
    check(route(T(L6_SM), 2, **V2_SMALL), [[0, 1]], [[0.3, 0.06]])
    check(route(T(L6_SM), 2, **V2_SMALL, routed_scaling_factor=16.0), [[0, 1]], [[4.8, 0.96]], atol=2e-6)
    # Without groups: 0 (.3), 3 (.25).
    check(route(T(L6_SM), 2, renormalize=False), [[0, 3]], [[0.3, 0.25]])


def test_softmax_groups_with_bias_rank_is_sum_of_top2():
    # With a correction_bias (even a zero one) the rule is noaux_tc: g1 wins (.45 > .36) -> experts 3, 4.
    zero = torch.zeros(6)
    check(route(T(L6_SM), 2, **V2_SMALL, correction_bias=zero), [[3, 4]], [[0.25, 0.2]])
    # A bias on expert 2 (.04 + .4 = .44) makes g0's top-2 sum .74 > .45 -> g0; choice 2 (.44) then 0 (.3);
    # unbiased weights .04, .3, renormalized .04/.34 = 2/17, .3/.34 = 15/17.
    bias = torch.tensor([0, 0, 0.4, 0, 0, 0])
    out = route(T(L6_SM), 2, scoring="softmax", num_expert_groups=2, topk_groups=1, correction_bias=bias)
    check(out, [[2, 0]], [[2 / 17, 15 / 17]])


def test_softmax_bias_without_groups():
    # Biased [.35, .4, .2, .3] -> choose 1, 0; unbiased weights .4, .1 -> renormalized .8, .2.
    bias = torch.tensor([0.25, 0.0, 0.0, 0.0])
    check(route(T(L4), 2, correction_bias=bias), [[1, 0]], [[0.8, 0.2]])
    check(route(T(L4), 2, correction_bias=bias, renormalize=False), [[1, 0]], [[0.4, 0.1]])


def test_group_size_one():
    # G = E: every group is one expert, its rank its own score, so groups change nothing.
    L = [logit(p) for p in (0.5, 0.75, 0.25, 0.9)]
    check(route(T(L), 2, scoring="sigmoid", num_expert_groups=4, topk_groups=2), [[3, 1]], [[6 / 11, 5 / 11]])
    check(route(T(L4), 2, num_expert_groups=4, topk_groups=3, renormalize=False), [[1, 3]], [[0.4, 0.3]])


def test_softmax_topk_gpt_oss():
    # Logits ln[1, 4, 2, 3] - 7: top-2 = 1, 3; softmax over those two: 4/7, 3/7.
    L = [ln(v) - 7 for v in (1, 4, 2, 3)]
    check(route(T(L), 2, scoring="softmax_topk"), [[1, 3]], [[4 / 7, 3 / 7]])
    check(route(T(L), 2, **ROUTING_PRESETS["gpt-oss"]), [[1, 3]], [[4 / 7, 3 / 7]])
    check(route(T(L), 3, scoring="softmax_topk"), [[1, 3, 2]], [[4 / 9, 3 / 9, 2 / 9]])
    # renormalize has no effect (already sums to 1) -- unlike softmax, which would give 0.4, 0.3.
    check(route(T(L), 2, scoring="softmax_topk", renormalize=False), [[1, 3]], [[4 / 7, 3 / 7]])
    check(route(T(L), 2, scoring="softmax", renormalize=False), [[1, 3]], [[0.4, 0.3]])
    check(route(T(L), 2, scoring="softmax_topk", routed_scaling_factor=2.0), [[1, 3]], [[8 / 7, 6 / 7]])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "softmax_topk"])
def test_other_dtypes_computed_in_float32(dtype, scoring):
    x = torch.randn(33, 16).to(dtype)
    w, i = route(x, 4, scoring=scoring)
    w_ref, i_ref = route(x.float(), 4, scoring=scoring)
    assert w.dtype == torch.float32 and i.dtype == torch.int32
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)


def test_all_scores_underflow_gives_zero_not_nan():
    # sigmoid(-200) == 0 in float32: the renormalization must not divide 0 by 0.
    w, _ = route(torch.full((2, 4), -200.0), 2, scoring="sigmoid")
    assert torch.equal(w, torch.zeros(2, 2))


# ----------------------------------------------------------------------------------------------------
# General properties on random logits
# ----------------------------------------------------------------------------------------------------

ALL_MODES = [
    dict(scoring="softmax"),
    dict(scoring="softmax", renormalize=False, routed_scaling_factor=16.0, num_expert_groups=4, topk_groups=2),
    dict(scoring="softmax", num_expert_groups=4, topk_groups=2, correction_bias="rand"),
    dict(scoring="sigmoid"),
    dict(scoring="sigmoid", num_expert_groups=8, topk_groups=3, correction_bias="rand", routed_scaling_factor=2.5),
    dict(scoring="softmax_topk"),
]


def _materialize(kw, E, device="cpu"):
    kw = dict(kw)
    if kw.get("correction_bias") == "rand":
        kw["correction_bias"] = torch.rand(E, device=device) * 0.2
    return kw


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", ALL_MODES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_output_contract(kw, device):
    E, k = 32, 6
    x = torch.randn(57, E, device=device) * 3
    kw = _materialize(kw, E, device)
    w, i = route(x, k, **kw)
    assert w.shape == i.shape == (57, k)
    assert w.dtype == torch.float32 and i.dtype == torch.int32
    assert w.is_contiguous() and i.is_contiguous()
    assert w.device == i.device == x.device
    assert ((i >= 0) & (i < E)).all()
    assert (i.sort(dim=1).values.diff(dim=1) > 0).all(), "an expert chosen twice for one token"
    assert (w > 0).all()
    if kw.get("renormalize", True) or kw["scoring"] == "softmax_topk":
        sums = w.sum(dim=1)
        torch.testing.assert_close(sums, torch.full_like(sums, kw.get("routed_scaling_factor", 1.0)))
    if "num_expert_groups" in kw:  # every chosen expert lies in one of at most topk_groups groups
        groups = (i.long() // (E // kw["num_expert_groups"])).tolist()
        assert max(len(set(row)) for row in groups) <= kw["topk_groups"]


def _naive(logits, k, scoring, renormalize, G, TG, bias, scale):
    """Per-token, per-group Python reference of the documented rules (independent of the vectorized code)."""
    out_w, out_i = [], []
    for row in logits.double().tolist():
        E = len(row)
        if scoring == "softmax":
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            s = [v / sum(ex) for v in ex]
        else:
            s = [1 / (1 + math.exp(-v)) for v in row]
        c = [s[e] + (bias[e] if bias is not None else 0.0) for e in range(E)]
        allowed = set(range(E))
        if G is not None:
            gs = E // G
            if scoring == "sigmoid" or bias is not None:
                rank = [sum(sorted(c[g * gs : (g + 1) * gs], reverse=True)[:2]) for g in range(G)]
            else:
                rank = [max(c[g * gs : (g + 1) * gs]) for g in range(G)]
            kept = sorted(range(G), key=lambda g: -rank[g])[:TG]
            allowed = {e for e in range(E) if e // gs in kept}
        ids = sorted(allowed, key=lambda e: -c[e])[:k]
        w = [s[e] for e in ids]
        if renormalize:
            w = [v / sum(w) for v in w]
        out_w.append([v * scale for v in w])
        out_i.append(ids)
    return torch.tensor(out_w), torch.tensor(out_i)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("groups", [None, (4, 2), (6, 2), (12, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_naive_reference(scoring, renormalize, groups, with_bias):
    E, k, M = 12, 3, 40
    x = torch.randn(M, E) * 2
    bias = (torch.rand(E) * 0.3) if with_bias else None
    G, TG = groups if groups else (None, None)
    w, i = route(
        x,
        k,
        scoring=scoring,
        renormalize=renormalize,
        num_expert_groups=G,
        topk_groups=TG,
        correction_bias=bias,
        routed_scaling_factor=1.5,
    )
    w_ref, i_ref = _naive(x, k, scoring, renormalize, G, TG, bias.tolist() if with_bias else None, 1.5)
    assert torch.equal(i.long(), i_ref)
    torch.testing.assert_close(w, w_ref.float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kw", ALL_MODES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_empty_batch(kw):
    kw = _materialize(kw, 32)
    w, i = route(torch.empty(0, 32, dtype=torch.bfloat16), 6, **kw)
    assert w.shape == i.shape == (0, 6)
    assert w.dtype == torch.float32 and i.dtype == torch.int32
    assert w.is_contiguous() and i.is_contiguous()


@pytest.mark.parametrize("kw", ALL_MODES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_meta_tensors_never_read_values(kw):
    # Meta tensors have no data: any value read (.item(), bool(tensor), data-dependent shape) would raise.
    kw = _materialize(kw, 32, "meta")
    w, i = route(torch.empty(5, 32, device="meta"), 6, **kw)
    assert w.shape == i.shape == (5, 6) and w.device.type == i.device.type == "meta"
    assert w.dtype == torch.float32 and i.dtype == torch.int32


# ----------------------------------------------------------------------------------------------------
# Cross-checks against transformers' routers
# ----------------------------------------------------------------------------------------------------

_TINY = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4)


def _by_id(w, i):
    """Per token: ids sorted ascending and their weights in that order (compares sets of ids, order-free)."""
    i = i.long()
    order = i.argsort(dim=1)
    return w.gather(1, order), i.gather(1, order)


def _hf_vs_route(router, M, **route_kw):
    with torch.no_grad():
        router.weight.normal_()
        h = torch.randn(M, router.weight.shape[1])
        logits, w_hf, i_hf = router(h)
    w, i = route(logits, router.top_k, **route_kw)
    w_hf, i_hf = _by_id(w_hf.float(), i_hf)
    w, i = _by_id(w, i)
    assert torch.equal(i, i_hf)
    torch.testing.assert_close(w, w_hf, atol=1e-6, rtol=0)
    return logits


@needs_hf
@pytest.mark.parametrize("norm", [True, False])
def test_vs_transformers_qwen3_moe(norm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = transformers.Qwen3MoeConfig(**_TINY, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    _hf_vs_route(Qwen3MoeTopKRouter(cfg), 200, scoring="softmax", renormalize=norm)


@needs_hf
def test_vs_transformers_mixtral():
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = transformers.MixtralConfig(**_TINY, num_local_experts=8, num_experts_per_tok=2)
    _hf_vs_route(MixtralTopKRouter(cfg), 200, **ROUTING_PRESETS["mixtral"])


@needs_hf
def test_vs_transformers_gpt_oss():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    cfg = transformers.GptOssConfig(**_TINY, num_local_experts=32, num_experts_per_tok=4)
    router = GptOssTopKRouter(cfg)
    with torch.no_grad():
        router.bias.normal_()
    _hf_vs_route(router, 200, **ROUTING_PRESETS["gpt-oss"])


@needs_hf
@pytest.mark.parametrize(
    "method,E,k,G,TG,scale",
    [
        ("greedy", 64, 6, None, None, 1.0),
        ("group_limited_greedy", 32, 4, 4, 2, 16.0),
        ("group_limited_greedy", 160, 6, 8, 3, 16.0),
    ],
)
def test_vs_transformers_deepseek_v2(method, E, k, G, TG, scale):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = transformers.DeepseekV2Config(
        **_TINY,
        n_routed_experts=E,
        num_experts_per_tok=k,
        topk_method=method,
        n_group=G,
        topk_group=TG,
        routed_scaling_factor=scale,
    )
    router = DeepseekV2TopkRouter(cfg)
    if E == 160:  # full-size DeepSeek-V2: exactly the preset
        kw = ROUTING_PRESETS["deepseek-v2"]
    elif E == 64:  # DeepSeek-V2-Lite
        kw = ROUTING_PRESETS["deepseek-v2-lite"]
    else:
        kw = dict(
            scoring="softmax", renormalize=False, num_expert_groups=G, topk_groups=TG, routed_scaling_factor=scale
        )
    logits = _hf_vs_route(router, 300, **kw)
    if G is not None:  # the groups really restricted the choice for some tokens
        _, i_free = route(logits, k, scoring="softmax", renormalize=False)
        _, i_grp = route(logits, k, **kw)
        assert not torch.equal(i_free.sort(dim=1).values, i_grp.sort(dim=1).values)


@needs_hf
@pytest.mark.parametrize(
    "E,k,G,TG,norm,scale", [(16, 4, 4, 2, True, 2.5), (32, 4, 8, 3, False, 1.0), (256, 8, 8, 4, True, 2.5)]
)
def test_vs_transformers_deepseek_v3(E, k, G, TG, norm, scale):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(
        **_TINY,
        n_routed_experts=E,
        num_experts_per_tok=k,
        n_group=G,
        topk_group=TG,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    router = DeepseekV3TopkRouter(cfg)
    bias = torch.randn(E) * 0.1
    router.e_score_correction_bias.copy_(bias)
    kw = dict(
        scoring="sigmoid",
        renormalize=norm,
        num_expert_groups=G,
        topk_groups=TG,
        correction_bias=bias,
        routed_scaling_factor=scale,
    )
    if E == 256:  # full-size DeepSeek-V3: exactly the preset plus the bias
        kw = dict(ROUTING_PRESETS["deepseek-v3"], correction_bias=bias)
    logits = _hf_vs_route(router, 300, **kw)
    # The bias really changed the choice for some tokens (so the check above exercised it).
    _, i_nobias = route(logits, k, **dict(kw, correction_bias=None))
    _, i_bias = route(logits, k, **kw)
    assert not torch.equal(i_nobias.sort(dim=1).values, i_bias.sort(dim=1).values)


def test_presets():
    assert set(ROUTING_PRESETS) >= {"qwen3-moe", "mixtral", "deepseek-v2", "deepseek-v3", "gpt-oss"}
    assert ROUTING_PRESETS["deepseek-v3"] == dict(
        scoring="sigmoid", renormalize=True, num_expert_groups=8, topk_groups=4, routed_scaling_factor=2.5
    )
    assert ROUTING_PRESETS["gpt-oss"]["scoring"] == "softmax_topk"
    for name in ("qwen3-moe", "mixtral"):
        assert ROUTING_PRESETS[name]["scoring"] == "softmax" and ROUTING_PRESETS[name]["renormalize"]
    assert ROUTING_PRESETS["deepseek-v2"]["scoring"] == "softmax"
    assert ROUTING_PRESETS["deepseek-v2"]["renormalize"] is False
    assert ROUTING_PRESETS["deepseek-v2-lite"] == dict(scoring="softmax", renormalize=False)
    # Every preset is accepted at its model's size (E, k), and there is no preset without a size here.
    sizes = {
        "qwen3-moe": (128, 8),
        "mixtral": (8, 2),
        "deepseek-v2": (160, 6),
        "deepseek-v2-lite": (64, 6),
        "deepseek-v3": (256, 8),
        "gpt-oss": (32, 4),
    }
    assert set(sizes) == set(ROUTING_PRESETS)
    for name, (E, k) in sizes.items():
        w, i = route(torch.randn(3, E), k, **ROUTING_PRESETS[name])
        assert w.shape == i.shape == (3, k)


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------

X = torch.zeros(4, 8)

INVALID = [
    # (args, kwargs, exception, names that must appear in the message)
    (([[0.0] * 8], 2), {}, TypeError, ["router_logits"]),
    ((torch.zeros(4, 8, dtype=torch.int64), 2), {}, TypeError, ["router_logits"]),
    ((torch.zeros(4, 8, dtype=torch.bool), 2), {}, TypeError, ["router_logits"]),
    ((torch.zeros(8), 2), {}, ValueError, ["router_logits"]),
    ((torch.zeros(2, 4, 8), 2), {}, ValueError, ["router_logits"]),
    ((X, 0), {}, ValueError, ["top_k"]),
    ((X, -1), {}, ValueError, ["top_k"]),
    ((X, 9), {}, ValueError, ["top_k"]),
    ((X, 2.0), {}, ValueError, ["top_k"]),
    ((X, True), {}, ValueError, ["top_k"]),
    ((X, torch.tensor(2)), {}, ValueError, ["top_k"]),
    ((X, 2), {"scoring": "topk"}, ValueError, ["scoring"]),
    ((X, 2), {"scoring": None}, ValueError, ["scoring"]),
    ((X, 2), {"renormalize": 1}, TypeError, ["renormalize"]),
    ((X, 2), {"num_expert_groups": 4}, ValueError, ["num_expert_groups", "topk_groups"]),
    ((X, 2), {"topk_groups": 2}, ValueError, ["num_expert_groups", "topk_groups"]),
    ((X, 2), {"num_expert_groups": 3, "topk_groups": 1}, ValueError, ["num_expert_groups"]),
    ((X, 2), {"num_expert_groups": 0, "topk_groups": 1}, ValueError, ["num_expert_groups"]),
    ((X, 2), {"num_expert_groups": 2.0, "topk_groups": 1}, ValueError, ["num_expert_groups"]),
    ((X, 2), {"num_expert_groups": 4, "topk_groups": 0}, ValueError, ["topk_groups"]),
    ((X, 2), {"num_expert_groups": 4, "topk_groups": 5}, ValueError, ["topk_groups"]),
    (
        (X, 2),
        {"scoring": "softmax_topk", "num_expert_groups": 4, "topk_groups": 2},
        ValueError,
        ["scoring", "num_expert_groups"],
    ),
    ((X, 2), {"correction_bias": [0.0] * 8}, TypeError, ["correction_bias"]),
    ((X, 2), {"correction_bias": torch.zeros(8, dtype=torch.int32)}, TypeError, ["correction_bias"]),
    ((X, 2), {"correction_bias": torch.zeros(7)}, ValueError, ["correction_bias"]),
    ((X, 2), {"correction_bias": torch.zeros(1, 8)}, ValueError, ["correction_bias"]),
    ((X, 2), {"correction_bias": torch.zeros(8, device="meta")}, ValueError, ["correction_bias"]),
    (
        (X, 2),
        {"scoring": "softmax_topk", "correction_bias": torch.zeros(8)},
        ValueError,
        ["scoring", "correction_bias"],
    ),
    ((X, 2), {"routed_scaling_factor": 0.0}, ValueError, ["routed_scaling_factor"]),
    ((X, 2), {"routed_scaling_factor": -1.0}, ValueError, ["routed_scaling_factor"]),
    ((X, 2), {"routed_scaling_factor": float("inf")}, ValueError, ["routed_scaling_factor"]),
    ((X, 2), {"routed_scaling_factor": float("nan")}, ValueError, ["routed_scaling_factor"]),
    ((X, 2), {"routed_scaling_factor": "2"}, TypeError, ["routed_scaling_factor"]),
    ((X, 2), {"routed_scaling_factor": torch.tensor(2.0)}, TypeError, ["routed_scaling_factor"]),
    ((X, 2), {"routed_scaling_factor": True}, TypeError, ["routed_scaling_factor"]),
]


@pytest.mark.parametrize("args,kwargs,exc,names", INVALID, ids=[f"invalid{n}" for n in range(len(INVALID))])
def test_validation_errors(args, kwargs, exc, names):
    with pytest.raises(exc) as info:
        route(*args, **kwargs)
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def test_validation_on_meta_raises_before_any_work():
    # Same checks on data-less tensors: validation uses shapes/dtypes/devices only.
    x = torch.empty(4, 8, device="meta")
    with pytest.raises(ValueError, match="top_k"):
        route(x, 9)
    with pytest.raises(ValueError, match="correction_bias"):
        route(x, 2, correction_bias=torch.zeros(8))  # cpu bias, meta logits
    with pytest.raises(ValueError, match="num_expert_groups"):
        route(x, 2, num_expert_groups=3, topk_groups=1)


def test_valid_edge_values_accepted():
    # Boundaries that must NOT raise: top_k == E, top_k == topk_groups * group size, topk_groups == G,
    # an integer scaling factor and a numpy-style integer top_k.
    check(route(T(L4), 4, renormalize=False), [[1, 3, 2, 0]], [[0.4, 0.3, 0.2, 0.1]])
    w, i = route(X, 2, num_expert_groups=4, topk_groups=1)
    assert i.shape == (4, 2) and (i // 2 == i[:, :1] // 2).all()  # both experts from the single kept group
    check(route(T(L4), 2, renormalize=False, routed_scaling_factor=2), [[1, 3]], [[0.8, 0.6]])
    np = pytest.importorskip("numpy")
    check(route(T(L4), np.int64(2), renormalize=False), [[1, 3]], [[0.4, 0.3]])
