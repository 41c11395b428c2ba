"""Lifetimes come from the steps that touch a buffer, plans are keyed by their launch, and the plan invariant holds
over the whole grid of experts x layout x quantization x activation x M bucket x launch.

Regressions of the correctness issue: (1) fp8 per-tensor dynamic quantization at small M placed its partial-max
scratch on ``sorted_ids`` (alignment ran before the quantization the plan said came first); (2) a plan cached
under the problem alone was reused after the pinned BLOCK_M changed.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import pytest
import torch

from fusedmoe import (
    AllToAllPrepareFinalize,
    BatchedPrepareFinalize,
    BatchedTorchExperts,
    Layout,
    LocalPrepareFinalize,
    MoEKernel,
    MoEProblem,
    PlanError,
    TorchExperts,
    fused_moe,
)
from fusedmoe.experts.base import Experts, ExpertsInputs
from fusedmoe.experts.batched_triton_experts import BatchedTritonExperts
from fusedmoe.experts.triton_experts import TritonExperts
from fusedmoe.ops.configs import (
    ENV_DIR,
    MoEConfig,
    clear_cache,
    config_file_name,
    device_name,
    pinned_config,
    table_to_json,
)
from fusedmoe.quant import QuantConfig, quantize_weights
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.steps import Program, step
from fusedmoe.workspace.manager import WorkspaceManager
from fusedmoe.workspace.plan import BufferSpec

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter")


# ---- the grid -------------------------------------------------------------------------------------------------
@dataclass
class StubTransport:
    """Enough of a Transport for planning (plans never communicate)."""

    rank: int = 0
    world_size: int = 2


def _kernels(M: int) -> dict[str, MoEKernel]:
    ep = dict(num_experts=8, max_tokens_per_rank=max(M, 1))
    return {
        "torch": MoEKernel(LocalPrepareFinalize(), TorchExperts()),
        "triton": MoEKernel(LocalPrepareFinalize(), TritonExperts()),
        "batched-torch": MoEKernel(BatchedPrepareFinalize(), BatchedTorchExperts()),
        "batched-triton": MoEKernel(BatchedPrepareFinalize(), BatchedTritonExperts()),
        "batched-cap-triton": MoEKernel(BatchedPrepareFinalize(3), BatchedTritonExperts()),
        "ep-torch": MoEKernel(AllToAllPrepareFinalize(StubTransport(), **ep), TorchExperts()),
        "ep-triton": MoEKernel(AllToAllPrepareFinalize(StubTransport(), **ep), TritonExperts()),
        "ep-batched-triton": MoEKernel(
            AllToAllPrepareFinalize(StubTransport(), **ep, layout=Layout.BATCHED), BatchedTritonExperts()
        ),
    }


QUANTS = [None, "fp8_tensor", "fp8_tensor_static", "fp8_token", "fp8_block"]
ACTIVATIONS = ["silu", "gelu", "swigluoai"]
# M buckets: empty, the alignment's pair regime (slots <= 64), one launch, two launches
MS = [0, 1, 2, 3, 8, 40, 700, 2100]
PINS = [None, MoEConfig.simple(16, 32, 32), MoEConfig.simple(64, 32, 32)]


def _problem(kernel_name: str, M: int, quant, activation: str, variant: int) -> MoEProblem:
    """Variants: 0 plain, 1 router weight on the input, 2 an expert_map with non-local experts, 3 biases."""
    q = QuantConfig.parse(quant)
    ep = kernel_name.startswith("ep-")
    mapped = ep or variant == 2
    E, global_E = (4, 8) if ep else ((8, 16) if mapped else (8, 8))
    dt = torch.float16
    return MoEProblem(
        M=M,
        H=256,
        I=128,
        E=E,
        global_E=global_E,
        top_k=2,
        dtype=dt,
        weight_dtype=torch.float8_e4m3fn if q is not None else dt,
        activation=activation,
        apply_router_weight_on_input=variant == 1,
        has_expert_map=mapped,
        quant=q,
        has_bias=variant == 3,
    )


def _grid():
    for M in MS:
        for (name, kernel), quant, act, pin, variant in itertools.product(
            _kernels(M).items(), QUANTS, ACTIVATIONS, PINS, range(4)
        ):
            p = _problem(name, M, quant, act, variant)
            if kernel.unsupported(p) is not None:
                continue
            yield name, kernel, p, pin


def _overlap(a, b) -> bool:
    """Two placements share a byte (zero-size buffers share none)."""
    a0, a1, b0, b1 = a.offset, a.offset + a.spec.nbytes, b.offset, b.offset + b.spec.nbytes
    return a1 > a0 and b1 > b0 and a0 < b1 and b0 < a1


@pytest.mark.slow
def test_plan_invariant_over_the_whole_grid():
    """For every combination: (a) every buffer's lifetime is exactly the span of the steps naming it (exports also
    span the experts' steps, zeroed buffers start at step 0); (b) no two buffers live at the same time share a
    byte, in the arena and in each caller region; (c) every optional step parameter is a buffer of some plan (a
    misspelt name would otherwise silently receive None)."""
    seen_names: set[str] = set()
    optional: set[str] = set()
    n = 0
    for name, kernel, p, pin in _grid():
        with pinned_config(pin):
            prog = kernel.program(p)[0]
        plan = prog.plan
        n += 1
        experts = prog.segments[1]
        for spec in plan.buffers:
            seen_names.add(spec.name)
            at = [i for i, s in enumerate(prog.steps) if spec.name in s.needs]
            assert at, (name, spec.name)
            if spec.name in prog.exports and len(experts):
                at += [experts.start, experts.stop - 1]
            if spec.zero is not None:
                at.append(0)
            assert (spec.first, spec.last) == (min(at), max(at)), (name, p, spec)
        for s in prog.steps:
            optional |= s.optional
            assert set(s.needs) - s.optional <= {b.name for b in plan.buffers}, (name, s.name)
        for placements in (plan.placements, *(plan.region(r)[0] for r in ("13", "2"))):
            for a, b in itertools.combinations(placements.values(), 2):
                if a.spec.overlaps_in_time(b.spec):
                    assert not _overlap(a, b), (name, p, pin, a, b)
    assert n > 1500, n  # the grid really is the grid
    assert optional <= seen_names, sorted(optional - seen_names)


# ---- programs ---------------------------------------------------------------------------------------------------
@step
def _write_a(c, a):
    a.fill_(1.0)


@step
def _write_b(c, b):
    b.fill_(2.0)


@step
def _read_a_into_out(c, a):
    c.out.copy_(a)


@step
def _stash(c, a):
    c.state["kept"] = a  # a view outliving its step: forbidden


def _buf(name, n=64):
    return BufferSpec(name, (n,), torch.float32)


def test_lifetimes_follow_the_order_of_the_steps():
    """The same buffers in another step order give other lifetimes, hence other aliasing: a buffer named only by
    a step between a's writer and a's reader can never share a's bytes."""
    between = Program([], [_write_a, _write_b, _read_a_into_out], [], [_buf("a"), _buf("b")]).plan
    assert (between.placements["a"].spec.first, between.placements["a"].spec.last) == (0, 2)
    assert between.placements["a"].offset != between.placements["b"].offset
    after = Program([], [_write_a, _read_a_into_out, _write_b], [], [_buf("a"), _buf("b")]).plan
    assert after.placements["a"].offset == after.placements["b"].offset  # disjoint in time: aliased
    assert after.nbytes < between.nbytes


def test_programs_reject_inconsistent_declarations():
    with pytest.raises(PlanError, match="needs buffer 'a', which no component declares"):
        Program([], [_write_a], [], [])
    with pytest.raises(PlanError, match="'b' is declared but no step names it"):
        Program([], [_write_a], [], [_buf("a"), _buf("b")])
    with pytest.raises(PlanError, match=r"exports \['z'\]"):
        Program([], [_write_a], [], [_buf("a")], exports=["z"])
    with pytest.raises(TypeError, match="must default to None"):
        step(lambda c, a=3: None)
    with pytest.raises(TypeError, match="needs a trailing \\*views parameter"):
        step(lambda c, a: None, group=("b",))
    with pytest.raises(TypeError, match="'views' must be positional"):
        step(lambda c, *views: None)


def test_a_step_group_reaches_a_trailing_star_parameter_in_order():
    seen = []

    @step(group=("b", "a"))
    def _grouped(c, out, *views):
        seen.append(views)

    assert _grouped.needs == ("out", "b", "a") and _grouped.optional == frozenset()
    prog = Program([], [_grouped], [], [_buf("out"), _buf("a"), _buf("b")])
    assert all(prog.plan.placements[n].spec.first == 0 for n in ("out", "a", "b"))
    views = {n: torch.full((1,), float(i)) for i, n in enumerate(("out", "a", "b"))}
    prog.run(1, None, views)
    assert [float(v) for v in seen[0]] == [2.0, 1.0]  # b, then a


class _StashingExperts(Experts):
    def buffers(self, p, launch):
        return [_buf("a", p.H)]

    def steps(self, p, launch):
        return [_write_a, _stash]


def test_a_view_kept_across_steps_is_caught_in_poison_runs():
    """A step that keeps an arena view in the context's state (to use it after its lifetime) fails loudly when
    the manager poisons (the mode every poison test runs in)."""
    kernel = MoEKernel(LocalPrepareFinalize(), _StashingExperts())
    p = MoEProblem(2, 16, 8, 2, 2, 1, torch.float32, torch.float32)
    x = ExpertsInputs(
        torch.randn(2, 16),
        torch.randn(2, 16, 16),
        torch.randn(2, 16, 8),
        torch.ones(2, 1),
        torch.zeros(2, 1, dtype=torch.int32),
    )
    kernel(x, p, manager=WorkspaceManager("cpu"))  # plain mode: no check
    with pytest.raises(PlanError, match=r"left an arena view in state\['kept'\]"):
        kernel(x, p, manager=WorkspaceManager("cpu", poison=True))


# ---- regression: fp8 per-tensor dynamic at small M --------------------------------------------------------------
@pytest.mark.parametrize(
    "device,dtype",
    [
        pytest.param("cpu", torch.float16, marks=interpreter, id="cpu-fp16"),
        pytest.param("cuda", torch.float16, marks=pytest.mark.gpu, id="cuda-fp16"),
        pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu, id="cuda-bf16"),
    ],
)
@pytest.mark.parametrize("M", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 2])
def test_fp8_per_tensor_dynamic_small_m_poison(M, k, device, dtype):
    """M=1..3, E=8, H=I=128: identical bits under poison, zeros, the shared arena and fresh memory, and within fp8
    tolerance of the reference. The per-tensor max scratch must not share bytes with a buffer live at the same
    time (sorted_ids): when it did, the output was inf / 4e30 / zeros depending on the strategy."""
    g = torch.Generator().manual_seed(M * 10 + k)
    E, H, I = 8, 128, 128
    x = torch.randn(M, H, generator=g).to(device, dtype)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(device, dtype)
    q = QuantConfig("fp8_tensor")
    w1q, w2q, s1, s2 = quantize_weights(w1, w2, q)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).int().to(device)
    tw = (torch.rand(M, k, generator=g) + 0.1).to(device)
    outs = [
        fused_moe(
            x,
            w1q,
            w2q,
            tw,
            ids,
            quant=q,
            w1_scale=s1,
            w2_scale=s2,
            backend="triton",
            workspace=WorkspaceManager(device, strategy=s, poison=poison),
        )
        for s, poison in (("shared", True), ("shared", False), ("alloc_zeros", False), ("alloc_empty", True))
    ]
    ref = fused_moe_reference(x, w1q, w2q, tw, ids, quant=q, w1_scale=s1, w2_scale=s2)
    assert relative_error(outs[0], ref) < 6e-2
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


# ---- regression: plans keyed by their launch ----------------------------------------------------------------------
def _small_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    M, E, H, I, k = 8, 4, 32, 32, 2
    x = torch.randn(M, H, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).int()
    return x, w1, w2, torch.rand(M, k, generator=g), ids


@interpreter
def test_changing_the_pinned_block_m_on_the_same_shape():
    """Pin BLOCK_M 16, call, pin 64 on the same shape, call: both right (was: 'scratch buffer must be contiguous
    int32 with >= (...) elements'), and the two plans differ in size."""
    x, w1, w2, tw, ids = _small_case()
    ref = fused_moe_reference(x, w1, w2, tw, ids)
    kernel = MoEKernel(LocalPrepareFinalize(), TritonExperts())
    sizes = []
    for bm in (16, 64, 16):
        with pinned_config(MoEConfig.simple(bm, 32, 32)):
            assert relative_error(fused_moe(x, w1, w2, tw, ids, backend="triton"), ref) < 1e-5
            p = MoEProblem(8, 32, 32, 4, 4, 2, torch.float32, torch.float32)
            sizes.append(kernel.plan(p).nbytes)
    assert sizes[0] == sizes[2] != sizes[1]


def test_config_folder_is_part_of_the_launch(tmp_path, monkeypatch):
    """A table in $FUSEDMOE_CONFIG_DIR changes the launch, and with it the plan."""
    kernel = MoEKernel(LocalPrepareFinalize(), TritonExperts())
    p = MoEProblem(2, 64, 32, 16, 16, 2, torch.float32, torch.float32)
    default = kernel.program(p)
    (tmp_path / config_file_name(16, 32, device_name())).write_text(
        table_to_json({1: MoEConfig.simple(64, 32, 32)}, "test")
    )
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    clear_cache()
    try:
        from_dir = kernel.program(p)
        assert from_dir[2] != default[2] and from_dir[2].config.block_m == 64
        assert from_dir[0].plan.nbytes > default[0].plan.nbytes
        monkeypatch.delenv(ENV_DIR)
        assert kernel.program(p)[2] == default[2]
    finally:
        clear_cache()
