"""The registered op (torch.ops.fusedmoe.fused_moe): schema, fake, opcheck, compile; and the gpt-oss extensions of
the fused call (expert biases, the clamped "swigluoai" activation) on both backends."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

import fusedmoe
from fusedmoe import FusedMoE, WorkspaceManager, fused_moe, route
from fusedmoe.op import fused_moe_op, lookup_workspace, workspace_id
from fusedmoe.reference import fused_moe_reference, relative_error

OP = torch.ops.fusedmoe.fused_moe.default

# Triton on CPU tensors needs the interpreter (set by conftest when there is no GPU); on a GPU machine these
# float32 cases are covered by tests/test_gpu_hf.py in bf16.
_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def _skip_triton(backend):
    if backend == "triton" and not _INTERPRETER:
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")


def _problem(M=9, H=64, I=48, E=6, k=2, seed=0, bias=False, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) * (scale / H**0.5)
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    tw, ti = route(torch.randn(M, E, generator=g), k)
    b1 = torch.randn(E, 2 * I, generator=g) if bias else None
    b2 = torch.randn(E, H, generator=g) if bias else None
    return x, w1, w2, tw, ti, b1, b2


# ---- op contract ------------------------------------------------------------------------------------------------
def test_schema():
    s = str(OP._schema)
    assert s.startswith(
        "fusedmoe::fused_moe(Tensor hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, "
        'Tensor topk_ids, Tensor? w1_bias=None, Tensor? w2_bias=None, str activation="silu"'
    )
    assert s.endswith("-> Tensor")


@pytest.mark.parametrize("case", ["plain", "bias_swigluoai", "int64_ids", "expert_map", "empty", "weight_on_input"])
def test_opcheck(case):
    x, w1, w2, tw, ti, b1, b2 = _problem(bias=case == "bias_swigluoai")
    if case == "plain":
        args = (x, w1, w2, tw, ti)
        kwargs = {}
    elif case == "bias_swigluoai":
        args = (x, w1, w2, tw, ti, b1, b2, "swigluoai")
        kwargs = {}
    elif case == "int64_ids":
        args = (x, w1, w2, tw.to(torch.float16).float(), ti.long())
        kwargs = {"activation": "gelu"}
    elif case == "expert_map":
        emap = torch.tensor([0, -1, 1, -1, 2, 3, -1, 4, 5, -1], dtype=torch.int32)
        ti = torch.randint(0, 10, ti.shape, dtype=torch.int32)
        args = (x, w1, w2, tw, ti)
        kwargs = {"global_num_experts": 10, "expert_map": emap}
    elif case == "empty":
        args = (x[:0], w1, w2, tw[:0], ti[:0])
        kwargs = {}
    else:
        args = (x, w1, w2, tw, ti)
        kwargs = {"apply_router_weight_on_input": True}
    torch.library.opcheck(OP, args, kwargs)


def test_op_matches_eager_path_and_uses_workspace():
    x, w1, w2, tw, ti, b1, b2 = _problem(bias=True)
    mgr = WorkspaceManager("cpu")
    out = fused_moe_op(x, w1, w2, tw, ti, workspace=mgr, w1_bias=b1, w2_bias=b2, activation="swigluoai")
    ref = fused_moe(x, w1, w2, tw, ti, w1_bias=b1, w2_bias=b2, activation="swigluoai")
    assert torch.equal(out, ref)
    assert mgr.stats.calls == 1
    assert out.data_ptr() != x.data_ptr()


def test_fake_gives_output_metadata():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w1, w2, tw, ti, _, _ = _problem()
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        out = OP(fx, mode.from_tensor(w1), mode.from_tensor(w2), mode.from_tensor(tw), mode.from_tensor(ti))
    assert out.shape == x.shape and out.dtype == x.dtype


def test_workspace_ids():
    assert workspace_id(None) == -1 and lookup_workspace(-1) is None
    mgr = WorkspaceManager("cpu")
    i = workspace_id(mgr)
    assert workspace_id(mgr) == i and lookup_workspace(i) is mgr
    with pytest.raises(TypeError):
        workspace_id("cpu")


def test_compile_function_fullgraph_dynamic():
    x, w1, w2, tw, ti, _, _ = _problem()
    mgr = WorkspaceManager("cpu")

    def f(x, tw, ti):
        return fused_moe_op(x, w1, w2, tw, ti, workspace=mgr) * 2.0 + 1.0

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    for M in (9, 5, 17):
        x, _, _, tw, ti, _, _ = _problem(M=M, seed=M)
        assert relative_error(cf(x, tw, ti), fused_moe(x, w1, w2, tw, ti) * 2.0 + 1.0) < 1e-6
    assert mgr.stats.calls == 3


def test_layer_compiles_through_op_and_eager_stays_direct(monkeypatch):
    import fusedmoe.api as api_mod

    calls = []
    real = api_mod.run_problem  # what the registered op's implementation runs (eager calls never reach it)
    monkeypatch.setattr(api_mod, "run_problem", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.manual_seed(0)
    layer = FusedMoE(
        8,
        2,
        64,
        32,
        num_shared_experts=1,
        expert_bias=True,
        router_bias=True,
        activation="swigluoai",
        workspace=WorkspaceManager("cpu"),
    )
    with torch.no_grad():
        for p in (layer.w1_bias, layer.w2_bias, layer.gate_bias):
            p.normal_()
    x = torch.randn(2, 5, 64)
    eager = layer(x)
    assert not calls  # eager: the fast direct path
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    assert calls  # compiled: the registered op
    assert relative_error(out, eager) < 1e-6


# ---- biases and swigluoai in the fused call ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "backend,activation,bias,weight_on_input",
    list(itertools.product(["torch", "triton"], ["silu", "gelu", "swigluoai"], [None, "both", "w1", "w2"], [False]))
    + [("torch", "swigluoai", "both", True), ("triton", "swigluoai", "both", True)],
)
def test_bias_and_activation_vs_reference(backend, activation, bias, weight_on_input):
    _skip_triton(backend)
    k = 1 if weight_on_input else 2
    # scale 3: many gate/up values beyond the clamp limit 7, so the clamps are exercised
    x, w1, w2, tw, ti, b1, b2 = _problem(k=k, bias=bias is not None, scale=3.0)
    if bias == "w1":
        b2 = None
    elif bias == "w2":
        b1 = None
    kw = dict(activation=activation, w1_bias=b1, w2_bias=b2, apply_router_weight_on_input=weight_on_input)
    out = fused_moe(x, w1, w2, tw, ti, backend=backend, **kw)
    ref = fused_moe_reference(x, w1, w2, tw, ti, **kw)
    assert relative_error(out, ref) < 1e-5
    if activation == "swigluoai":
        gate_up = x @ w1[0].T
        assert (gate_up.abs() > 7.0).any()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bias_poison_and_expert_map(backend):
    _skip_triton(backend)
    x, w1, w2, tw, ti, b1, b2 = _problem(bias=True, E=4)
    emap = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32)
    ti = torch.randint(0, 6, ti.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    kw = dict(activation="swigluoai", w1_bias=b1, w2_bias=b2, expert_map=emap, global_num_experts=6)
    clean = fused_moe(x, w1, w2, tw, ti, backend=backend, workspace=WorkspaceManager("cpu"), **kw)
    poisoned = fused_moe(x, w1, w2, tw, ti, backend=backend, workspace=WorkspaceManager("cpu", poison=True), **kw)
    assert torch.equal(clean, poisoned)
    assert relative_error(clean, fused_moe_reference(x, w1, w2, tw, ti, **kw)) < 1e-5


def test_bias_validation():
    x, w1, w2, tw, ti, b1, b2 = _problem(bias=True)
    with pytest.raises(ValueError, match="w1_bias must have shape"):
        fused_moe(x, w1, w2, tw, ti, w1_bias=b1[:, :-1])
    with pytest.raises(ValueError, match="w2_bias must have shape"):
        fused_moe(x, w1, w2, tw, ti, w2_bias=b2.T.contiguous())
    with pytest.raises(TypeError, match="w2_bias must have hidden_states' dtype"):
        fused_moe(x, w1, w2, tw, ti, w2_bias=b2.double())
    with pytest.raises(TypeError, match="w1_bias must be a torch.Tensor"):
        fused_moe(x, w1, w2, tw, ti, w1_bias=[0.0])
    with pytest.raises(ValueError, match="activation must be one of"):
        fused_moe(x, w1, w2, tw, ti, activation="swiglu")


def test_layer_with_biases_problem_flag():
    layer = FusedMoE(4, 2, 32, 16, expert_bias=True, activation="swigluoai")
    assert layer.problem(3).has_bias and layer.problem(3).activation == "swigluoai"
    assert not FusedMoE(4, 2, 32, 16).problem(3).has_bias
    assert "swigluoai" in fusedmoe.problem.ACTIVATIONS
