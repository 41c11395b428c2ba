"""Autograd of the MoE layer: the torch backward's formulas against autograd and finite differences (float64)."""

from __future__ import annotations

import pytest
import torch

from fusedmoe.reference import activation_reference, fused_moe_reference
from fusedmoe.training import (
    BackwardSettings,
    differentiable_moe,
    gated_activation_backward,
    moe_backward_torch,
    moe_forward_torch,
)

ACTIVATIONS = ("silu", "gelu", "gelu_exact", "swigluoai")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_backward_matches_autograd(activation):
    torch.manual_seed(0)
    gate_up = (torch.randn(64, 16, dtype=torch.float64) * 5).requires_grad_()  # swigluoai: values past the clamp
    grad = torch.randn(64, 8, dtype=torch.float64)
    (expected,) = torch.autograd.grad(activation_reference(gate_up, activation), gate_up, grad)
    got = gated_activation_backward(gate_up.detach(), grad, activation)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_activation_backward_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation must be"):
        gated_activation_backward(torch.zeros(2, 4), torch.zeros(2, 2), "relu")


def _problem(M=7, E=4, k=2, H=8, I=6, dtype=torch.float64, bias=False, seed=0, ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, dtype=dtype, generator=g)
    w1 = torch.randn(E, 2 * I, H, dtype=dtype, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, dtype=dtype, generator=g) / I**0.5
    tw = torch.rand(M, k, dtype=dtype, generator=g)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)] or [torch.zeros(0, k)])
        ids = ids.reshape(M, k).to(torch.int32)
    b1 = torch.randn(E, 2 * I, dtype=dtype, generator=g) if bias else None
    b2 = torch.randn(E, H, dtype=dtype, generator=g) if bias else None
    return x, w1, w2, tw, ids, b1, b2


def _diff_fn(activation, on_input, expert_map, global_E, ids):
    settings = BackwardSettings(activation, on_input, global_E, "torch")

    def fn(x, w1, w2, tw, b1=None, b2=None):
        def forward():
            return moe_forward_torch(
                x,
                w1,
                w2,
                tw,
                ids,
                activation=activation,
                apply_router_weight_on_input=on_input,
                expert_map=expert_map,
                global_num_experts=global_E,
                w1_bias=b1,
                w2_bias=b2,
            )

        return differentiable_moe(forward, settings, x, w1, w2, tw, ids, expert_map, b1, b2)

    return fn


@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_forward_matches_reference(activation, bias, on_input):
    x, w1, w2, tw, ids, b1, b2 = _problem(bias=bias)
    kw = dict(activation=activation, apply_router_weight_on_input=on_input, w1_bias=b1, w2_bias=b2)
    torch.testing.assert_close(
        moe_forward_torch(x, w1, w2, tw, ids, **kw),
        fused_moe_reference(x, w1, w2, tw, ids, **kw),
        rtol=1e-12,
        atol=1e-12,
    )


@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck(activation, bias, on_input):
    x, w1, w2, tw, ids, b1, b2 = _problem(M=5, E=3, k=2, H=4, I=3, bias=bias, seed=1)
    inputs = [t.requires_grad_() for t in (x, w1, w2, tw, b1, b2) if t is not None]
    assert torch.autograd.gradcheck(_diff_fn(activation, on_input, None, 3, ids), inputs)


def test_gradcheck_with_expert_map_and_unroutable_slots():
    # 6 global experts, this rank holds global 1 and 4 (local 0 and 1); ids -1 and 9 are out of range
    expert_map = torch.tensor([-1, 0, -1, -1, 1, -1], dtype=torch.int32)
    ids = torch.tensor([[1, 4], [0, 2], [4, -1], [9, 1], [3, 5]], dtype=torch.int32)
    x, w1, w2, tw, _, b1, b2 = _problem(M=5, E=2, k=2, H=4, I=3, bias=True, seed=2, ids=ids)
    inputs = [t.requires_grad_() for t in (x, w1, w2, tw, b1, b2)]
    fn = _diff_fn("silu", False, expert_map, 6, ids)
    assert torch.autograd.gradcheck(fn, inputs)
    out = fn(*inputs)
    out.sum().backward()
    # token 4 routes to no local expert and slots (1, 0), (1, 1), (2, 1), (3, 0) are not local: no gradient
    assert torch.all(x.grad[4] == 0)
    assert tw.grad[1].eq(0).all() and tw.grad[2, 1] == 0 and tw.grad[3, 0] == 0
    assert tw.grad[0].ne(0).all()


@pytest.mark.parametrize(
    "case",
    ["one_expert", "topk_equals_E", "all_on_one_expert", "idle_experts", "M1"],
)
def test_gradcheck_edges(case):
    E, k, M = {"one_expert": (1, 1, 4), "topk_equals_E": (3, 3, 4), "M1": (4, 2, 1)}.get(case, (4, 2, 5))
    ids = None
    if case == "all_on_one_expert":
        ids = torch.tensor([[2, 0]] * M, dtype=torch.int32)
    if case == "idle_experts":
        ids = torch.tensor([[0, 1]] * M, dtype=torch.int32)
    x, w1, w2, tw, ids, b1, b2 = _problem(M=M, E=E, k=k, H=4, I=3, seed=3, ids=ids)
    inputs = [t.requires_grad_() for t in (x, w1, w2, tw)]
    fn = _diff_fn("gelu", False, None, E, ids)
    assert torch.autograd.gradcheck(fn, inputs)
    if case == "idle_experts":
        fn(*inputs).sum().backward()
        assert w1.grad[2:].eq(0).all() and w2.grad[2:].eq(0).all()


def test_no_tokens():
    x, w1, w2, tw, ids, _, _ = _problem(M=0, E=3, k=2)
    grads = moe_backward_torch(torch.zeros(0, 8, dtype=torch.float64), x, w1, w2, tw, ids)
    assert grads.hidden_states.shape == (0, 8) and grads.topk_weights.shape == (0, 2)
    assert grads.w1.eq(0).all() and grads.w2.eq(0).all()


def test_only_requested_gradients_are_computed():
    x, w1, w2, tw, ids, b1, b2 = _problem(bias=True)
    g = torch.randn(x.shape, dtype=x.dtype)
    full = moe_backward_torch(g, x, w1, w2, tw, ids, w1_bias=b1, w2_bias=b2)
    only_x = moe_backward_torch(g, x, w1, w2, tw, ids, w1_bias=b1, w2_bias=b2, needs=(True,) + (False,) * 5)
    assert only_x.w1 is None and only_x.w2 is None and only_x.topk_weights is None and only_x.w1_bias is None
    torch.testing.assert_close(only_x.hidden_states, full.hidden_states, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_gradients_track_float64(dtype):
    x, w1, w2, tw, ids, b1, b2 = _problem(M=16, E=4, k=2, H=32, I=16, bias=True, seed=4)
    g = torch.randn(x.shape, dtype=torch.float64)
    ref = moe_backward_torch(g, x, w1, w2, tw, ids, w1_bias=b1, w2_bias=b2)
    low = moe_backward_torch(
        g.to(dtype), *(t.to(dtype) for t in (x, w1, w2)), tw.float(), ids, w1_bias=b1.to(dtype), w2_bias=b2.to(dtype)
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name in ("hidden_states", "w1", "w2", "topk_weights", "w1_bias", "w2_bias"):
        a, b = getattr(low, name), getattr(ref, name)
        assert a.dtype == (torch.float32 if name == "topk_weights" else dtype)
        err = (a.double() - b).norm() / b.norm()
        assert err < tol, (name, err.item())


# ---- the public entry points ------------------------------------------------------------------------------------
def _reference_grads(x, w1, w2, tw, ids, **kw):
    """float64 gradients of fused_moe_reference (plain torch ops) for sum(out * probe)."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w1, w2, tw)]
    out = fused_moe_reference(*leaves, ids, **kw)
    probe = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)
    (out * probe).sum().backward()
    return out, probe, [t.grad for t in leaves]


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("on_input", [False, True])
def test_fused_moe_is_differentiable(on_input):
    from fusedmoe import fused_moe

    x, w1, w2, tw, ids, _, _ = _problem(M=9, E=4, k=2, H=16, I=8, dtype=torch.float32, seed=5)
    ref_out, probe, ref_grads = _reference_grads(x, w1, w2, tw, ids, apply_router_weight_on_input=on_input)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, tw)]
    out = fused_moe(*leaves, ids, apply_router_weight_on_input=on_input, backend="torch")
    assert out.requires_grad and _rel(out.detach(), ref_out) < 1e-5
    (out * probe.float()).sum().backward()
    for leaf, want in zip(leaves, ref_grads):
        assert _rel(leaf.grad, want) < 1e-5


def test_fused_moe_gradients_only_for_inputs_that_require_them():
    from fusedmoe import fused_moe

    x, w1, w2, tw, ids, _, _ = _problem(M=5, E=3, k=2, H=8, I=4, dtype=torch.float32, seed=6)
    w1.requires_grad_()
    fused_moe(x, w1, w2, tw, ids, backend="torch").sum().backward()
    assert w1.grad is not None and w1.grad.abs().sum() > 0
    assert x.grad is None and w2.grad is None and tw.grad is None


def test_layer_trains_router_experts_and_shared_experts():
    from fusedmoe import FusedMoE

    torch.manual_seed(8)
    layer = FusedMoE(4, 2, 16, 8, num_shared_experts=1, backend="torch")
    with torch.no_grad():
        for prm in layer.parameters():
            prm.copy_(torch.randn_like(prm) * 0.3)
    layer.requires_grad_(True)
    x = torch.randn(6, 16, requires_grad=True)
    out = layer(x)
    out.square().sum().backward()
    # reference: the same computation in float64 torch ops
    ref = {n: prm.detach().double().requires_grad_() for n, prm in layer.named_parameters()}
    xr = x.detach().double().requires_grad_()
    logits = xr @ ref["gate"].T
    from fusedmoe.routing import route

    tw, ids = route(logits, 2, **layer.routing)
    y = fused_moe_reference(xr, ref["w1"], ref["w2"], tw, ids)
    y = y + activation_reference(xr @ ref["shared_w1"].T, "silu") @ ref["shared_w2"].T
    y.square().sum().backward()
    assert _rel(out.detach(), y) < 1e-5
    assert _rel(x.grad, xr.grad) < 1e-5
    for n, prm in layer.named_parameters():
        assert prm.grad is not None, n
        assert _rel(prm.grad, ref[n].grad) < 1e-5, n


def test_registered_op_is_differentiable_and_matches_fused_moe():
    from fusedmoe import fused_moe
    from fusedmoe.op import fused_moe_op

    x, w1, w2, tw, ids, b1, b2 = _problem(M=7, E=3, k=2, H=16, I=8, dtype=torch.float32, bias=True, seed=9)
    grads = []
    for fn in (fused_moe, fused_moe_op):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, tw, b1, b2)]
        out = fn(*leaves[:4], ids, w1_bias=leaves[4], w2_bias=leaves[5], backend="torch")
        out.square().sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # the op's backward describes itself to the compiler (fake impl) and passes torch.library's checks
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, tw)]
    torch.library.opcheck(
        torch.ops.fusedmoe.fused_moe.default,
        (*leaves, ids),
        {"backend": "torch"},
        test_utils=("test_autograd_registration", "test_faketensor"),
    )


@pytest.mark.slow
def test_compiled_layer_trains():
    from fusedmoe import FusedMoE

    torch.manual_seed(10)
    layer = FusedMoE(4, 2, 16, 8, backend="torch")
    with torch.no_grad():
        for prm in layer.parameters():
            prm.copy_(torch.randn_like(prm) * 0.3)
    layer.requires_grad_(True)
    x = torch.randn(6, 16)
    eager = layer(x).square().sum()
    eager.backward()
    want = {n: prm.grad.clone() for n, prm in layer.named_parameters()}
    layer.zero_grad()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    loss = compiled(x).square().sum()
    loss.backward()
    torch.testing.assert_close(loss, eager)
    for n, prm in layer.named_parameters():
        torch.testing.assert_close(prm.grad, want[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    from torch.utils.checkpoint import checkpoint

    from fusedmoe import fused_moe

    x, w1, w2, tw, ids, _, _ = _problem(M=8, E=4, k=2, H=16, I=8, dtype=torch.float32, seed=11)
    grads = []
    for wrap in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, tw)]

        def block(x, w1, w2, tw):
            return fused_moe(x, w1, w2, tw, ids, backend="torch").tanh()

        out = checkpoint(block, *leaves, use_reentrant=reentrant) if wrap else block(*leaves)
        out.sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
