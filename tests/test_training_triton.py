"""The Triton backward kernels against the torch backward (CPU interpreter, float32; bf16 on the GPU)."""

from __future__ import annotations

import pytest
import torch
from devices import TRITON_DEVICE_DTYPES, tolerance

from fusedmoe.problem import MoEProblem
from fusedmoe.training import moe_backward_torch
from fusedmoe.training.triton_backward import BackwardInputs, TritonBackward
from fusedmoe.workspace.manager import WorkspaceManager

NAMES = ("hidden_states", "w1", "w2", "topk_weights", "w1_bias", "w2_bias")


def _case(M, E, k, H, I, *, dtype, device, bias=False, ids=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    tw = torch.rand(M, k, generator=g)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)] or [torch.zeros(0)]).reshape(M, k)
    b1 = torch.randn(E, 2 * I, generator=g) if bias else None
    b2 = torch.randn(E, H, generator=g) if bias else None
    gout = torch.randn(M, H, generator=g)

    def on(t, dt=dtype):
        return None if t is None else t.to(device=device, dtype=dt)

    return on(x), on(w1), on(w2), on(tw, torch.float32), on(ids, torch.int32), on(b1), on(b2), on(gout)


def _problem(x, w1, tw, expert_map, global_E, activation, on_input, bias):
    M, H = x.shape
    E, two_i, _ = w1.shape
    return MoEProblem(
        M=M,
        H=H,
        I=two_i // 2,
        E=E,
        global_E=global_E,
        top_k=tw.shape[1],
        dtype=x.dtype,
        weight_dtype=w1.dtype,
        activation=activation,
        apply_router_weight_on_input=on_input,
        has_expert_map=expert_map is not None,
        has_bias=bias,
    )


def _saved_preact(x, w1, ids, expert_map):
    """What the forward saves: ``x[t] @ w1[e]ᵀ`` per slot of a local expert; NaN rows elsewhere (never read)."""
    M, k = ids.shape
    n_ids = w1.shape[0] if expert_map is None else len(expert_map)
    ok = (ids >= 0) & (ids < n_ids)
    safe = torch.where(ok, ids, 0).long()
    local = torch.where(ok, safe if expert_map is None else expert_map.long()[safe], -1)
    pre = torch.full((M * k, w1.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    for s, e in enumerate(local.reshape(-1).tolist()):
        if e >= 0:
            pre[s] = (x[s // k].double() @ w1[e].double().T).to(x.dtype)
    return pre


def _compare(
    device,
    dtype,
    M,
    E,
    k,
    H,
    I,
    *,
    activation="silu",
    on_input=False,
    bias=False,
    ids=None,
    expert_map=None,
    global_E=None,
    needs=(True,) * 6,
    seed=0,
    saved=False,
):
    x, w1, w2, tw, ids, b1, b2, g = _case(M, E, k, H, I, dtype=dtype, device=device, bias=bias, ids=ids, seed=seed)
    emap = None if expert_map is None else expert_map.to(device)
    global_E = global_E or E
    ref = moe_backward_torch(
        g.double(),
        x.double(),
        w1.double(),
        w2.double(),
        tw.double(),
        ids,
        activation=activation,
        apply_router_weight_on_input=on_input,
        expert_map=emap,
        global_num_experts=global_E,
        w1_bias=None if b1 is None else b1.double(),
        w2_bias=None if b2 is None else b2.double(),
        needs=needs,
    )
    manager = WorkspaceManager(device, poison=True)
    p = _problem(x, w1, tw, emap, global_E, activation, on_input, bias)
    preact = _saved_preact(x, w1, ids, emap) if saved else None
    got = TritonBackward()(BackwardInputs(x, w1, w2, tw, ids, emap, b1, b2, g, preact), p, needs, manager)
    tol = tolerance(dtype)
    for name in NAMES:
        want, have = getattr(ref, name), getattr(got, name)
        if want is None:
            assert have is None, name
            continue
        assert have.dtype == (torch.float32 if name == "topk_weights" else dtype), name
        assert torch.isfinite(have).all(), name
        denom = want.norm().item()
        err = (have.double() - want).norm().item() / (denom if denom else 1.0)
        assert err < tol, (name, err)
    return ref, got


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_exact", "swigluoai"])
@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("saved", [False, True])
def test_matches_torch_backward(device, dtype, activation, on_input, saved):
    bias = activation == "swigluoai"
    _compare(device, dtype, 9, 4, 2, 32, 16, activation=activation, on_input=on_input, bias=bias, saved=saved)


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize("on_input", [False, True])
def test_biases(device, dtype, on_input):
    _compare(device, dtype, 6, 3, 2, 48, 24, bias=True, on_input=on_input)


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
def test_expert_map_and_unroutable_ids(device, dtype):
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1], dtype=torch.int32)
    ids = torch.tensor([[1, 4], [0, 2], [4, -1], [9, 1], [3, 5], [0, 5]], dtype=torch.int32)
    ref, got = _compare(device, dtype, 6, 3, 2, 32, 16, ids=ids, expert_map=expert_map, global_E=6, bias=True)
    _compare(device, dtype, 6, 3, 2, 32, 16, ids=ids, expert_map=expert_map, global_E=6, bias=True, saved=True)
    # token 5 reaches no local expert; its slots get exact zeros
    assert got.hidden_states[5].eq(0).all() and got.topk_weights[5].eq(0).all()


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize("case", ["M1", "one_expert", "topk_equals_E", "all_on_one", "odd_sizes"])
def test_edges(device, dtype, case):
    if case == "M1":
        _compare(device, dtype, 1, 4, 2, 32, 16)
    elif case == "one_expert":
        _compare(device, dtype, 5, 1, 1, 32, 16)
    elif case == "topk_equals_E":
        _compare(device, dtype, 5, 3, 3, 32, 16)
    elif case == "all_on_one":
        ref, got = _compare(device, dtype, 20, 4, 1, 32, 16, ids=torch.full((20, 1), 2))
        assert got.w1[[0, 1, 3]].eq(0).all() and got.w2[[0, 1, 3]].eq(0).all()  # idle experts: exact zeros
    else:  # H, I not multiples of any tile; more slots than one block
        _compare(device, dtype, 37, 5, 2, 40, 24, bias=True)


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
def test_no_tokens(device, dtype):
    x, w1, w2, tw, ids, b1, b2, g = _case(0, 3, 2, 32, 16, dtype=dtype, device=device, bias=True)
    p = _problem(x, w1, tw, None, 3, "silu", False, True)
    got = TritonBackward()(
        BackwardInputs(x, w1, w2, tw, ids, None, b1, b2, g), p, (True,) * 6, WorkspaceManager(device)
    )
    assert got.hidden_states.shape == (0, 32) and got.topk_weights.shape == (0, 2)
    assert got.w1.eq(0).all() and got.w2.eq(0).all() and got.w1_bias.eq(0).all() and got.w2_bias.eq(0).all()


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize(
    "needs",
    [
        (True, False, False, False, False, False),
        (False, True, True, False, False, False),
        (False, False, False, True, False, False),
    ],
)
@pytest.mark.parametrize("saved", [False, True])
def test_partial_gradients(device, dtype, needs, saved):
    ref, got = _compare(device, dtype, 7, 4, 2, 32, 16, bias=True, needs=needs, saved=saved)
    for name, want in zip(NAMES, needs):
        assert (getattr(got, name) is not None) == want, name


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
def test_deterministic(device, dtype):
    x, w1, w2, tw, ids, b1, b2, g = _case(33, 4, 2, 32, 16, dtype=dtype, device=device, bias=True)
    p = _problem(x, w1, tw, None, 4, "silu", False, True)
    inputs = BackwardInputs(x, w1, w2, tw, ids, None, b1, b2, g)
    runs = [TritonBackward()(inputs, p, (True,) * 6, WorkspaceManager(device)) for _ in range(2)]
    for name in NAMES:
        assert torch.equal(getattr(runs[0], name), getattr(runs[1], name)), name


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize("recompute", [False, True])
def test_fused_moe_backward_on_the_triton_backend(device, dtype, recompute):
    from fusedmoe import fused_moe

    x, w1, w2, tw, ids, b1, b2, g = _case(11, 4, 2, 32, 16, dtype=dtype, device=device, bias=True)
    manager = WorkspaceManager(device, poison=True)
    grads = []
    for backend in ("triton", "torch") if device == "cpu" else ("triton",):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, tw, b1, b2)]
        out = fused_moe(
            *leaves[:4],
            ids,
            w1_bias=leaves[4],
            w2_bias=leaves[5],
            backend=backend,
            workspace=manager,
            recompute=recompute,
        )
        saved = {t.shape for t in out.grad_fn.saved_tensors if t is not None}
        assert ((ids.numel(), 2 * w1.shape[1] // 2) in saved) == (backend == "triton" and not recompute)
        out.backward(g)
        grads.append([t.grad for t in leaves])
    if device == "cpu":
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert manager.stats.calls >= 2  # the backward drew its scratch from the same manager


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize("b_rows,step", [("token", 1), ("sorted", 1), ("sorted", 4), ("slot", 2)])
def test_wgrad_row_modes_and_steps(device, dtype, b_rows, step):
    """moe_wgrad gives Σ aᵀ b per expert whichever way b's rows are addressed, for K steps over several blocks
    (an expert's blocks are contiguous; padding rows inside a step are masked or zero)."""
    from fusedmoe.ops.align import moe_align
    from fusedmoe.ops.moe_backward import expert_block_ranges, moe_wgrad

    M, E, k, N, K, block_m = 23, 3, 2, 24, 40, 16
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(device, torch.int32)
    ids[:9] = torch.tensor([0, 2], dtype=torch.int32)  # expert 0 and 2 span two blocks
    sorted_ids, block_expert, num_padded = moe_align(ids, E, block_m)
    ranges = expert_block_ranges(block_expert, torch.empty(E, 2, dtype=torch.int32, device=device))
    P, S = sorted_ids.shape[0], M * k
    valid = ((torch.arange(P, device=device) < num_padded) & (sorted_ids >= 0) & (sorted_ids < S)).cpu()
    slot_of_pos = torch.where(valid, sorted_ids.cpu(), 0).long()
    a = torch.randn(P, N, generator=g) * valid[:, None]  # dh-like: aligned order, zero padding
    rows_b = {"token": M, "slot": S, "sorted": P}[b_rows]
    b = torch.randn(rows_b, K, generator=g)
    if b_rows == "sorted":
        b *= valid[:, None]
    out = torch.full((E, N, K), float("nan"), device=device, dtype=dtype)
    a_, b_ = a.to(device, dtype), b.to(device, dtype)
    step_m = step * block_m
    moe_wgrad(
        a_,
        b_,
        out,
        sorted_ids,
        ranges,
        n_slots=S,
        top_k=k,
        block_m=block_m,
        a_rows="sorted",
        b_rows=b_rows,
        step_m=step_m,
        block_n=16,
        block_k=32,
        fp32_ieee=True,  # float32 on the GPU: IEEE dots, not TF32, for the 1e-5 tolerance
    )
    want = torch.zeros(E, N, K, dtype=torch.float64)
    expert_of_pos = ids.cpu().reshape(-1).long()[slot_of_pos]
    for pos in torch.nonzero(valid).flatten().tolist():
        s = slot_of_pos[pos]
        rb = {"token": s // k, "slot": s, "sorted": pos}[b_rows]
        want[expert_of_pos[pos]] += torch.outer(a[pos].double(), b[rb].double())
    err = (out.cpu().double() - want).norm() / want.norm()
    assert err < tolerance(dtype), err


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize("pins", [{"wgrad_step": 64}, {"block_m": 64, "wgrad_step": 16}], ids=["wide", "narrow"])
def test_weight_gradient_steps(device, dtype, pins):
    """The whole backward with the weight gradients stepping over several alignment blocks at a time, or over
    part of one (the tall blocks of large M), with the saved GEMM1 output and without."""
    from fusedmoe.training.triton_backward import pin_backward_tiles

    pin_backward_tiles(**pins)
    try:
        _compare(device, dtype, 37, 3, 2, 40, 24, bias=True, saved=True)
        _compare(device, dtype, 37, 3, 2, 40, 24, bias=True, on_input=True)
    finally:
        pin_backward_tiles()


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
def test_saved_output_under_checkpointing_and_expert_map(device, dtype):
    """With the forward's saved GEMM1 output (poisoned where the forward writes nothing: non-local slots) the
    Triton backward gives the torch backend's gradients, also when activation checkpointing reruns the forward."""
    from torch.utils.checkpoint import checkpoint

    from fusedmoe import fused_moe

    expert_map = torch.tensor([-1, 0, 1, -1, 2, 3], dtype=torch.int32, device=device)
    x, w1, w2, tw, _, b1, b2, g = _case(13, 4, 2, 32, 16, dtype=dtype, device=device, bias=True)
    ids = torch.randint(0, 6, (13, 2), generator=torch.Generator().manual_seed(5)).to(device, torch.int32)
    manager = WorkspaceManager(device, poison=True)

    def grads(backend, wrap):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, tw, b1, b2)]

        def layer(*ts):
            return fused_moe(
                *ts[:4], ids, w1_bias=ts[4], w2_bias=ts[5], expert_map=expert_map, backend=backend, workspace=manager
            )

        out = checkpoint(layer, *leaves, use_reentrant=False) if wrap else layer(*leaves)
        return torch.autograd.grad(out, leaves, g)

    want = grads("torch" if device == "cpu" else "triton", False)
    for wrap in (False, True):
        for a, b in zip(grads("triton", wrap), want):
            assert torch.isfinite(a).all()
            err = (a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)
            assert err < tolerance(dtype), err


def test_saved_backward_plan_frees_the_activation_before_dh():
    """With the saved GEMM1 output, dW2 runs before dh is written, so the backward's scratch peaks at dh plus
    one [P, H] operand; recomputing holds dh, the activation and w·g at once (qwen3-30b-a3b at 16384 tokens)."""
    from fusedmoe.training.triton_backward import backward_launch, backward_program

    M, E, k, H, I = 16384, 128, 8, 2048, 768
    p = MoEProblem(
        M=M,
        H=H,
        I=I,
        E=E,
        global_E=E,
        top_k=k,
        dtype=torch.bfloat16,
        weight_dtype=torch.bfloat16,
        activation="silu",
        apply_router_weight_on_input=False,
        has_expert_map=False,
        has_bias=False,
    )
    needs = (True,) * 4 + (False, False)
    for saved in (True, False):
        L = backward_launch(p, needs, saved=saved)
        plan = backward_program(p, L).plan
        P = L.align.max_padded
        dh, operand, act = P * 2 * I * 2, P * H * 2, P * I * 2
        small = 16 << 20  # ids, ranges, the routing weights' partials
        if saved:
            assert dh + operand <= plan.nbytes <= dh + operand + small
        else:
            assert plan.nbytes >= dh + operand + act
