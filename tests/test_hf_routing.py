"""fusedmoe.route against transformers' DeepSeek routers when top_k exceeds the experts of the kept groups
(transformers' own DeepSeek-V3 test config: 8 experts, n_group 2, topk_group 1, 8 per token): the same experts
with the same weights, including the slots filled from the dropped groups."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from fusedmoe import route  # noqa: E402

_TINY = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
)


def _by_id(w, i):
    i = i.long()
    order = i.argsort(dim=1)
    return w.float().gather(1, order), i.gather(1, order)


def _router(model_type, **cfg):
    if model_type == "deepseek_v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        router = DeepseekV3TopkRouter(DeepseekV3Config(**_TINY, **cfg))
        with torch.no_grad():
            router.e_score_correction_bias.normal_(0.0, 0.5)
        return router
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    return DeepseekV2TopkRouter(DeepseekV2Config(**_TINY, topk_method="group_limited_greedy", **cfg))


CASES = [  # (E, groups, kept groups, top_k): kept experts = kept groups * E / groups < top_k
    (8, 2, 1, 8),  # transformers' DeepSeek-V3 test config: every expert
    (8, 2, 1, 5),
    (8, 4, 1, 3),
    (16, 4, 2, 11),
    (12, 6, 1, 3),
]


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("E,G,TG,k", CASES)
def test_fill_from_dropped_groups_matches_transformers(model_type, E, G, TG, k):
    cfg = dict(n_routed_experts=E, n_group=G, topk_group=TG, num_experts_per_tok=k, routed_scaling_factor=2.5)
    if model_type == "deepseek_v3":
        cfg["norm_topk_prob"] = True
    router = _router(model_type, **cfg)
    with torch.no_grad():
        router.weight.normal_()
        logits, w_hf, i_hf = router(torch.randn(300, 32, generator=torch.Generator().manual_seed(E + k)))
    if model_type == "deepseek_v3":
        kw = dict(scoring="sigmoid", renormalize=True, correction_bias=router.e_score_correction_bias)
    else:
        kw = dict(scoring="softmax", renormalize=False)
    w, i = route(logits, k, num_expert_groups=G, topk_groups=TG, routed_scaling_factor=2.5, **kw)
    assert w.shape == i.shape == (300, k)
    w_ref, i_ref = _by_id(w_hf, i_hf)
    w, i = _by_id(w, i)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)
    kept_experts = TG * (E // G)
    if model_type == "deepseek_v2":  # group_limited_greedy: the filled slots weigh exactly 0
        assert int((w == 0).sum(dim=1).min()) >= k - kept_experts
    else:  # noaux_tc: they weigh their scores, so all k count
        assert (w > 0).all()


def test_fill_order_and_distinct_ids():
    """Kept experts first (descending), then the filled ones; ids distinct, in range."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 16, generator=g)
    w, i = route(logits, 11, scoring="sigmoid", renormalize=True, num_expert_groups=4, topk_groups=2)
    assert (i.sort(dim=1).values.diff(dim=1) > 0).all() and ((i >= 0) & (i < 16)).all()
    sig = torch.sigmoid(logits)
    grouped = sig.view(64, 4, 4).topk(2, dim=-1).values.sum(-1)
    kept = grouped.topk(2, dim=-1).indices
    in_kept = (i.long() // 4).unsqueeze(-1).eq(kept.unsqueeze(1)).any(-1)
    assert in_kept[:, :8].all() and not in_kept[:, 8:].any()  # the 8 kept experts lead, the 3 fills follow
    assert (w[:, :8].diff(dim=1) <= 0).all()
