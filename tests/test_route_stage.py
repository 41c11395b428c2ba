"""Routing inside the kernel: a local FusedMoE hands its router logits to the kernel, whose first step writes the
top-k into two planned, exported workspace buffers. These tests check the plan (lifetimes derived from the
steps), that the result equals routing outside the kernel for every routing family, under poison and on a
shared arena, and that the routing launch joins the layer's recorded trace on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusedmoe import FusedMoE, WorkspaceManager, fused_moe, route
from fusedmoe.api import get_kernel

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E, K, H, I = 8, 2, 32, 16
FAMILIES = {
    "softmax-renorm": dict(scoring="softmax", renormalize=True),
    "sigmoid-groups-bias": dict(
        scoring="sigmoid",
        renormalize=True,
        num_expert_groups=4,
        topk_groups=2,
        routed_scaling_factor=2.5,
        correction_bias=True,
    ),
    "softmax-topk": dict(scoring="softmax_topk"),
    "softmax-groups": dict(
        scoring="softmax", renormalize=False, num_expert_groups=2, topk_groups=1, routed_scaling_factor=16.0
    ),
}


def _layer(family: str, backend: str, workspace=None) -> FusedMoE:
    torch.manual_seed(0)
    layer = FusedMoE(
        E, K, H, I, dtype=torch.float32, device=DEV, backend=backend, workspace=workspace, **FAMILIES[family]
    )
    if layer.e_score_correction_bias is not None:
        layer.e_score_correction_bias.normal_()
    return layer


def test_the_routed_buffers_live_from_the_first_step_to_the_last_expert_step():
    layer = _layer("softmax-renorm", "torch")
    p = layer.problem(5)
    assert p.routing is not None
    prog = get_kernel("torch").program(p)[0]
    assert prog.steps[0].name == "route_step"
    experts_end = prog.segments[1][-1]
    for name in ("topk_weights", "topk_ids"):
        spec = next(b for b in prog.plan.buffers if b.name == name)
        assert (spec.first, spec.last) == (0, experts_end)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("poison", [False, True])
@pytest.mark.parametrize("router_gemm", [False, True])
def test_routing_in_the_kernel_equals_routing_outside(family, backend, poison, router_gemm, request):
    if router_gemm:  # the kernel's routing step computes the logits from the router's weight
        request.getfixturevalue("router_gemm_to_64")
    mgr = WorkspaceManager(DEV, poison=poison)
    layer = _layer(family, backend, mgr)
    settings = {k: v for k, v in FAMILIES[family].items() if k != "correction_bias"}
    for m in (1, 7):
        x = torch.randn(m, H, device=DEV)
        logits = x @ layer.gate.T
        w, ids = route(logits, K, correction_bias=layer.e_score_correction_bias, **settings)
        want = fused_moe(x, layer.w1, layer.w2, w, ids, backend=backend, workspace=mgr)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer(x, router_logits=logits), want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_the_routing_launch_joins_the_layer_trace():
    torch.manual_seed(0)
    layer = FusedMoE(16, 4, 256, 128, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    layer(x)
    p = layer.problem(3, torch.bfloat16)
    kernel = get_kernel("triton")
    layout = layer._verdicts[layer._key(x, None)[0]][-1]  # the key the layer's kernel records its launches under
    trace = kernel.traces.get((kernel.program(p)[0], layout))
    assert [name for name, _ in trace.parts()] == [
        "_route_kernel",
        "_align_pairs",
        "_moe_gemm1",
        "_moe_gemm2",
        "_moe_reduce",
    ]


def test_a_decode_call_hands_the_kernel_the_router_weight_instead_of_logits(router_gemm_to_64):
    """Up to ROUTER_GEMM_MAX_M rows without logits, the layer's kernel gets the router's weight and bias and its
    routing step computes the logits (one F.linear fewer in the layer); above, or given logits, it gets logits."""
    ROUTER_GEMM_MAX_M = router_gemm_to_64
    layer = _layer("softmax-renorm", "torch")
    seen = []
    real = layer._inputs
    layer._inputs = lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1]
    for m, logits in ((1, False), (ROUTER_GEMM_MAX_M, False), (ROUTER_GEMM_MAX_M + 1, False), (1, True)):
        x = torch.randn(m, H, device=DEV)
        for _ in range(2):  # the checked call, then the cached verdict's
            layer(x, router_logits=F.linear(x, layer.gate) if logits else None)
            got = seen[-1]
            in_kernel = m <= ROUTER_GEMM_MAX_M and not logits
            assert (got.router_weight is layer.gate) == in_kernel
            assert (got.router_logits is None) == in_kernel


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_router_bias_joins_the_logits_the_kernel_computes(backend, router_gemm_to_64):
    """gpt-oss' router has a bias: the routing step adds it (softmax over the chosen logits amplifies any miss)."""
    layer = _layer("softmax-topk", backend)
    layer.gate_bias = torch.nn.Parameter(torch.randn(E, device=DEV) * 2)
    x = torch.randn(3, H, device=DEV)
    logits = F.linear(x, layer.gate, layer.gate_bias)
    w, ids = route(logits, K, scoring="softmax_topk")
    want = fused_moe(x, layer.w1, layer.w2, w, ids, backend=backend)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)  # the cached verdict


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64, 65])
def test_gpu_bf16_layer_routes_from_its_own_logits_as_from_given_ones(m, router_gemm_to_64):
    """bf16 on the GPU: the routing launch's logits (float32 accumulation, rounded to bf16 as F.linear's) route the
    layer as the logits F.linear returns do, replayed calls included; a rare row may break a bf16 tie the other
    way, so rows are compared, not the whole output."""
    torch.manual_seed(0)
    layer = FusedMoE(128, 8, 256, 128, dtype=torch.bfloat16, device="cuda")
    same = []
    for _ in range(10):
        x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
        got, want = layer(x), layer(x, router_logits=F.linear(x, layer.gate))
        same.append((got == want).all(dim=1))  # the same experts and weights give the same bits
    assert torch.cat(same).float().mean().item() >= 0.9


@pytest.mark.gpu
def test_gpu_layer_switching_the_router_gemm_never_replays_the_other_choices_launches(monkeypatch):
    """The same layer and input signature, once with the logits by F.linear and once with the router GEMM in the
    routing launch: each choice records its own launches (they take different inputs), so flipping
    ROUTER_GEMM_MAX_M between calls neither crashes a replay nor changes the rows' experts."""
    from fusedmoe.ops import routing

    torch.manual_seed(0)
    layer = FusedMoE(128, 8, 256, 128, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    outs = []
    for most in (0, 64, 0, 64):  # each choice twice: recorded, then replayed
        monkeypatch.setattr(routing, "ROUTER_GEMM_MAX_M", most)
        layer._verdicts.clear()
        outs.append([layer(x), layer(x)])
    assert layer._verdicts[next(iter(layer._verdicts))][4]  # the last calls computed the logits in the launch
    for a, b in outs:
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(outs[0][0], outs[2][1], rtol=0, atol=0)
    torch.testing.assert_close(outs[1][0], outs[3][1], rtol=0, atol=0)
    assert (outs[0][0] == outs[1][0]).all(dim=1).float().mean().item() >= 0.75
