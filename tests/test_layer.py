"""FusedMoE (the nn.Module): forward on [..., H] inputs against a float64 reference composed from route +
fused_moe_reference + hand-computed shared experts; router logits given or computed; parameter shapes;
bf16 on CPU; routing settings reaching route()."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fusedmoe
from fusedmoe import FusedMoE, WorkspaceManager, route
from fusedmoe.reference import fused_moe_reference, relative_error

H, I, E, K = 40, 24, 16, 4
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def act64(gate_up, activation):
    """SwiGLU / GeGLU (tanh) in float64, written out independently of the library."""
    n = gate_up.shape[-1] // 2
    g, u = gate_up[..., :n], gate_up[..., n:]
    if activation == "silu":
        return g / (1 + torch.exp(-g)) * u
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u


def layer_reference(layer, x, router_logits=None):
    """float64 layer output for flattened x [M, H]: route + fused_moe_reference + shared experts by hand."""
    if router_logits is None:
        router_logits = F.linear(x, layer.gate)  # same op as the layer, so the same ids
    weights, ids = route(
        router_logits.reshape(-1, layer.num_experts),
        layer.top_k,
        correction_bias=layer.e_score_correction_bias,
        **layer.routing,
    )
    out = fused_moe_reference(
        x,
        layer.w1,
        layer.w2,
        weights,
        ids,
        activation=layer.activation,
        apply_router_weight_on_input=layer.apply_router_weight_on_input,
    )
    if layer.num_shared_experts:
        x64 = x.double()
        h = act64(x64 @ layer.shared_w1.double().T, layer.activation)
        y = h @ layer.shared_w2.double().T
        if layer.shared_gate is not None:
            y = torch.sigmoid(x64 @ layer.shared_gate.double().T) * y
        out = out + y
    return out


def check(layer, x, router_logits=None, dtype=torch.float32):
    """Forward [..., H] and compare with the reference on the flattened tokens; returns the output."""
    out = layer(x, router_logits)
    assert out.shape == x.shape and out.dtype == dtype
    flat = x.reshape(-1, layer.hidden_size)
    rl = None if router_logits is None else router_logits.reshape(-1, layer.num_experts)
    ref = layer_reference(layer, flat, rl)
    if flat.shape[0]:
        err = relative_error(out.reshape(-1, layer.hidden_size), ref)
        assert err < TOL[dtype], err
    return out


def make_layer(**kw):
    kw.setdefault("backend", "torch")
    kw.setdefault("workspace", WorkspaceManager("cpu"))
    torch.manual_seed(kw.pop("seed", 0))
    return FusedMoE(kw.pop("E", E), kw.pop("k", K), H, kw.pop("I", I), **kw)


# ---- forward vs reference ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape", [(H,), (1, H), (37, H), (3, 5, H), (2, 3, 4, H), (0, H), (2, 0, H)], ids=lambda s: "x".join(map(str, s))
)
def test_forward_shapes_match_reference(shape):
    """Inputs of any leading shape [..., H] give an output of the same shape equal to the reference."""
    layer = make_layer()
    check(layer, torch.randn(shape))


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("on_input", [False, True], ids=["weight_on_output", "weight_on_input"])
@pytest.mark.parametrize("shared", ["none", "shared", "shared_gated", "two_shared_Is"])
def test_forward_variants_match_reference(activation, on_input, shared):
    """Activations, router weight placement and shared experts (with/without gate) all match the reference."""
    kw = {"activation": activation, "apply_router_weight_on_input": on_input}
    if shared == "shared":
        kw.update(num_shared_experts=1)
    elif shared == "shared_gated":
        kw.update(num_shared_experts=1, shared_expert_gate=True)
    elif shared == "two_shared_Is":
        kw.update(num_shared_experts=2, shared_intermediate_size=20, shared_expert_gate=True)
    layer = make_layer(**kw)
    check(layer, torch.randn(4, 13, H))
    if shared != "none":  # the shared part really contributes
        routed_only = make_layer(**{k: v for k, v in kw.items() if "shared" not in k})
        routed_only.load_state_dict({k: v for k, v in layer.state_dict().items() if "shared" not in k})
        x = torch.randn(9, H)
        diff = layer(x) - routed_only(x)
        assert diff.abs().max() > 1e-3


def test_shared_gate_changes_output():
    """shared_expert_gate scales the shared experts by sigmoid(x @ shared_gate.T), checked by hand."""
    layer = make_layer(num_shared_experts=1, shared_expert_gate=True)
    x = torch.randn(11, H)
    y = layer.shared_experts(x).double()
    h = act64(x.double() @ layer.shared_w1.double().T, "silu")
    ungated = h @ layer.shared_w2.double().T
    gate = torch.sigmoid(x.double() @ layer.shared_gate.double().T)
    assert relative_error(y, gate * ungated) < 1e-5
    assert relative_error(y, ungated) > 1e-2


def test_given_router_logits_vs_gate():
    """Given router_logits are used as is; without them the logits are x @ gate.T."""
    layer = make_layer()
    x = torch.randn(3, 7, H)
    logits = torch.randn(3, 7, E)
    out_given = check(layer, x, logits)
    out_gate = check(layer, x)
    assert not torch.allclose(out_given, out_gate)
    assert torch.equal(layer(x, F.linear(x, layer.gate)), out_gate)
    # logits given flat [M, E] for [B, T, H] inputs are accepted too
    assert torch.equal(layer(x, logits.reshape(-1, E)), out_given)


def test_route_method_matches_route():
    """layer.route computes logits with gate and routes with the layer's settings."""
    layer = make_layer()
    x = torch.randn(20, H)
    w, ids = layer.route(x)
    w2, ids2 = route(F.linear(x, layer.gate), K)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32


# ---- parameters ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_parameter_shapes(dtype):
    """Parameters have the documented shapes, dtype, device and are not trainable."""
    layer = FusedMoE(
        E,
        K,
        H,
        I,
        num_shared_experts=2,
        shared_intermediate_size=12,
        shared_expert_gate=True,
        correction_bias=True,
        scoring="sigmoid",
        dtype=dtype,
        device="cpu",
    )
    shapes = {
        "w1": (E, 2 * I, H),
        "w2": (E, H, I),
        "gate": (E, H),
        "shared_w1": (2 * 2 * 12, H),
        "shared_w2": (H, 2 * 12),
        "shared_gate": (1, H),
    }
    params = dict(layer.named_parameters())
    assert set(params) == set(shapes)
    for name, shape in shapes.items():
        p = params[name]
        assert tuple(p.shape) == shape, name
        assert p.dtype == dtype and p.device.type == "cpu" and not p.requires_grad
        assert torch.isfinite(p).all() and p.float().std() > 0  # random, not zeros/ones
    bias = dict(layer.named_buffers())["e_score_correction_bias"]
    assert tuple(bias.shape) == (E,) and bias.dtype == torch.float32
    plain = FusedMoE(E, K, H, I)
    assert set(dict(plain.named_parameters())) == {"w1", "w2", "gate"}
    assert plain.e_score_correction_bias is None and not dict(plain.named_buffers())
    assert "experts=16" in repr(plain)


def test_plan_and_problem():
    """layer.plan(n) is the torch kernel's plan of the layer's problem with n tokens."""
    layer = make_layer()
    p = layer.problem(123)
    assert (p.M, p.H, p.I, p.E, p.global_E, p.top_k) == (123, H, I, E, E, K)
    assert layer.plan(123) == fusedmoe.get_kernel("torch").plan(p)


# ---- bf16 ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with_shared_gated"])
def test_bf16_layer_on_cpu(shared):
    """A bf16 layer runs on CPU and matches the float64 reference within 2e-2."""
    kw = {"dtype": torch.bfloat16}
    if shared:
        kw.update(num_shared_experts=1, shared_expert_gate=True)
    layer = make_layer(**kw)
    x = torch.randn(6, 9, H, dtype=torch.bfloat16)
    check(layer, x, dtype=torch.bfloat16)
    check(layer, x, torch.randn(6, 9, E, dtype=torch.bfloat16), dtype=torch.bfloat16)


# ---- routing settings ----------------------------------------------------------------------------------------
ROUTINGS = {
    "sigmoid_groups_bias": dict(
        scoring="sigmoid",
        renormalize=True,
        num_expert_groups=4,
        topk_groups=2,
        correction_bias=True,
        routed_scaling_factor=2.5,
    ),
    "softmax_groups_norenorm": dict(
        scoring="softmax", renormalize=False, num_expert_groups=8, topk_groups=3, routed_scaling_factor=16.0
    ),
    "softmax_topk": dict(scoring="softmax_topk"),
    "sigmoid_plain": dict(scoring="sigmoid", renormalize=False),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_routing_settings_reach_route(name):
    """The layer's routing settings give exactly the ids/weights of calling fusedmoe.route directly, and the
    forward matches the reference built on them."""
    settings = dict(ROUTINGS[name])
    has_bias = settings.pop("correction_bias", False)
    layer = make_layer(correction_bias=has_bias, **settings)
    if has_bias:
        layer.e_score_correction_bias.copy_(torch.randn(E) * 0.5)
    x = torch.randn(50, H)
    logits = F.linear(x, layer.gate)
    w, ids = layer.route(x)
    w_direct, ids_direct = route(
        logits, K, correction_bias=layer.e_score_correction_bias if has_bias else None, **settings
    )
    assert torch.equal(ids, ids_direct) and torch.equal(w, w_direct)
    # the settings matter: default softmax routing picks different experts or weights (softmax_topk is
    # mathematically softmax + renormalize, the default, so it is exempt)
    if name != "softmax_topk":
        w_default, ids_default = route(logits, K)
        assert not (torch.equal(ids, ids_default) and torch.allclose(w, w_default))
    if "num_expert_groups" in settings:  # group-limited: a token's experts come from <= topk_groups groups
        size = E // settings["num_expert_groups"]
        groups_used = [len(set((row // size).tolist())) for row in ids.long()]
        assert max(groups_used) <= settings["topk_groups"]
    check(layer, x)


# ---- workspace plumbing --------------------------------------------------------------------------------------
def test_layer_uses_its_manager_and_default_otherwise():
    """A layer draws scratch from the manager it was given; without one, from the device's default manager."""
    mgr = WorkspaceManager("cpu")
    layer = make_layer(workspace=mgr)
    layer(torch.randn(5, H))
    assert mgr.stats.calls == 1
    assert layer.manager is mgr
    default = fusedmoe.workspace.default_manager("cpu")
    before = default.stats.calls
    plain = make_layer(workspace=None)
    assert plain.manager is default
    check(plain, torch.randn(5, H))
    assert default.stats.calls == before + 1
    assert mgr.stats.calls == 1
