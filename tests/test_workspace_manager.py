"""The WorkspaceManager: reservation across a layer stack (shared = max, per_layer = sum), zero allocations
after warm-up, per-call strategies, bounded growth under dynamic M, freeze, slots, stats, views, and the
layer output never aliasing the arena."""

from __future__ import annotations

import random

import pytest
import torch

from fusedmoe import (
    STRATEGIES,
    BufferSpec,
    FusedMoE,
    MoEProblem,
    WorkspaceFrozenError,
    WorkspaceManager,
    WorkspacePlan,
    fused_moe,
    get_kernel,
)
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.workspace.manager import MIN_BUCKET, WorkspaceError, bucket_bytes

H, I, E, K = 40, 24, 8, 2
KERNEL = get_kernel("torch")


def problem(M, H=H, I=I, E=E, k=K, dtype=torch.float32):
    return MoEProblem(M=M, H=H, I=I, E=E, global_E=E, top_k=k, dtype=dtype, weight_dtype=dtype)


def plan(M, **kw) -> WorkspacePlan:
    return KERNEL.plan(problem(M, **kw))


def arena_range(ws):
    a = ws.arena
    return a.data_ptr(), a.data_ptr() + a.numel()


def inside(ptr, rng) -> bool:
    return rng[0] <= ptr < rng[1]


def layer_stack(mgr, L=48, seed=0):
    """L small FusedMoE layers of a few different shapes (so their plans differ), all on ``mgr``."""
    torch.manual_seed(seed)
    shapes = [(24, 2), (40, 1), (16, 4), (32, 3)]
    return [FusedMoE(E, shapes[i % 4][1], H, shapes[i % 4][0], workspace=mgr, backend="torch") for i in range(L)]


def run_inputs(M, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, H, generator=g)


def fused_args(M, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    ids = torch.rand(M, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    w = torch.rand(M, K, generator=g) + 0.1
    return x, w1, w2, w, ids


def assert_correct(out, args):
    err = relative_error(out, fused_moe_reference(*args))
    assert err < 1e-5, err


def custom_plan():
    """A plan with int, float and bf16 buffers (all live at once, so none alias), one with a declared zero
    requirement, one zero-sized."""
    return WorkspacePlan(
        (
            BufferSpec("ids", (37,), torch.int32, 1, 6),
            BufferSpec("acc", (5, 7), torch.float32, 3, 6, zero="accumulated into"),
            BufferSpec("rows", (9, 40), torch.bfloat16, 2, 5, region="2"),
            BufferSpec("big", (1000,), torch.float32, 0, 7),
            BufferSpec("none", (0, 3), torch.float32, 1, 1),
        )
    )


# ---- reservation over a layer stack --------------------------------------------------------------------------
MAX_TOKENS = 256


def test_shared_reserve_is_exactly_the_largest_layer_plan():
    """shared: reserving every one of 48 layers sizes the one arena to the largest single-layer plan, exactly."""
    mgr = WorkspaceManager("cpu", strategy="shared")
    layers = layer_stack(mgr)
    sizes = [layer.plan(MAX_TOKENS).nbytes for layer in layers]
    assert len(set(sizes)) > 1  # the stack really has different plans
    for layer in layers:
        layer.reserve_workspace(MAX_TOKENS)
    assert mgr.stats.reserved_bytes == max(sizes)
    assert mgr.reserve(0) == max(sizes)  # the arena's capacity, unchanged by a smaller reservation


def test_per_layer_reserve_is_the_sum_of_layer_plans():
    """per_layer: each layer gets its own arena of exactly its plan's size; the total is the sum."""
    mgr = WorkspaceManager("cpu", strategy="per_layer")
    layers = layer_stack(mgr)
    total = 0
    for layer in layers:
        got = layer.reserve_workspace(MAX_TOKENS)
        assert got == layer.plan(MAX_TOKENS).nbytes
        total += got
    assert mgr.stats.reserved_bytes == total == sum(layer.plan(MAX_TOKENS).nbytes for layer in layers)
    assert mgr.stats.device_allocations == len(layers)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["shared", "per_layer"])
def test_no_allocations_after_reserve(strategy):
    """After reserve_workspace(max_tokens), forwards with M <= max_tokens make no device allocation or growth."""
    mgr = WorkspaceManager("cpu", strategy=strategy)
    layers = layer_stack(mgr)
    for layer in layers:
        layer.reserve_workspace(MAX_TOKENS)
    allocs, reserved = mgr.stats.device_allocations, mgr.stats.reserved_bytes
    for step, M in enumerate([MAX_TOKENS, 1, 77, 3]):
        x = run_inputs(M, seed=step)
        for layer in layers:
            x = layer(x) + x  # a residual stream through the stack, RMS-normalized
            x = x / x.pow(2).mean(dim=-1, keepdim=True).add(1e-6).sqrt()
            assert torch.isfinite(x).all()
    assert mgr.stats.device_allocations == allocs
    assert mgr.stats.reserved_bytes == reserved
    assert mgr.stats.growths == 0
    assert mgr.stats.calls == 4 * len(layers)


def test_shared_warm_up_then_zero_allocations():
    """Without reserve: after one warm-up at the largest M, further shared calls allocate nothing."""
    mgr = WorkspaceManager("cpu", strategy="shared")
    layers = layer_stack(mgr, L=12)
    x = run_inputs(MAX_TOKENS)
    for layer in layers:
        layer(x)
    allocs = mgr.stats.device_allocations
    assert allocs >= 1
    for M in [5, MAX_TOKENS, 100, 1, 0]:
        x = run_inputs(M, seed=M)
        for layer in layers:
            layer(x)
    assert mgr.stats.device_allocations == allocs


# ---- per-call strategies -------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["alloc_zeros", "alloc_empty"])
def test_per_call_strategies_allocate_once_per_call(strategy):
    """alloc_zeros / alloc_empty allocate exactly one arena per call, keep nothing, and only alloc_zeros zeroes."""
    mgr = WorkspaceManager("cpu", strategy=strategy)
    assert mgr.reserve(plan(100)) == 0
    zeroed = 0
    for n, M in enumerate([1, 50, 300, 7], start=1):
        p = plan(M)
        ws = mgr.acquire(p)
        assert ws.arena.numel() == p.nbytes
        if strategy == "alloc_zeros":
            zeroed += p.nbytes
            assert (ws.arena == 0).all()
        assert mgr.stats.device_allocations == n
        assert mgr.stats.bytes_zeroed == zeroed
        assert mgr.stats.zero_fills == (n if strategy == "alloc_zeros" else 0)
    assert mgr.stats.reserved_bytes == 0 and mgr.stats.growths == 0
    # through fused_moe as well: one allocation per call
    args = fused_args(20)
    before = mgr.stats.device_allocations
    for _ in range(3):
        assert_correct(fused_moe(*args, backend="torch", workspace=mgr), args)
    assert mgr.stats.device_allocations == before + 3


def test_per_call_arenas_are_fresh():
    """Per-call strategies hand out a new arena each call (nothing persistent)."""
    mgr = WorkspaceManager("cpu", strategy="alloc_empty")
    a = mgr.acquire(plan(64))
    keep = a.arena  # keep it alive so the allocator cannot hand the same bytes back
    b = mgr.acquire(plan(64))
    assert b.arena.data_ptr() != keep.data_ptr()


# ---- dynamic M -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["random", "increasing"])
def test_growths_bounded_under_dynamic_m(order):
    """1,000 batch sizes in [1, 8192] cause at most 4 * (log2(8192) + 1) = 56 arena growths (four buckets per
    doubling), and the arena holds at most 25% more than the largest plan."""
    rng = random.Random(1234)
    Ms = [rng.randint(1, 8192) for _ in range(1000)]
    if order == "increasing":
        Ms = sorted(Ms) + [8192]
    mgr = WorkspaceManager("cpu", strategy="shared")
    base = problem(1)
    peak = 0
    for M in Ms:
        p = KERNEL.plan(base.with_tokens(M))
        ws = mgr.acquire(p)
        peak = max(peak, p.nbytes)
        assert ws.arena.numel() >= p.nbytes
    assert 1 <= mgr.stats.growths <= 4 * 14
    assert mgr.stats.device_allocations == mgr.stats.growths
    assert mgr.stats.peak_bytes == peak
    assert peak <= mgr.stats.reserved_bytes <= max(1.25 * peak, MIN_BUCKET)
    assert mgr.stats.calls == len(Ms)


# ---- freeze --------------------------------------------------------------------------------------------------
def test_frozen_growth_raises_and_leaves_state_unchanged():
    """freeze() then a larger request raises WorkspaceFrozenError (a ValueError) stating bytes needed and
    available; arena and reserved bytes are unchanged and the next in-size call is correct."""
    mgr = WorkspaceManager("cpu", strategy="shared")
    small = plan(16)
    assert mgr.reserve(small) == small.nbytes
    mgr.freeze()
    ws = mgr.acquire(small)
    ptr, cap = ws.arena.data_ptr(), ws.arena.numel()
    reserved, allocs, growths = mgr.stats.reserved_bytes, mgr.stats.device_allocations, mgr.stats.growths
    big = plan(4000)
    with pytest.raises(WorkspaceFrozenError) as info:
        mgr.acquire(big)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert str(big.nbytes) in msg and str(cap) in msg and "frozen" in msg
    assert mgr.stats.reserved_bytes == reserved
    assert mgr.stats.device_allocations == allocs and mgr.stats.growths == growths
    assert mgr.acquire(small).arena.data_ptr() == ptr
    # through fused_moe: too big fails, in-size works and is correct, arena unchanged
    with pytest.raises(WorkspaceFrozenError, match=str(plan(500).nbytes)):
        fused_moe(*fused_args(500), backend="torch", workspace=mgr)
    args = fused_args(16, seed=3)
    assert_correct(fused_moe(*args, backend="torch", workspace=mgr), args)
    assert mgr.acquire(small).arena.data_ptr() == ptr and mgr.stats.reserved_bytes == reserved
    # reserve past the frozen size also refuses; release is refused while frozen
    with pytest.raises(WorkspaceFrozenError):
        mgr.reserve(big)
    with pytest.raises(WorkspaceFrozenError):
        mgr.release()
    assert mgr.stats.reserved_bytes == reserved
    mgr.unfreeze()
    assert mgr.acquire(big).arena.numel() >= big.nbytes


def test_frozen_without_any_arena():
    """A manager frozen before anything was reserved refuses the first request, reporting 0 bytes available."""
    mgr = WorkspaceManager("cpu")
    mgr.freeze()
    with pytest.raises(WorkspaceFrozenError, match=r"\b0 bytes.*" + str(plan(8).nbytes)):
        mgr.acquire(plan(8))
    assert mgr.stats.reserved_bytes == 0 and mgr.stats.device_allocations == 0


# ---- reserve -------------------------------------------------------------------------------------------------
def test_reserve_is_exact_and_grow_only():
    """reserve sizes exactly (no bucket rounding) and never shrinks; the largest of several plans wins."""
    mgr = WorkspaceManager("cpu")
    assert mgr.reserve(1000) == 1000 and mgr.stats.reserved_bytes == 1000
    assert mgr.reserve(500) == 1000 and mgr.stats.reserved_bytes == 1000
    assert mgr.stats.device_allocations == 1
    p1, p2 = plan(10), plan(333)
    assert mgr.reserve(p1, p2) == p2.nbytes == mgr.stats.reserved_bytes
    assert mgr.stats.device_allocations == 2
    ws = mgr.acquire(p2)  # fits exactly: no growth
    assert ws.arena.numel() == p2.nbytes and mgr.stats.growths == 0
    mgr.release()
    assert mgr.stats.reserved_bytes == 0


# ---- slots ---------------------------------------------------------------------------------------------------
def test_slots_have_disjoint_arenas_and_reuse_their_own():
    """Requests in different slots get disjoint arenas; the same slot gets its arena back."""
    mgr = WorkspaceManager("cpu")
    p = plan(64)
    assert mgr.current_slot() == "default"
    with mgr.slot("a"):
        assert mgr.current_slot() == "a"
        ra = arena_range(mgr.acquire(p))
        with mgr.slot("b"):
            assert mgr.current_slot() == "b"
            rb = arena_range(mgr.acquire(p))
        assert mgr.current_slot() == "a"
    assert mgr.current_slot() == "default"
    rd = arena_range(mgr.acquire(p))
    for r1, r2 in [(ra, rb), (ra, rd), (rb, rd)]:
        assert r1[1] <= r2[0] or r2[1] <= r1[0], (r1, r2)
    with mgr.slot("a"):
        assert arena_range(mgr.acquire(p)) == ra
    with mgr.slot("b"):
        assert arena_range(mgr.acquire(p)) == rb
    assert mgr.stats.reserved_bytes == 3 * bucket_bytes(p.nbytes)
    assert mgr.stats.device_allocations == 3


def test_slots_through_fused_moe_are_correct():
    """fused_moe inside two slots uses two arenas and both results are correct."""
    mgr = WorkspaceManager("cpu")
    a1, a2 = fused_args(30, seed=1), fused_args(70, seed=2)
    with mgr.slot(("stream", 1)):
        o1 = fused_moe(*a1, backend="torch", workspace=mgr)
    with mgr.slot(("stream", 2)):
        o2 = fused_moe(*a2, backend="torch", workspace=mgr)
    assert mgr.stats.device_allocations == 2
    assert_correct(o1, a1)
    assert_correct(o2, a2)


def test_reserve_per_slot():
    """reserve(slot=...) sizes that slot's arena only."""
    mgr = WorkspaceManager("cpu")
    mgr.reserve(plan(300), slot="x")
    assert mgr.stats.reserved_bytes == plan(300).nbytes
    with mgr.slot("x"):
        mgr.acquire(plan(300))
    assert mgr.stats.growths == 0
    mgr.acquire(plan(300))  # default slot: a new arena
    assert mgr.stats.growths == 1


# ---- stats ---------------------------------------------------------------------------------------------------
def test_stats_counters_move_as_documented():
    """calls per acquire, peak = largest plan, growths only when needed, plan_bytes per owner."""
    mgr = WorkspaceManager("cpu", strategy="per_layer")
    s = mgr.stats
    assert (s.calls, s.peak_bytes, s.growths, s.reserved_bytes, s.device_allocations) == (0, 0, 0, 0, 0)
    mgr.acquire(plan(100), owner="L0")
    assert (s.calls, s.growths, s.device_allocations) == (1, 1, 1)
    assert s.peak_bytes == plan(100).nbytes and s.plan_bytes == {"L0": plan(100).nbytes}
    mgr.acquire(plan(10), owner="L0")
    assert (s.calls, s.growths) == (2, 1)
    assert s.peak_bytes == plan(100).nbytes and s.plan_bytes["L0"] == plan(10).nbytes
    mgr.acquire(plan(50), owner="L1")
    assert (s.calls, s.growths, s.device_allocations) == (3, 2, 2)
    assert s.plan_bytes == {"L0": plan(10).nbytes, "L1": plan(50).nbytes}
    assert s.reserved_bytes == bucket_bytes(plan(100).nbytes) + bucket_bytes(plan(50).nbytes)
    big = plan(5000)
    mgr.acquire(big, owner="L1")
    assert s.growths == 3 and s.peak_bytes == big.nbytes
    assert s.reserved_bytes == bucket_bytes(plan(100).nbytes) + bucket_bytes(big.nbytes)
    d = s.as_dict()
    assert d["calls"] == 4 and d["plan_bytes"] == {"L0": plan(10).nbytes, "L1": big.nbytes}


def test_growth_rounds_to_a_quarter_octave():
    """A growth allocates the next of 1.25 / 1.5 / 1.75 / 2 x a power of two (at least MIN_BUCKET), so
    reserved_bytes is that bucket."""
    mgr = WorkspaceManager("cpu")
    big = plan(5000)
    mgr.acquire(big)
    octave = 1 << (big.nbytes - 1).bit_length()
    want = max(MIN_BUCKET, min(b for b in (octave * f // 8 for f in (5, 6, 7, 8)) if b >= big.nbytes))
    assert mgr.stats.reserved_bytes == want


@pytest.mark.parametrize(
    "nbytes,bucket",
    [
        (1, MIN_BUCKET),
        (MIN_BUCKET, MIN_BUCKET),
        (MIN_BUCKET + 1, MIN_BUCKET * 5 // 4),
        (5 << 20, 5 << 20),
        ((5 << 20) + 1, 6 << 20),
        (7 << 20, 7 << 20),
        ((7 << 20) + 1, 8 << 20),
        (1226 << 20, 1280 << 20),
    ],
)
def test_bucket_sizes(nbytes, bucket):
    assert bucket_bytes(nbytes) == bucket


def test_zero_requirements_and_poison_are_applied_and_counted():
    """Declared zero buffers are zeroed on every acquire (bytes counted); poison (NaN / 0x7FC0 pattern) first."""
    p = custom_plan()
    for poison in (False, True):
        mgr = WorkspaceManager("cpu", poison=poison)
        for call in (1, 2):
            ws = mgr.acquire(p)
            assert (ws["acc"] == 0).all()
            assert mgr.stats.bytes_zeroed == call * 5 * 7 * 4
            assert mgr.stats.zero_fills == call
            if poison:
                assert torch.isnan(ws["rows"]).all() and torch.isnan(ws["big"]).all()
                assert (ws["ids"] == 0x7FC07FC0).all()
                assert mgr.stats.poison_fills == call
            for name in ("acc", "rows", "big", "ids"):
                ws[name].view(torch.uint8).fill_(0x11)  # dirty everything for the next call
        assert mgr.stats.poison_fills == (2 if poison else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_poison_covers_every_float_view_of_real_plans(strategy, dtype):
    """In poison mode every floating view of the torch kernel's plan is entirely NaN when handed out (even
    where buffers alias), and no integer view holds a small (plausible) index."""
    mgr = WorkspaceManager("cpu", strategy=strategy, poison=True)
    for M in (1, 64, 300):
        p = plan(M, dtype=dtype)
        ws = mgr.acquire(p)
        for spec in p.buffers:
            v = ws[spec.name]
            if spec.dtype.is_floating_point:
                assert torch.isnan(v).all(), spec.name
            elif v.numel():
                assert (v.abs() > 1 << 20).all(), spec.name
        for spec in p.buffers:  # dirty it for the next round
            ws[spec.name].view(torch.uint8).fill_(0)


# ---- views ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_views_are_typed_shaped_aligned_and_disjoint(strategy):
    """Each view has its buffer's dtype and shape, starts 256-byte aligned from the arena start, lies inside
    the arena, and views live at the same time do not share bytes."""
    mgr = WorkspaceManager("cpu", strategy=strategy)
    for p in (custom_plan(), plan(77), plan(300, dtype=torch.bfloat16)):
        ws = mgr.acquire(p, owner="me")
        lo, hi = arena_range(ws)
        for spec in p.buffers:
            v = ws[spec.name]
            assert v.dtype == spec.dtype and tuple(v.shape) == spec.shape and v.is_contiguous()
            if spec.nbytes == 0:
                continue
            off = v.data_ptr() - lo
            assert off == p.placements[spec.name].offset
            assert off % 256 == 0
            assert v.data_ptr() + spec.nbytes <= hi
        for a in p.buffers:
            for b in p.buffers:
                if a.name < b.name and a.overlaps_in_time(b) and a.nbytes and b.nbytes:
                    pa, pb = ws[a.name].data_ptr(), ws[b.name].data_ptr()
                    assert pa + a.nbytes <= pb or pb + b.nbytes <= pa, (a.name, b.name)


# ---- outputs are not workspace views -------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shared_experts", [0, 1], ids=["routed_only", "with_shared"])
def test_layer_output_never_views_the_arena(strategy, shared_experts):
    """A layer's output lies outside the arena and survives the next call unchanged."""
    mgr = WorkspaceManager("cpu", strategy=strategy)
    layer = FusedMoE(E, K, H, I, num_shared_experts=shared_experts, workspace=mgr, backend="torch")
    x1 = run_inputs(64, seed=1)
    out1 = layer(x1)
    keep = out1.clone()
    ws = mgr.acquire(layer.plan(64), owner=layer.owner_key)
    if strategy in ("shared", "per_layer"):
        lo, hi = arena_range(ws)
        assert not inside(out1.data_ptr(), (lo, hi))
        assert not inside(out1.data_ptr() + out1.numel() * 4 - 1, (lo, hi))
    ws["y_slot"].fill_(123.0)  # scribble on the arena
    out2 = layer(run_inputs(64, seed=2))
    assert torch.equal(out1, keep)
    assert not torch.equal(out1, out2)
    assert out1.data_ptr() != out2.data_ptr()


def test_fused_moe_output_is_fresh_under_shared_manager():
    """fused_moe's result is a new tensor: a second call on the same manager does not change the first."""
    mgr = WorkspaceManager("cpu")
    a1, a2 = fused_args(40, seed=1), fused_args(40, seed=2)
    o1 = fused_moe(*a1, backend="torch", workspace=mgr)
    keep = o1.clone()
    fused_moe(*a2, backend="torch", workspace=mgr)
    assert torch.equal(o1, keep)
    assert_correct(o1, a1)


def test_bad_caller_workspace_type_is_workspace_error():
    """WorkspaceError is a ValueError (so callers can catch either)."""
    assert issubclass(WorkspaceFrozenError, WorkspaceError) and issubclass(WorkspaceError, ValueError)
