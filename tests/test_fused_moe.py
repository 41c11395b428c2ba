"""fused_moe (torch backend, CPU) against the float64 reference over a grid of shapes, routings, activations,
expert maps and degenerate id patterns; and bit-identity across workspace strategies, poison mode and
caller-provided workspaces (reused across calls of different M)."""

from __future__ import annotations

import math

import pytest
import torch

import fusedmoe
from fusedmoe import STRATEGIES, WorkspaceManager, fused_moe, get_kernel, route
from fusedmoe.reference import fused_moe_reference, relative_error

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
H, I = 40, 24  # not multiples of 16


def make_weights(E, H=H, I=I, dtype=torch.float32, seed=0):
    """Random w1 [E, 2I, H], w2 [E, H, I] scaled to keep activations O(1)."""
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / math.sqrt(I)).to(dtype)
    return w1, w2


def random_routing(M, E, k, seed=0, id_dtype=torch.int32):
    """k distinct random ids in [0, E) per token and random positive weights."""
    g = torch.Generator().manual_seed(seed + 1000)
    ids = torch.rand(M, E, generator=g).argsort(dim=1)[:, :k].to(id_dtype)
    weights = torch.rand(M, k, generator=g) + 0.05
    return weights, ids


def make_hidden(M, H=H, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + 2000)
    return torch.randn(M, H, generator=g).to(dtype)


def half_local_map(global_E, seed=0):
    """expert_map with a random half of the experts local (-1 elsewhere), local ids 0..global_E/2-1."""
    g = torch.Generator().manual_seed(seed + 3000)
    perm = torch.randperm(global_E, generator=g)
    local = global_E // 2
    emap = torch.full((global_E,), -1, dtype=torch.int32)
    emap[perm[:local]] = torch.arange(local, dtype=torch.int32)
    return emap


def check_close(out, ref, dtype):
    assert out.dtype == dtype
    assert out.shape == ref.shape
    err = relative_error(out, ref)
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]}"


def run_both(x, w1, w2, weights, ids, dtype=torch.float32, **kw):
    """fused_moe (torch backend, fresh shared manager) vs the float64 reference; returns the output."""
    mgr = WorkspaceManager("cpu")
    out = fused_moe(x, w1, w2, weights, ids, backend="torch", workspace=mgr, **kw)
    ref = fused_moe_reference(x, w1, w2, weights, ids, **kw)
    if x.shape[0] == 0:
        assert out.shape == (0, x.shape[1]) and out.dtype == x.dtype
    else:
        check_close(out, ref, dtype)
    return out


# ---- the grid ------------------------------------------------------------------------------------------------
def _grid():
    cases = []
    for M in (0, 1, 7, 64, 300):
        for E in (1, 4, 16, 64):
            for k in sorted({1, 2, E}):
                if k > E:
                    continue
                variants = [("silu", False), ("silu", True), ("gelu", False), ("gelu", True)]
                if M * k >= 4096:  # the big E=64/k=64 cells: two variants keep the file fast
                    variants = [("silu", False), ("gelu", True)]
                for act, on_input in variants:
                    tag = f"M{M}-E{E}-k{k}-{act}" + ("-oninput" if on_input else "")
                    cases.append(pytest.param(M, E, k, act, on_input, id=tag))
    return cases


@pytest.mark.parametrize("M,E,k,activation,on_input", _grid())
def test_grid_matches_reference_f32(M, E, k, activation, on_input):
    """float32 fused_moe equals the float64 reference (rel. Frobenius < 1e-5) across M, E, top-k, activations."""
    seed = M * 7919 + E * 31 + k
    w1, w2 = make_weights(E, seed=seed)
    x = make_hidden(M, seed=seed)
    weights, ids = random_routing(M, E, k, seed=seed)
    run_both(x, w1, w2, weights, ids, activation=activation, apply_router_weight_on_input=on_input)


@pytest.mark.parametrize(
    "M,E,k,activation,on_input",
    [
        pytest.param(64, 16, 2, "silu", False, id="M64-E16-k2-silu"),
        pytest.param(300, 4, 2, "gelu", True, id="M300-E4-k2-gelu-oninput"),
        pytest.param(7, 64, 64, "silu", True, id="M7-E64-k64-silu-oninput"),
        pytest.param(1, 1, 1, "gelu", False, id="M1-E1-k1-gelu"),
    ],
)
def test_bf16_matches_reference(M, E, k, activation, on_input):
    """bf16 fused_moe is within 2e-2 of the float64 reference."""
    w1, w2 = make_weights(E, dtype=torch.bfloat16, seed=E)
    x = make_hidden(M, dtype=torch.bfloat16, seed=M)
    weights, ids = random_routing(M, E, k, seed=M + E)
    run_both(
        x, w1, w2, weights, ids, dtype=torch.bfloat16, activation=activation, apply_router_weight_on_input=on_input
    )


@pytest.mark.parametrize("shape", [(36, 20), (17, 5), (128, 64)], ids=["H36-I20", "H17-I5", "H128-I64"])
def test_other_hidden_and_intermediate_sizes(shape):
    """Odd H / I (and an aligned one) work."""
    h, i = shape
    w1, w2 = make_weights(8, H=h, I=i, seed=h)
    x = make_hidden(33, H=h, seed=i)
    weights, ids = random_routing(33, 8, 3, seed=h + i)
    run_both(x, w1, w2, weights, ids)


@pytest.mark.parametrize("M", [1, 64, 300])
@pytest.mark.parametrize("E,k", [(8, 2), (16, 4), (64, 6)], ids=["E8k2", "E16k4", "E64k6"])
def test_routed_with_route(M, E, k):
    """Ids and weights from fusedmoe.route (softmax, renormalized) give the reference result."""
    g = torch.Generator().manual_seed(M + E)
    logits = torch.randn(M, E, generator=g)
    weights, ids = route(logits, k)
    w1, w2 = make_weights(E, seed=k)
    run_both(make_hidden(M, seed=E), w1, w2, weights, ids)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_id_dtypes(id_dtype):
    """int32 and int64 topk_ids give the same (correct) result."""
    w1, w2 = make_weights(16)
    x = make_hidden(50)
    weights, ids = random_routing(50, 16, 3, id_dtype=id_dtype)
    out = run_both(x, w1, w2, weights, ids)
    out32 = fused_moe(x, w1, w2, weights, ids.to(torch.int32), backend="torch", workspace=WorkspaceManager("cpu"))
    assert torch.equal(out, out32)


# ---- expert maps and odd id patterns -------------------------------------------------------------------------
@pytest.mark.parametrize("M", [1, 7, 64])
@pytest.mark.parametrize("global_E", [4, 16, 64])
@pytest.mark.parametrize("k_kind", ["k1", "k2", "k_gt_local"])
@pytest.mark.parametrize("activation,on_input", [("silu", False), ("gelu", True)], ids=["silu", "gelu-oninput"])
def test_expert_map_half_local(M, global_E, k_kind, activation, on_input):
    """With an expert_map leaving half the experts remote (w1/w2 hold the local half), only local slots count."""
    k = {"k1": 1, "k2": 2, "k_gt_local": global_E // 2 + 1}[k_kind]
    seed = M + global_E + k
    emap = half_local_map(global_E, seed=seed)
    w1, w2 = make_weights(global_E // 2, seed=seed)
    x = make_hidden(M, seed=seed)
    weights, ids = random_routing(M, global_E, k, seed=seed)
    run_both(
        x,
        w1,
        w2,
        weights,
        ids,
        expert_map=emap,
        global_num_experts=global_E,
        activation=activation,
        apply_router_weight_on_input=on_input,
    )


def test_expert_map_every_slot_remote():
    """Tokens routed only to remote experts get exactly zero output."""
    emap = half_local_map(16)
    remote = torch.nonzero(emap < 0).flatten()
    w1, w2 = make_weights(8)
    x = make_hidden(20)
    ids = remote[torch.randint(0, remote.numel(), (20, 2))].to(torch.int32)
    weights = torch.rand(20, 2) + 0.1
    out = fused_moe(
        x,
        w1,
        w2,
        weights,
        ids,
        expert_map=emap,
        global_num_experts=16,
        backend="torch",
        workspace=WorkspaceManager("cpu"),
    )
    assert torch.equal(out, torch.zeros_like(out))


def test_all_tokens_on_one_expert():
    """Every token routed to the same expert (k=1) and to one shared expert plus others (k=3)."""
    E = 16
    w1, w2 = make_weights(E)
    x = make_hidden(200)
    ids = torch.full((200, 1), 5, dtype=torch.int32)
    run_both(x, w1, w2, torch.rand(200, 1) + 0.1, ids)
    weights, ids3 = random_routing(200, E - 1, 3)
    ids3 = torch.where(ids3 >= 5, ids3 + 1, ids3)  # never 5 in the random part, so ids stay distinct
    ids3[:, 1] = 5
    run_both(x, w1, w2, weights, ids3, activation="gelu")


def test_experts_without_tokens():
    """Only experts 0 and 11 of 16 receive tokens; the others (no tokens) contribute nothing and cause no error."""
    w1, w2 = make_weights(16)
    x = make_hidden(40)
    ids = torch.stack([torch.zeros(40), torch.full((40,), 11)], dim=1).to(torch.int32)
    weights = torch.rand(40, 2) + 0.1
    run_both(x, w1, w2, weights, ids)
    # the last expert only
    run_both(x, w1, w2, weights[:, :1], torch.full((40, 1), 15, dtype=torch.int32))


@pytest.mark.parametrize("use_map", [False, True], ids=["no_map", "expert_map"])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_out_of_range_ids_are_non_local(use_map, id_dtype):
    """Negative ids and ids >= global E never crash and are treated as non-local, as the reference does."""
    global_E = 16
    E = global_E // 2 if use_map else global_E
    emap = half_local_map(global_E) if use_map else None
    w1, w2 = make_weights(E)
    M, k = 64, 3
    x = make_hidden(M)
    weights, ids = random_routing(M, global_E, k, id_dtype=id_dtype)
    bad = [-1, -7, global_E, global_E + 1, 1000, torch.iinfo(torch.int32).max, torch.iinfo(torch.int32).min]
    if id_dtype == torch.int64:
        bad += [2**40, -(2**40)]
    for j, v in enumerate(bad):
        ids[j * 3 % M, j % k] = v
    ids[M - 1] = torch.tensor([-1, global_E, -2])  # one token with no valid slot at all
    kw = {"expert_map": emap, "global_num_experts": global_E} if use_map else {}
    out = run_both(x, w1, w2, weights, ids, **kw)
    assert torch.equal(out[M - 1], torch.zeros(H))


def test_id_equal_to_num_experts_is_non_local():
    """The first out-of-range id (== E) and small negatives are dropped, not read past w1's end."""
    w1, w2 = make_weights(4)
    x = make_hidden(9)
    weights, ids = random_routing(9, 4, 2)
    ids[0, 0] = 4
    ids[1, 1] = -3
    run_both(x, w1, w2, weights, ids)


# ---- strategies, poison, caller workspaces -------------------------------------------------------------------
def _cases():
    """A few problems covering maps, odd ids, on-input weights and bf16, for the bit-identity tests."""
    out = []
    for name, M, E, k, dtype, act, on_input, use_map in [
        ("f32-M64-E8-k2", 64, 8, 2, torch.float32, "silu", False, False),
        ("f32-M7-E16-k16-gelu-oninput", 7, 16, 16, torch.float32, "gelu", True, False),
        ("f32-M300-map16-k3", 300, 16, 3, torch.float32, "silu", False, True),
        ("bf16-M33-E4-k2-oninput", 33, 4, 2, torch.bfloat16, "silu", True, False),
        ("f32-M0", 0, 8, 2, torch.float32, "silu", False, False),
    ]:
        out.append(pytest.param(M, E, k, dtype, act, on_input, use_map, id=name))
    return out


def _problem(M, E, k, dtype, use_map, seed=0):
    global_E = E
    kw = {}
    if use_map:
        kw = {"expert_map": half_local_map(E, seed=seed), "global_num_experts": E}
        E = E // 2
    w1, w2 = make_weights(E, dtype=dtype, seed=seed)
    x = make_hidden(M, dtype=dtype, seed=seed)
    weights, ids = random_routing(M, global_E, k, seed=seed)
    if M > 2:
        ids[1, 0] = -1
        ids[2, k - 1] = global_E + 3
    return (x, w1, w2, weights, ids), kw


@pytest.mark.parametrize("M,E,k,dtype,activation,on_input,use_map", _cases())
def test_strategies_and_poison_bit_identical(M, E, k, dtype, activation, on_input, use_map):
    """Every strategy, with and without poison, gives bit-identical output (and it matches the reference)."""
    args, kw = _problem(M, E, k, dtype, use_map)
    kw.update(activation=activation, apply_router_weight_on_input=on_input)
    outs = {}
    for strategy in STRATEGIES:
        for poison in (False, True):
            mgr = WorkspaceManager("cpu", strategy=strategy, poison=poison)
            # two calls: the second one reuses (persistent strategies) a dirty arena
            first = fused_moe(*args, backend="torch", workspace=mgr, **kw)
            second = fused_moe(*args, backend="torch", workspace=mgr, **kw)
            assert torch.equal(first, second), (strategy, poison)
            if poison and M:
                assert mgr.stats.poison_fills == 2
            outs[(strategy, poison)] = first
    base = outs[("shared", False)]
    for key, out in outs.items():
        assert torch.equal(out, base), key
    if M:
        check_close(base, fused_moe_reference(*args, **kw), dtype)


def test_poison_after_other_problem_in_same_arena():
    """A shared poisoned arena dirtied by a bigger problem still gives bit-identical results for a smaller one."""
    args_big, kw_big = _problem(300, 16, 4, torch.float32, False, seed=1)
    args, kw = _problem(37, 8, 2, torch.float32, True, seed=2)
    clean = fused_moe(*args, backend="torch", workspace=WorkspaceManager("cpu", strategy="alloc_zeros"), **kw)
    mgr = WorkspaceManager("cpu", poison=True)
    fused_moe(*args_big, backend="torch", workspace=mgr, **kw_big)
    assert torch.equal(fused_moe(*args, backend="torch", workspace=mgr, **kw), clean)


SEQ_M = [300, 1, 64, 7, 0, 150, 299, 2, 33, 128]


def _nan_filled(nbytes, dtype, shape_cols=7):
    """A caller buffer of at least ``nbytes`` (+16 alignment slack) in ``dtype``, 2-D, filled with NaN bits."""
    size = torch.empty((), dtype=dtype).element_size()
    numel = -(-(nbytes + 16) // size)
    rows = -(-numel // shape_cols)
    t = torch.empty(rows, shape_cols, dtype=dtype)
    t.view(torch.uint8).fill_(0xFF)  # all-ones bits: NaN in float32 / bf16
    if dtype.is_floating_point:
        assert torch.isnan(t).all()
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("buf_dtype", ["hidden", "uint8"])
@pytest.mark.parametrize("which", ["ws13_only", "ws13_and_ws2"])
def test_caller_workspaces_reused_across_calls(dtype, buf_dtype, which):
    """Caller buffers (NaN-filled, sized from the plan for max M) reused over 10 calls of different M give
    exactly the allocating path's result (the seed PR's regression test)."""
    E, k = 16, 3
    w1, w2 = make_weights(E, dtype=dtype, seed=5)
    p_max = fusedmoe.MoEProblem(M=max(SEQ_M), H=H, I=I, E=E, global_E=E, top_k=k, dtype=dtype, weight_dtype=dtype)
    plan = get_kernel("torch").plan(p_max)  # sized from the plan of the largest call
    bdtype = dtype if buf_dtype == "hidden" else torch.uint8
    if which == "ws13_only":
        ws13, ws2 = _nan_filled(plan.nbytes, bdtype), None
    else:
        ws13 = _nan_filled(plan.region_nbytes["13"], bdtype)
        ws2 = _nan_filled(plan.region_nbytes["2"], bdtype, shape_cols=3)
    alloc_mgr = WorkspaceManager("cpu", strategy="alloc_empty")
    for i, M in enumerate(SEQ_M):
        x = make_hidden(M, dtype=dtype, seed=i)
        weights, ids = random_routing(M, E, k, seed=i)
        out = fused_moe(x, w1, w2, weights, ids, backend="torch", workspace13=ws13, workspace2=ws2)
        ref_path = fused_moe(x, w1, w2, weights, ids, backend="torch", workspace=alloc_mgr)
        assert torch.equal(out, ref_path), f"call {i} (M={M})"
        if M:
            check_close(out, fused_moe_reference(x, w1, w2, weights, ids), dtype)
        # the output is not a view of the caller's buffers
        for w in (ws13, ws2):
            if w is not None and out.numel():
                lo, hi = w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()
                assert not (lo <= out.data_ptr() < hi)


def test_caller_workspace_exactly_sized_from_plan():
    """A uint8 workspace13 of exactly plan.nbytes bytes (16-byte aligned storage) is enough."""
    E, k, M = 8, 2, 45
    w1, w2 = make_weights(E)
    x = make_hidden(M)
    weights, ids = random_routing(M, E, k)
    p = fusedmoe.MoEProblem(M=M, H=H, I=I, E=E, global_E=E, top_k=k, dtype=torch.float32, weight_dtype=torch.float32)
    plan = get_kernel("torch").plan(p)
    backing = torch.full((plan.nbytes + 64,), 0xFF, dtype=torch.uint8)
    skip = (-backing.data_ptr()) % 16
    ws13 = backing[skip : skip + plan.nbytes]
    assert ws13.data_ptr() % 16 == 0
    out = fused_moe(x, w1, w2, weights, ids, backend="torch", workspace13=ws13)
    assert torch.equal(out, fused_moe(x, w1, w2, weights, ids, backend="torch", workspace=WorkspaceManager("cpu")))
    # the bytes after the workspace were not touched
    assert (backing[skip + plan.nbytes :] == 0xFF).all() and (backing[:skip] == 0xFF).all()


def test_non_contiguous_inputs_and_weight_dtypes():
    """Strided hidden_states / weights / routing tensors and float64/bf16 routing weights give the reference."""
    M, E, k = 33, 8, 3
    x = make_hidden(M, H=2 * H)[:, ::2]
    g = torch.Generator().manual_seed(9)
    w1 = (torch.randn(E, H, 2 * I, generator=g) / H**0.5).transpose(1, 2)
    w2 = (torch.randn(E, I, H, generator=g) / I**0.5).transpose(1, 2)
    ids = torch.rand(E, M, generator=g).argsort(dim=0)[:k].t().to(torch.int32)
    weights = (torch.rand(k, M, generator=g) + 0.1).t()
    assert not any(t.is_contiguous() for t in (x, w1, w2, ids, weights))
    for wdtype in (torch.float32, torch.float64, torch.bfloat16):
        run_both(x, w1, w2, weights.to(wdtype), ids)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_fp16(activation):
    """float16 activations and weights are within 2e-2 of the reference."""
    w1, w2 = make_weights(8, dtype=torch.float16, seed=3)
    x = make_hidden(50, dtype=torch.float16)
    weights, ids = random_routing(50, 8, 2)
    out = fused_moe(x, w1, w2, weights, ids, activation=activation, backend="torch", workspace=WorkspaceManager("cpu"))
    assert out.dtype == torch.float16
    assert relative_error(out, fused_moe_reference(x, w1, w2, weights, ids, activation=activation)) < 2e-2


def test_int64_expert_map():
    """An int64 expert_map works like an int32 one."""
    emap = half_local_map(16, seed=4)
    w1, w2 = make_weights(8, seed=4)
    x = make_hidden(40, seed=4)
    weights, ids = random_routing(40, 16, 4, seed=4)
    out = run_both(x, w1, w2, weights, ids, expert_map=emap.long(), global_num_experts=16)
    out32 = fused_moe(
        x,
        w1,
        w2,
        weights,
        ids,
        expert_map=emap,
        global_num_experts=16,
        backend="torch",
        workspace=WorkspaceManager("cpu"),
    )
    assert torch.equal(out, out32)
