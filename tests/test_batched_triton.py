"""BatchedTritonExperts on the CPU interpreter (float32 and fp8 w8a8 in every mode) vs the float64 reference,
and the no-fill contract: NaN in every workspace byte, padded rows included, gives bit-identical output."""

import os

import pytest
import torch

from fusedmoe.experts.base import ExpertsInputs
from fusedmoe.experts.batched_triton_experts import BatchedTritonExperts
from fusedmoe.kernel import MoEKernel
from fusedmoe.ops.batched_quantize import batched_num_partials, batched_quantize
from fusedmoe.ops.configs import MoEConfig, pinned_config
from fusedmoe.prepare_finalize.batched import BatchedPrepareFinalize
from fusedmoe.problem import MoEProblem
from fusedmoe.quant import FP8_DTYPE, QuantConfig, activation_scales, quantize_weights
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.workspace.manager import WorkspaceManager

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU-interpreter tests; the GPU runs tests/test_gpu_batched.py"
)

PIN = MoEConfig.simple(16, 32, 16)


@pytest.fixture(autouse=True)
def _pin():
    with pinned_config(PIN):
        yield


def _case(M, H, I, E, k, *, gE=None, quant=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    gE = gE or E
    x = torch.randn(M, H, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    ids = torch.stack([torch.randperm(gE, generator=g)[:k] for _ in range(M)]).int()
    tw = torch.rand(M, k, generator=g) + 0.1
    q = QuantConfig.parse(quant)
    if q is not None and q.mode == "fp8_block":
        q = QuantConfig("fp8_block", block_shape=(16, 16))
    kw = {}
    if q is not None:
        w1, w2, s1, s2 = quantize_weights(w1, w2, q)
        kw = dict(w1_scale=s1, w2_scale=s2)
        if q.static_activation_scale:
            kw.update(a1_scale=torch.tensor([3.0 / 448]), a2_scale=torch.tensor([1.0 / 448]))
    return x, w1, w2, tw, ids, q, kw


def _run(x, w1, w2, tw, ids, q, kw, *, activation="silu", emap=None, poison=False):
    M, H = x.shape
    E, two_i, _ = w1.shape
    gE = emap.numel() if emap is not None else E
    p = MoEProblem(M, H, two_i // 2, E, gE, ids.shape[1], x.dtype, w1.dtype, activation, False, emap is not None, q)
    kernel = MoEKernel(BatchedPrepareFinalize(), BatchedTritonExperts())
    assert kernel.experts.supports(kernel.prepare_finalize.problem(p)) is None
    assert kernel.plan(p).zero_nbytes == 0
    mgr = WorkspaceManager("cpu", poison=poison)
    out = kernel(ExpertsInputs(x, w1, w2, tw, ids, expert_map=emap, **kw), p, manager=mgr)
    assert mgr.stats.bytes_zeroed == 0
    return out


QUANTS = [None, "fp8_tensor", "fp8_tensor_static", "fp8_token", "fp8_block"]


@pytest.mark.parametrize("quant", QUANTS)
def test_batched_triton_vs_reference_and_poison(quant):
    # H, I not multiples of the blocks; E > slots per expert leaves experts without tokens
    x, w1, w2, tw, ids, q, kw = _case(9, 40, 24, 6, 2, quant=quant, seed=1)
    out = _run(x, w1, w2, tw, ids, q, kw)
    ref = fused_moe_reference(x, w1, w2, tw, ids, quant=q, **kw)
    assert relative_error(out, ref) < (1e-5 if q is None else 6e-2)
    assert torch.equal(out, _run(x, w1, w2, tw, ids, q, kw, poison=True))


@pytest.mark.parametrize("M,E,k,activation", [(1, 4, 4, "gelu"), (7, 1, 1, "silu"), (5, 8, 1, "swigluoai")])
def test_batched_triton_edges(M, E, k, activation):
    x, w1, w2, tw, ids, q, kw = _case(M, 32, 16, E, k, seed=M)
    out = _run(x, w1, w2, tw, ids, q, kw, activation=activation, poison=True)
    ref = fused_moe_reference(x, w1, w2, tw, ids, activation=activation)
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("quant", [None, "fp8_tensor"])
def test_batched_triton_one_expert_gets_all_and_expert_map(quant):
    E, gE = 4, 8
    x, w1, w2, tw, ids, q, kw = _case(10, 32, 16, E, 2, gE=gE, quant=quant, seed=4)
    ids[:, 0] = 5  # every token on global expert 5 (local 0)
    ids[:, 1] = torch.where(ids[:, 1] == 5, 2, ids[:, 1])
    emap = torch.full((gE,), -1, dtype=torch.int32)
    emap[torch.tensor([5, 1, 7, 3])] = torch.arange(E, dtype=torch.int32)
    out = _run(x, w1, w2, tw, ids, q, kw, emap=emap)
    assert torch.equal(out, _run(x, w1, w2, tw, ids, q, kw, emap=emap, poison=True))
    if q is None:
        ref = fused_moe_reference(x, w1, w2, tw, ids, expert_map=emap, global_num_experts=gE)
        assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("mode", ["fp8_tensor", "fp8_token", "fp8_block"])
def test_batched_quantize_reads_valid_rows_only(mode):
    """The seed's bug: a per-tensor dynamic scale over padded rows. Padded rows hold NaN and huge values;
    the scales and the quantized valid rows must equal those of the valid rows alone."""
    E, T, K = 3, 5, 32
    counts = torch.tensor([2, 0, 5], dtype=torch.int32)
    x = torch.full((E * T, K), float("nan"))
    x[1::2] = 1e6  # garbage that would dominate an amax
    valid = torch.cat([torch.arange(e * T, e * T + int(c)) for e, c in enumerate(counts)])
    x[valid] = torch.randn(len(valid), K)
    q = torch.full((E * T, K), 0.5).to(FP8_DTYPE)
    gk = 16
    shape = {"fp8_tensor": (1,), "fp8_token": (E * T, 1), "fp8_block": (E * T, K // gk)}[mode]
    scale = torch.full(shape, float("nan"))
    partial = torch.full((batched_num_partials(E, T),), float("nan"))
    batched_quantize(x, counts, T, mode, out=q, scale_out=scale, partial=partial, group_k=gk)
    qc = QuantConfig(mode, block_shape=(gk, gk))
    ref_scale = activation_scales(x[valid], qc)
    got = scale if mode == "fp8_tensor" else scale[valid]
    assert torch.equal(got, ref_scale)
    s = ref_scale.repeat_interleave(gk, dim=1) if mode == "fp8_block" else ref_scale
    assert torch.equal(q[valid].float(), (x[valid] / s).clamp(-448, 448).to(FP8_DTYPE).float())
