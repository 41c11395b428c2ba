"""The model presets of the tools: router keywords and the layer a preset builds."""

import torch

from fusedmoe.routing import route
from fusedmoe.tools.presets import PRESETS, Preset


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


def test_routed_layer_is_the_presets_layer():
    """A preset's layer: its routed experts and router settings; the keywords reach FusedMoE."""
    from fusedmoe import FusedMoE
    from fusedmoe.tools.bench.host import CPU_SHAPE

    p = Preset("t", 8, 2, 32, 16, 1, num_shared_experts=1, scoring="sigmoid", num_expert_groups=4, topk_groups=2)
    layer = p.routed_layer(dtype=torch.bfloat16, backend="torch")
    assert isinstance(layer, FusedMoE) and layer.routing == p.routing and layer.num_shared_experts == 0
    assert tuple(layer.w1.shape) == (p.num_experts, 2 * p.intermediate_size, p.hidden_size)
    assert layer.w1.dtype == torch.bfloat16 and layer.backend == "torch"
    torch.manual_seed(0)
    built = CPU_SHAPE.routed_layer(dtype=torch.float32)
    torch.manual_seed(0)
    plain = FusedMoE(16, 4, 256, 128, dtype=torch.float32)  # the defaults: the same router, the same weights
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), plain.state_dict().values()))
