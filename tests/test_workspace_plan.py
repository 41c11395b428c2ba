"""Unit tests of workspace plans: BufferSpec validation, lifetime-based aliasing in ``lay_out`` and
``WorkspacePlan`` (regions, sizes, describe), plus a hypothesis property test of the no-overlap invariant."""

from __future__ import annotations

import itertools
from enum import IntEnum

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedmoe import MoEKernel, MoEProblem, get_kernel
from fusedmoe.workspace.plan import ALIGNMENT, BufferSpec, WorkspacePlan, align_up, lay_out


class P(IntEnum):
    """Named step indices for hand-written plans (lifetimes are intervals of step indices)."""

    PREPARE = 0
    ALIGN = 1
    GATHER = 2
    GEMM1 = 3
    ACTIVATION = 4
    GEMM2 = 5
    REDUCE = 6
    FINALIZE = 7


def spec(name, nbytes, first, last, region="13", dtype=torch.uint8, zero=None):
    """A 1-D buffer of ``nbytes`` bytes (in ``dtype`` elements) living over phases [first, last]."""
    size = torch.empty((), dtype=dtype).element_size()
    assert nbytes % size == 0
    return BufferSpec(name, (nbytes // size,), dtype, P(first), P(last), zero=zero, region=region)


def byte_ranges_overlap(a, b) -> bool:
    """True if two placements share at least one byte (zero-size buffers share none)."""
    if a.spec.nbytes == 0 or b.spec.nbytes == 0:
        return False
    return a.offset < b.end and b.offset < a.end


def assert_valid_layout(specs, placements, total):
    """The layout invariants: every buffer placed, aligned, inside the arena, no live-together overlap."""
    assert set(placements) == {s.name for s in specs}
    assert total % ALIGNMENT == 0
    ends = [align_up(p.end) for p in placements.values()]
    assert total == max(ends, default=0)
    for p in placements.values():
        assert p.offset % ALIGNMENT == 0, p
        assert p.offset >= 0 and p.end <= total
    for a, b in itertools.combinations(placements.values(), 2):
        if a.spec.overlaps_in_time(b.spec):
            assert not byte_ranges_overlap(a, b), (a, b)


def torch_problem(M=64, H=40, I=24, E=8, k=2, dtype=torch.float32, **kw):
    return MoEProblem(M=M, H=H, I=I, E=E, global_E=E, top_k=k, dtype=dtype, weight_dtype=dtype, **kw)


# ---- BufferSpec ----------------------------------------------------------------------------------------------
def test_bufferspec_rejects_last_before_first():
    """A buffer cannot be last read before it is first written."""
    with pytest.raises(ValueError, match="'b'.*precedes"):
        BufferSpec("b", (4,), torch.float32, P.GEMM2, P.GEMM1)


@pytest.mark.parametrize("shape", [(-1,), (3, -2)], ids=["neg1d", "neg2d"])
def test_bufferspec_rejects_negative_dims(shape):
    """Negative dimensions are rejected with the buffer's name in the message."""
    with pytest.raises(ValueError, match="'b'.*negative"):
        BufferSpec("b", shape, torch.float32, P.GEMM1, P.GEMM1)


@pytest.mark.parametrize("region", ["1", "3", "", "22"])
def test_bufferspec_rejects_bad_region(region):
    """Only the regions "13" and "2" exist."""
    with pytest.raises(ValueError, match="region"):
        BufferSpec("b", (4,), torch.float32, P.GEMM1, P.GEMM1, region=region)


def test_bufferspec_sizes():
    """numel and nbytes follow shape and dtype; a single-phase lifetime is valid."""
    b = BufferSpec("b", (3, 5), torch.bfloat16, P.GEMM1, P.GEMM1)
    assert b.numel == 15 and b.nbytes == 30
    assert BufferSpec("z", (0, 7), torch.float32, P.ALIGN, P.REDUCE).nbytes == 0


def test_overlaps_in_time_is_inclusive():
    """Lifetimes are closed intervals: sharing one phase means overlapping."""
    a = spec("a", 256, P.ALIGN, P.GEMM1)
    assert a.overlaps_in_time(spec("b", 256, P.GEMM1, P.REDUCE))
    assert not a.overlaps_in_time(spec("c", 256, P.ACTIVATION, P.REDUCE))
    assert spec("c", 256, P.ACTIVATION, P.REDUCE).overlaps_in_time(spec("d", 256, P.PREPARE, P.FINALIZE))


# ---- lay_out -------------------------------------------------------------------------------------------------
def test_disjoint_lifetimes_alias():
    """Buffers whose lifetimes are disjoint share bytes (the 13/2 pairing): the arena is the max, not the sum."""
    specs = [spec("g1", 4096, P.GEMM1, P.ACTIVATION), spec("g2", 4096, P.GEMM2, P.REDUCE)]
    placements, total = lay_out(specs)
    assert placements["g1"].offset == placements["g2"].offset == 0
    assert total == 4096
    assert_valid_layout(specs, placements, total)


def test_overlapping_lifetimes_do_not_alias():
    """Buffers live at the same time get disjoint byte ranges, and the arena holds their sum."""
    specs = [spec("a", 1000, P.ALIGN, P.GEMM1), spec("b", 300, P.GEMM1, P.GEMM2), spec("c", 10, P.ALIGN, P.REDUCE)]
    placements, total = lay_out(specs)
    assert_valid_layout(specs, placements, total)
    assert total == align_up(1000) + align_up(300) + align_up(10)


def test_chain_of_lifetimes_reuses_bytes():
    """A chain a-b-c where only neighbours overlap lets a and c share bytes."""
    specs = [spec("a", 2048, P.ALIGN, P.GATHER), spec("b", 2048, P.GATHER, P.GEMM1), spec("c", 2048, P.GEMM1, P.GEMM2)]
    placements, total = lay_out(specs)
    assert_valid_layout(specs, placements, total)
    assert placements["a"].offset == placements["c"].offset
    assert total == 2 * 2048


def test_offsets_are_aligned_for_odd_sizes():
    """Odd byte sizes still get 256-aligned offsets and a 256-multiple total."""
    specs = [spec(f"b{i}", n, P.ALIGN, P.REDUCE) for i, n in enumerate([1, 3, 257, 511, 4097, 13])]
    placements, total = lay_out(specs)
    assert_valid_layout(specs, placements, total)
    assert total == sum(align_up(n) for n in [1, 3, 257, 511, 4097, 13])


def test_zero_size_buffers_are_fine():
    """Zero-size buffers get a placement, take no bytes and do not push others around."""
    specs = [
        spec("empty", 0, P.ALIGN, P.REDUCE),
        spec("a", 512, P.ALIGN, P.REDUCE),
        BufferSpec("empty2", (0, 40), torch.float32, P.GEMM1, P.GEMM1),
    ]
    placements, total = lay_out(specs)
    assert_valid_layout(specs, placements, total)
    assert total == 512 and placements["a"].offset == 0
    plan = WorkspacePlan(tuple(specs))
    assert plan.nbytes == 512
    assert WorkspacePlan((spec("e", 0, P.ALIGN, P.ALIGN),)).nbytes == 0
    assert WorkspacePlan(()).nbytes == 0


def test_lay_out_is_deterministic():
    """The same list of buffers always gives the same layout."""
    specs = [spec(f"b{i}", 256 * ((i * 7) % 5 + 1), i % 8, min(7, i % 8 + i % 3)) for i in range(20)]
    first = lay_out(specs)
    for _ in range(3):
        again = lay_out(list(specs))
        assert again[1] == first[1]
        assert {n: p.offset for n, p in again[0].items()} == {n: p.offset for n, p in first[0].items()}


# ---- WorkspacePlan -------------------------------------------------------------------------------------------
def test_duplicate_names_rejected():
    """Two buffers of one plan cannot share a name (views are handed out by name)."""
    with pytest.raises(ValueError, match="duplicate.*'x'"):
        WorkspacePlan((spec("x", 256, P.ALIGN, P.ALIGN), spec("x", 512, P.GEMM1, P.GEMM1)))


def test_plan_sizes_and_regions():
    """nbytes is the aliased total, sum_nbytes the unaliased one; each region is laid out on its own."""
    specs = (
        spec("a13", 1024, P.GATHER, P.GEMM1, region="13"),
        spec("gu2", 2048, P.GEMM1, P.ACTIVATION, region="2"),
        spec("act13", 512, P.ACTIVATION, P.GEMM2, region="13"),
        spec("y2", 1024, P.GEMM2, P.REDUCE, region="2"),
        spec("z", 300, P.ALIGN, P.ALIGN, region="13", zero="index map with unset entries"),
    )
    plan = WorkspacePlan(specs)
    assert plan.sum_nbytes == 1024 + 2048 + 512 + 1024 + 512
    assert plan.nbytes <= plan.sum_nbytes
    assert plan.zero_nbytes == 300
    assert_valid_layout(specs, plan.placements, plan.nbytes)
    for region in ("13", "2"):
        placements, total = plan.region(region)
        mine = [s for s in specs if s.region == region]
        assert set(placements) == {s.name for s in mine}
        assert_valid_layout(mine, placements, total)
        assert plan.region_nbytes[region] == total
    # 13: a13 [GATHER..GEMM1] and act13 [ACT..GEMM2] and z [ALIGN] are pairwise disjoint in time -> alias
    assert plan.region_nbytes["13"] == 1024
    # 2: gu2 [GEMM1..ACT] and y2 [GEMM2..REDUCE] are disjoint -> alias
    assert plan.region_nbytes["2"] == 2048


def test_buffers_without_lifetime_cannot_be_laid_out():
    """A BufferSpec as components declare it (no lifetime) only becomes placeable through a Program."""
    with pytest.raises(ValueError, match="'q' has no lifetime"):
        WorkspacePlan((BufferSpec("q", (4,), torch.float32),))
    with pytest.raises(ValueError, match="both first and last"):
        BufferSpec("q", (4,), torch.float32, first=1)


def test_describe_mentions_every_buffer():
    """describe() is a human-readable table naming every buffer with its offset and size."""
    specs = (
        spec("alpha", 1024, P.ALIGN, P.GEMM1),
        spec("beta", 256, P.GEMM2, P.REDUCE, zero="accumulates"),
        BufferSpec("gamma", (3, 5), torch.bfloat16, P.GEMM1, P.GEMM2),
    )
    plan = WorkspacePlan(specs)
    text = plan.describe()
    for s in specs:
        assert s.name in text
        assert f"@ {plan.placements[s.name].offset} +{s.nbytes}" in text
    assert str(plan.nbytes) in text.splitlines()[0]
    assert "accumulates" in text


@pytest.mark.parametrize("M", [0, 1, 7, 300, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_torch_kernel_plan_is_valid_and_pure(M, dtype):
    """The torch kernel's plan for a problem is a valid layout, aliases (nbytes < sum) and is a pure function."""
    kernel = get_kernel("torch")
    p = torch_problem(M=M, dtype=dtype)
    plan = kernel.plan(p)
    assert_valid_layout(plan.buffers, plan.placements, plan.nbytes)
    for r in ("13", "2"):
        placements, total = plan.region(r)
        assert_valid_layout([b for b in plan.buffers if b.region == r], placements, total)
    fresh = MoEKernel(kernel.prepare_finalize, kernel.experts).plan(p)
    assert fresh == plan and fresh.nbytes == plan.nbytes
    assert {n: q.offset for n, q in fresh.placements.items()} == {n: q.offset for n, q in plan.placements.items()}
    if M >= 7:
        assert plan.nbytes < plan.sum_nbytes


def test_torch_kernel_plan_grows_with_tokens():
    """Plans are monotone in M, so reserving for max tokens covers every smaller batch."""
    kernel = get_kernel("torch")
    sizes = [kernel.plan(torch_problem(M=M)).nbytes for M in range(0, 600, 13)]
    assert sizes == sorted(sizes)


# ---- property test -------------------------------------------------------------------------------------------
_DTYPES = [torch.uint8, torch.int32, torch.int64, torch.float32, torch.bfloat16]


@st.composite
def spec_lists(draw):
    n = draw(st.integers(0, 14))
    out = []
    for i in range(n):
        first = draw(st.integers(0, 7))
        last = draw(st.integers(first, 7))
        shape = tuple(draw(st.lists(st.integers(0, 70), min_size=1, max_size=3)))
        dtype = draw(st.sampled_from(_DTYPES))
        region = draw(st.sampled_from(["13", "2"]))
        out.append(BufferSpec(f"b{i}", shape, dtype, P(first), P(last), region=region))
    return out


@settings(max_examples=300, deadline=None)
@given(spec_lists())
def test_property_no_live_overlap(specs):
    """For random buffer lists, buffers live together never share a byte, in the plan and in each region."""
    placements, total = lay_out(specs)
    assert_valid_layout(specs, placements, total)
    assert total <= sum(align_up(s.nbytes) for s in specs)
    plan = WorkspacePlan(tuple(specs))
    assert plan.nbytes == total
    for r in ("13", "2"):
        mine = [s for s in specs if s.region == r]
        rp, rt = plan.region(r)
        assert_valid_layout(mine, rp, rt)
    # the biggest set of buffers alive in one phase is a lower bound for the arena
    for ph in range(8):
        alive = sum(s.nbytes for s in specs if int(s.first) <= ph <= int(s.last))
        assert total >= alive
