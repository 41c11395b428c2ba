"""The model presets of the tools: router keywords and the layer a preset builds."""

import torch

from fusedmoe.routing import route
from fusedmoe.tools.presets import PRESETS


def test_preset_routing_is_the_keywords_of_route():
    """Every router setting of a preset reaches route() (deepseek-v3 sets each one away from its default)."""
    p = PRESETS["deepseek-v3"]
    assert p.routing == dict(
        scoring="sigmoid", renormalize=True, num_expert_groups=8, topk_groups=4, routed_scaling_factor=2.5
    )
    w, ids = route(torch.randn(3, p.num_experts), p.top_k, **p.routing)
    assert ids.shape == w.shape == (3, p.top_k)
    assert PRESETS["gpt-oss-20b"].routing["scoring"] == "softmax_topk"
    assert PRESETS["deepseek-v2-lite"].routing["renormalize"] is False
