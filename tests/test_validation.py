"""Argument validation of fused_moe, FusedMoE, WorkspaceManager and caller workspaces: every bad input raises
a typed error naming the argument, before any work (the manager serves no call) and without reading tensor
data (the same error is raised for tensors on the meta device); value checks only with checks="full"; the
manager is still usable and correct afterwards."""

from __future__ import annotations

import pytest
import torch

from fusedmoe import FusedMoE, WorkspaceFrozenError, WorkspaceManager, fused_moe, get_kernel
from fusedmoe.reference import fused_moe_reference, relative_error

M, H, I, E, K = 8, 40, 24, 4, 2


def good_args(device="cpu", m=M, seed=0):
    """Valid fused_moe arguments (float32, distinct ids), as a dict."""
    g = torch.Generator().manual_seed(seed)
    args = {
        "hidden_states": torch.randn(m, H, generator=g),
        "w1": torch.randn(E, 2 * I, H, generator=g) / H**0.5,
        "w2": torch.randn(E, H, I, generator=g) / I**0.5,
        "topk_weights": torch.rand(m, K, generator=g) + 0.1,
        "topk_ids": torch.rand(m, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32),
    }
    return {k: v.to(device) for k, v in args.items()}


def plan_nbytes(m=M):
    from fusedmoe import MoEProblem

    p = MoEProblem(M=m, H=H, I=I, E=E, global_E=E, top_k=K, dtype=torch.float32, weight_dtype=torch.float32)
    return get_kernel("torch").plan(p)


def assert_still_correct(mgr, seed=1):
    """The manager serves a correct call after the error (its state was not damaged)."""
    args = good_args(seed=seed)
    out = fused_moe(**args, backend="torch", workspace=mgr)
    ref = fused_moe_reference(*args.values())
    assert relative_error(out, ref) < 1e-5


def expect_error(exc, match, mgr=None, **overrides):
    """fused_moe with ``overrides`` raises exactly ``exc`` (not the other of TypeError/ValueError), message
    matching ``match``, and the manager serves no call; then the same manager still works."""
    mgr = mgr or WorkspaceManager("cpu")
    before = (mgr.stats.calls, mgr.stats.device_allocations, mgr.stats.reserved_bytes, mgr.stats.peak_bytes)
    args = good_args()
    extra = {k: v for k, v in overrides.items() if k not in args}
    args.update({k: v for k, v in overrides.items() if k in args})
    extra.setdefault("backend", "torch")
    with pytest.raises(exc, match=match) as info:
        fused_moe(**args, workspace=mgr, **extra)
    other = TypeError if issubclass(exc, ValueError) else ValueError
    assert not isinstance(info.value, other), f"{type(info.value).__name__} is also a {other.__name__}"
    after = (mgr.stats.calls, mgr.stats.device_allocations, mgr.stats.reserved_bytes, mgr.stats.peak_bytes)
    assert after == before, "the error was raised after the manager did work"
    assert_still_correct(mgr)
    return info.value


def meta(t):
    return t.to("meta")


# (id, overrides as a function of the good args, exception, message regex, also checkable on meta)
STRUCTURAL = [
    ("hidden_not_tensor", lambda a: {"hidden_states": a["hidden_states"].tolist()}, TypeError, "hidden_states", False),
    ("hidden_3d", lambda a: {"hidden_states": a["hidden_states"][None]}, ValueError, "hidden_states", True),
    ("hidden_int", lambda a: {"hidden_states": a["hidden_states"].to(torch.int32)}, TypeError, "hidden_states", True),
    ("num_experts_0", lambda a: {"w1": a["w1"][:0], "w2": a["w2"][:0]}, ValueError, "num_experts", True),
    ("w1_w2_disagree_on_E", lambda a: {"w2": a["w2"][:3]}, ValueError, "w1 and w2", True),
    ("w1_2d", lambda a: {"w1": a["w1"][0]}, ValueError, "w1", True),
    (
        "top_k_0",
        lambda a: {"topk_ids": a["topk_ids"][:, :0], "topk_weights": a["topk_weights"][:, :0]},
        ValueError,
        "top_k.*topk_ids",
        True,
    ),
    (
        "top_k_gt_E",
        lambda a: {
            "topk_ids": torch.arange(E + 1, dtype=torch.int32).repeat(M, 1).to(a["w1"].device),
            "topk_weights": torch.rand(M, E + 1).to(a["w1"].device),
        },
        ValueError,
        "top_k.*topk_ids",
        True,
    ),
    (
        "H_hidden_vs_w",
        lambda a: {"hidden_states": torch.randn(M, H + 4).to(a["w1"].device)},
        ValueError,
        r"w1.*H=44.*hidden_states",
        True,
    ),
    ("H_w1", lambda a: {"w1": torch.randn(E, 2 * I, H - 1).to(a["w1"].device)}, ValueError, r"w1 must be", True),
    ("H_w2", lambda a: {"w2": torch.randn(E, H + 1, I).to(a["w1"].device)}, ValueError, r"w2 must be", True),
    (
        "w1_rows_not_2I",
        lambda a: {"w1": torch.randn(E, 2 * I + 2, H).to(a["w1"].device)},
        ValueError,
        r"w1 rows must be 2 x w2",
        True,
    ),
    ("w1_rows_eq_I", lambda a: {"w1": torch.randn(E, I, H).to(a["w1"].device)}, ValueError, r"w1 rows", True),
    ("weights_bf16", lambda a: {"w1": a["w1"].bfloat16(), "w2": a["w2"].bfloat16()}, TypeError, r"w1/w2 dtype", True),
    ("w2_f16", lambda a: {"w2": a["w2"].half()}, TypeError, r"w1/w2 dtype", True),
    ("topk_ids_rows", lambda a: {"topk_ids": a["topk_ids"][:-1]}, ValueError, "topk_ids", True),
    ("topk_ids_1d", lambda a: {"topk_ids": a["topk_ids"][:, 0]}, ValueError, "topk_ids", True),
    ("topk_ids_float", lambda a: {"topk_ids": a["topk_ids"].float()}, TypeError, "topk_ids", True),
    ("topk_ids_int16", lambda a: {"topk_ids": a["topk_ids"].to(torch.int16)}, TypeError, "topk_ids", True),
    ("topk_weights_shape", lambda a: {"topk_weights": a["topk_weights"][:, :1]}, ValueError, "topk_weights", True),
    ("topk_weights_int", lambda a: {"topk_weights": a["topk_ids"].clone()}, TypeError, "topk_weights", True),
    (
        "expert_map_len",
        lambda a: {
            "expert_map": torch.arange(2 * E - 1, dtype=torch.int32).to(a["w1"].device),
            "global_num_experts": 2 * E,
        },
        ValueError,
        "expert_map",
        True,
    ),
    (
        "expert_map_2d",
        lambda a: {"expert_map": torch.arange(E, dtype=torch.int32)[None].to(a["w1"].device)},
        ValueError,
        "expert_map",
        True,
    ),
    (
        "expert_map_float",
        lambda a: {"expert_map": torch.arange(E, dtype=torch.float32).to(a["w1"].device)},
        TypeError,
        "expert_map",
        True,
    ),
    ("global_E_without_map", lambda a: {"global_num_experts": 2 * E}, ValueError, "global_num_experts", True),
    ("global_E_zero", lambda a: {"global_num_experts": 0}, ValueError, "global_num_experts", True),
    ("activation", lambda a: {"activation": "relu"}, ValueError, "activation", True),
    (
        "on_input_not_bool",
        lambda a: {"apply_router_weight_on_input": 1},
        TypeError,
        "apply_router_weight_on_input",
        True,
    ),
    ("backend", lambda a: {"backend": "cuda"}, ValueError, "backend", True),
    ("checks_level", lambda a: {"checks": "paranoid"}, ValueError, "checks", True),
    ("w1_scale_without_quant", lambda a: {"w1_scale": torch.ones(E).to(a["w1"].device)}, ValueError, "w1_scale", True),
    ("a2_scale_without_quant", lambda a: {"a2_scale": torch.ones(1).to(a["w1"].device)}, ValueError, "a2_scale", True),
    # another device: meta plays "the other device"
    ("w1_other_device", lambda a: {"w1": meta(a["w1"])}, ValueError, "w1.*meta", False),
    ("w2_other_device", lambda a: {"w2": meta(a["w2"])}, ValueError, "w2.*meta", False),
    ("topk_ids_other_device", lambda a: {"topk_ids": meta(a["topk_ids"])}, ValueError, "topk_ids.*meta", False),
    (
        "topk_weights_other_device",
        lambda a: {"topk_weights": meta(a["topk_weights"])},
        ValueError,
        "topk_weights.*meta",
        False,
    ),
    (
        "expert_map_other_device",
        lambda a: {"expert_map": torch.arange(E, dtype=torch.int32, device="meta")},
        ValueError,
        "expert_map.*meta",
        False,
    ),
]


@pytest.mark.parametrize("make,exc,match", [pytest.param(*c[1:4], id=c[0]) for c in STRUCTURAL])
def test_structural_errors_cpu(make, exc, match):
    """Each malformed argument raises the documented exception type naming it, before the manager works."""
    expect_error(exc, match, **make(good_args()))


@pytest.mark.parametrize("make,exc,match", [pytest.param(*c[1:4], id=c[0]) for c in STRUCTURAL if c[4]])
def test_structural_errors_on_meta(make, exc, match):
    """The same checks fire on meta tensors, which have no data: validation reads no values (no host sync)."""
    args = good_args("meta")
    overrides = make(args)
    args.update({k: v for k, v in overrides.items() if k in args})
    extra = {k: v for k, v in overrides.items() if k not in args}
    extra.setdefault("backend", "torch")
    with pytest.raises(exc, match=match):
        fused_moe(**args, **extra)


def test_meta_inputs_validate_cleanly():
    """Sanity for the meta tests: well-formed meta inputs pass validation (the failure comes later, in compute,
    not as a validation error)."""
    from fusedmoe.checks import check_fused_moe_args

    a = good_args("meta")
    p = check_fused_moe_args(
        *a.values(),
        activation="silu",
        apply_router_weight_on_input=False,
        expert_map=None,
        global_num_experts=None,
        quant=None,
        w1_scale=None,
        w2_scale=None,
        a1_scale=None,
        a2_scale=None,
    )
    assert (p.M, p.H, p.I, p.E, p.top_k) == (M, H, I, E, K)


# ---- managers and workspaces ---------------------------------------------------------------------------------
def test_workspace_not_a_manager():
    """workspace= must be a WorkspaceManager (TypeError naming it)."""
    with pytest.raises(TypeError, match="workspace"):
        fused_moe(**good_args(), workspace="shared", backend="torch")


def test_manager_on_other_device():
    """A manager for another device is refused (ValueError naming both devices)."""
    with pytest.raises(ValueError, match="meta.*cpu"):
        fused_moe(**good_args(), workspace=WorkspaceManager("meta"), backend="torch")


@pytest.mark.parametrize("strategy", ["pool", "", "SHARED", None])
def test_bad_strategy(strategy):
    """Unknown strategies are rejected by the manager's constructor."""
    with pytest.raises(ValueError, match="strategy"):
        WorkspaceManager("cpu", strategy=strategy)


def big_ws(nbytes=None, dtype=torch.float32, fill=0xAB):
    nbytes = plan_nbytes().nbytes + 64 if nbytes is None else nbytes
    size = torch.empty((), dtype=dtype).element_size()
    t = torch.empty(-(-nbytes // size), dtype=dtype)
    t.view(torch.uint8).fill_(fill)
    return t


def test_workspace13_too_small_states_bytes():
    """A too-small workspace13 is a ValueError naming it and stating bytes needed and held."""
    need = plan_nbytes().nbytes
    err = expect_error(ValueError, "workspace13 is too small", workspace13=big_ws(100, torch.uint8))
    assert str(need) in str(err) and "100 bytes" in str(err)


def test_workspace2_too_small_and_nothing_written():
    """A too-small workspace2 is refused naming it, and the valid workspace13 was not written to."""
    p = plan_nbytes()
    ws13 = big_ws(p.region_nbytes["13"] + 64)
    snapshot = ws13.clone()
    err = expect_error(ValueError, "workspace2 is too small", workspace13=ws13, workspace2=big_ws(64))
    assert str(p.region_nbytes["2"]) in str(err)
    assert torch.equal(ws13.view(torch.uint8), snapshot.view(torch.uint8))


@pytest.mark.parametrize("which", ["workspace13", "workspace2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.bfloat16], ids=["f64", "i32", "bf16"])
def test_workspace_wrong_dtype(which, dtype):
    """A workspace that is neither hidden_states' dtype nor uint8 is a TypeError naming it."""
    kw = {"workspace13": big_ws(), "workspace2": big_ws()}
    kw[which] = big_ws(dtype=dtype)
    expect_error(TypeError, which, **kw)


@pytest.mark.parametrize("which", ["workspace13", "workspace2"])
def test_workspace_wrong_device(which):
    """A workspace on another device is a ValueError naming it."""
    kw = {"workspace13": big_ws(), "workspace2": big_ws()}
    kw[which] = torch.empty(kw[which].shape, device="meta")
    expect_error(ValueError, f"{which}.*meta", **kw)


@pytest.mark.parametrize("which", ["workspace13", "workspace2"])
def test_workspace_non_contiguous(which):
    """A non-contiguous workspace is a ValueError naming it."""
    kw = {"workspace13": big_ws(), "workspace2": big_ws()}
    kw[which] = big_ws(2 * kw[which].numel() * 4).view(-1, 2)[:, 0]
    expect_error(ValueError, f"{which}.*contiguous", **kw)


def test_workspace_not_a_tensor():
    """A workspace must be a tensor (TypeError naming it)."""
    expect_error(TypeError, "workspace13", workspace13=bytearray(100000))


def test_workspace2_without_workspace13():
    """workspace2 alone is refused, naming both arguments."""
    expect_error(ValueError, "workspace2.*workspace13", workspace2=big_ws())


def test_workspace_overlapping_hidden_states():
    """workspace13 sharing storage with hidden_states is refused (it would overwrite the input)."""
    a = good_args()
    storage = torch.empty(M * H + plan_nbytes().nbytes)
    storage[: M * H] = a["hidden_states"].flatten()
    hidden = storage[: M * H].view(M, H)
    expect_error(ValueError, "workspace13 overlaps hidden_states", hidden_states=hidden, workspace13=storage)
    # the tail of the same storage (disjoint from hidden) is fine
    ws13 = storage[M * H :]
    out = fused_moe(hidden, a["w1"], a["w2"], a["topk_weights"], a["topk_ids"], backend="torch", workspace13=ws13)
    assert relative_error(out, fused_moe_reference(*a.values())) < 1e-5


@pytest.mark.parametrize("victim", ["w1", "w2", "topk_weights", "topk_ids"])
def test_workspace_overlapping_other_inputs(victim):
    """A workspace (as uint8 bytes) aliasing any input tensor is refused, naming it."""
    a = good_args()
    t = a[victim]
    storage = torch.empty(t.numel() * t.element_size() + plan_nbytes().nbytes + 64, dtype=torch.uint8)
    view = storage[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    view.copy_(t)
    expect_error(ValueError, f"workspace13 overlaps {victim}", **{victim: view, "workspace13": storage})


def test_workspace_overlapping_expert_map():
    """A workspace aliasing the expert_map (an input) is refused like any other input."""
    a = good_args()
    storage = torch.empty(4 * E + plan_nbytes().nbytes + 64, dtype=torch.uint8)
    emap = storage[: 4 * E].view(torch.int32)
    emap.copy_(torch.arange(E, dtype=torch.int32))
    with pytest.raises(ValueError, match="workspace13 overlaps expert_map"):
        fused_moe(**a, expert_map=emap, backend="torch", workspace13=storage)


def test_workspaces_overlapping_each_other():
    """workspace13 and workspace2 must not share bytes."""
    s = big_ws(4 * plan_nbytes().nbytes)
    expect_error(ValueError, "workspace13 and workspace2 overlap", workspace13=s, workspace2=s[10:])


def test_frozen_growth_before_any_work():
    """A call that would grow a frozen arena raises WorkspaceFrozenError (a ValueError) with bytes needed and
    available; the manager's counters are untouched and it still serves in-size calls correctly."""
    mgr = WorkspaceManager("cpu")
    mgr.reserve(plan_nbytes(M))
    mgr.freeze()
    assert_still_correct(mgr)  # in size: fine
    big = good_args(m=4 * M)
    need = plan_nbytes(4 * M).nbytes
    before = (mgr.stats.calls, mgr.stats.peak_bytes, mgr.stats.reserved_bytes, mgr.stats.device_allocations)
    with pytest.raises(WorkspaceFrozenError, match=f"{plan_nbytes(M).nbytes} bytes.*{need} bytes"):
        fused_moe(**big, backend="torch", workspace=mgr)
    after = (mgr.stats.calls, mgr.stats.peak_bytes, mgr.stats.reserved_bytes, mgr.stats.device_allocations)
    assert after == before
    assert_still_correct(mgr)


# ---- value checks --------------------------------------------------------------------------------------------
def _bad_ids():
    a = good_args()
    a["topk_ids"][0, 0] = -1
    a["topk_ids"][3, 1] = E
    return a


@pytest.mark.parametrize("how", ["argument", "env"])
def test_out_of_range_ids_with_full_checks(how, monkeypatch):
    """With full checks, out-of-range ids raise a ValueError naming topk_ids (before any work)."""
    kw = {}
    if how == "argument":
        kw["checks"] = "full"
    else:
        monkeypatch.setenv("FUSEDMOE_CHECKS", "full")
    mgr = WorkspaceManager("cpu")
    with pytest.raises(ValueError, match="topk_ids") as info:
        fused_moe(**_bad_ids(), backend="torch", workspace=mgr, **kw)
    assert not isinstance(info.value, TypeError)
    assert mgr.stats.calls == 0
    assert_still_correct(mgr)


def test_out_of_range_ids_without_full_checks_are_non_local(monkeypatch):
    """Without full checks (default and checks="basic"), out-of-range ids are non-local: the reference result."""
    monkeypatch.delenv("FUSEDMOE_CHECKS", raising=False)
    a = _bad_ids()
    ref = fused_moe_reference(*a.values())
    for kw in ({}, {"checks": "basic"}):
        out = fused_moe(**a, backend="torch", workspace=WorkspaceManager("cpu"), **kw)
        assert relative_error(out, ref) < 1e-5
    monkeypatch.setenv("FUSEDMOE_CHECKS", "basic")
    out = fused_moe(**a, backend="torch", workspace=WorkspaceManager("cpu"))
    assert relative_error(out, ref) < 1e-5


def test_bad_checks_env(monkeypatch):
    """An unknown FUSEDMOE_CHECKS level is a ValueError naming the variable, before any work."""
    mgr = WorkspaceManager("cpu")
    monkeypatch.setenv("FUSEDMOE_CHECKS", "paranoid")
    with pytest.raises(ValueError, match="FUSEDMOE_CHECKS"):
        fused_moe(**good_args(), backend="torch", workspace=mgr)
    assert mgr.stats.calls == 0
    monkeypatch.delenv("FUSEDMOE_CHECKS")
    assert_still_correct(mgr)


def test_nonfinite_weights_with_full_checks():
    """Full checks reject NaN/inf routing weights (ValueError naming topk_weights)."""
    a = good_args()
    a["topk_weights"][2, 1] = float("nan")
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(**a, backend="torch", workspace=WorkspaceManager("cpu"), checks="full")


@pytest.mark.parametrize(
    "emap",
    [[0, 1, 2, 3, -2, -1, -1, -1], [0, 1, 2, 4, -1, -1, -1, -1], [0, 1, 2, 2, 3, -1, -1, -1], [0, 1, 2, -1] + [-1] * 4],
    ids=["below_minus_1", "local_id_too_big", "duplicate_local", "too_few_local"],
)
def test_inconsistent_expert_map_with_full_checks(emap):
    """Full checks reject expert_maps that are not a bijection onto the local experts (ValueError naming it)."""
    a = good_args()
    mgr = WorkspaceManager("cpu")
    with pytest.raises(ValueError, match="expert_map"):
        fused_moe(
            **a,
            expert_map=torch.tensor(emap, dtype=torch.int32),
            global_num_experts=8,
            backend="torch",
            workspace=mgr,
            checks="full",
        )
    assert mgr.stats.calls == 0


def test_valid_expert_map_passes_full_checks():
    """A consistent expert_map passes full checks and matches the reference."""
    a = good_args()
    emap = torch.tensor([-1, 3, -1, 0, 2, -1, 1, -1], dtype=torch.int32)
    a["topk_ids"] = torch.tensor([[1, 3], [4, 6], [0, 2]] * 3, dtype=torch.int32)[:M]
    out = fused_moe(
        **a, expert_map=emap, global_num_experts=8, backend="torch", workspace=WorkspaceManager("cpu"), checks="full"
    )
    ref = fused_moe_reference(*a.values(), expert_map=emap, global_num_experts=8)
    assert relative_error(out, ref) < 1e-5


# ---- FusedMoE constructor ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        pytest.param({"num_experts": 0}, ValueError, "num_experts", id="num_experts_0"),
        pytest.param({"num_experts": -3}, ValueError, "num_experts", id="num_experts_neg"),
        pytest.param({"num_experts": 4.0}, TypeError, "num_experts", id="num_experts_float"),
        pytest.param({"top_k": 0}, ValueError, "top_k", id="top_k_0"),
        pytest.param({"top_k": 5}, ValueError, "top_k", id="top_k_gt_E"),
        pytest.param({"hidden_size": 0}, ValueError, "hidden_size", id="hidden_0"),
        pytest.param({"intermediate_size": -1}, ValueError, "intermediate_size", id="intermediate_neg"),
        pytest.param({"activation": "relu"}, ValueError, "activation", id="activation"),
        pytest.param({"num_shared_experts": -1}, ValueError, "num_shared_experts", id="shared_neg"),
        pytest.param({"workspace": "shared"}, TypeError, "workspace", id="workspace_type"),
        pytest.param({"scoring": "argmax"}, ValueError, "scoring", id="scoring"),
        pytest.param({"num_expert_groups": 3, "topk_groups": 1}, ValueError, "num_expert_groups", id="groups"),
    ],
)
def test_layer_constructor_errors(kwargs, exc, match):
    """FusedMoE rejects bad settings at construction, with the documented exception type naming the setting."""
    base = {"num_experts": E, "top_k": K, "hidden_size": H, "intermediate_size": I}
    base.update(kwargs)
    with pytest.raises(exc, match=match) as info:
        FusedMoE(**base)
    other = TypeError if issubclass(exc, ValueError) else ValueError
    assert not isinstance(info.value, other)


@pytest.mark.parametrize(
    "exc,match,make_x,make_logits",
    [
        pytest.param(ValueError, "hidden_size", lambda x: torch.randn(5, H + 1), None, id="wrong_H"),
        pytest.param(TypeError, "dtype", lambda x: x.bfloat16(), None, id="wrong_dtype"),
        pytest.param(ValueError, "meta", lambda x: x.to("meta"), None, id="other_device"),
        pytest.param(TypeError, "dtype", lambda x: x.bfloat16(), lambda x: torch.randn(5, E), id="wrong_dtype_logits"),
        pytest.param(ValueError, "router_logits", lambda x: x, lambda x: torch.randn(5, E + 1), id="logits_E"),
        pytest.param(ValueError, "router_logits", lambda x: x, lambda x: torch.randn(6, E), id="logits_rows"),
        pytest.param(TypeError, "hidden_states", lambda x: x.tolist(), None, id="not_tensor"),
    ],
)
def test_layer_forward_errors_leave_manager_usable(exc, match, make_x, make_logits):
    """Bad forward inputs raise the documented error before the manager works; the layer still works after."""
    mgr = WorkspaceManager("cpu")
    layer = FusedMoE(E, K, H, I, workspace=mgr, backend="torch")
    x = torch.randn(5, H)
    with pytest.raises(exc, match=match):
        layer(make_x(x), make_logits(x) if make_logits else None)
    assert mgr.stats.calls == 0
    out = layer(x)
    w, ids = layer.route(x)
    ref = fused_moe_reference(x, layer.w1, layer.w2, w, ids)
    assert relative_error(out, ref) < 1e-5
