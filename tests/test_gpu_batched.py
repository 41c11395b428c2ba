"""Batched layout on the GPU: bf16 and every fp8 mode vs the float64 reference, and the no-fill contract
(poison equality) eager and under CUDA-graph replay, including the seed's case: fp8 w8a8 batched experts with
garbage in the padded rows of every buffer must give the same result."""

import pytest
import torch

from fusedmoe.experts.base import ExpertsInputs
from fusedmoe.experts.batched_torch_experts import BatchedTorchExperts
from fusedmoe.experts.batched_triton_experts import BatchedTritonExperts
from fusedmoe.kernel import MoEKernel
from fusedmoe.prepare_finalize.batched import BatchedPrepareFinalize
from fusedmoe.problem import MoEProblem
from fusedmoe.quant import QuantConfig, quantize_weights
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.steps import Call, Program
from fusedmoe.workspace.manager import WorkspaceManager, poison_views

pytestmark = pytest.mark.gpu

DEV = "cuda"
QUANTS = [None, "fp8_tensor", "fp8_tensor_static", "fp8_token", "fp8_block"]
SHAPES = [(1, 1024, 512, 16, 4), (77, 2048, 768, 32, 8), (512, 2048, 768, 16, 2)]


def _case(M, H, I, E, k, quant, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, H, device=DEV, generator=g, dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * I, H, device=DEV, generator=g, dtype=torch.bfloat16) / H**0.5
    w2 = torch.randn(E, H, I, device=DEV, generator=g, dtype=torch.bfloat16) / I**0.5
    ids = torch.rand(M, E, device=DEV, generator=g).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    tw = torch.rand(M, k, device=DEV, generator=g) + 0.05
    q = QuantConfig.parse(quant)
    kw = {}
    if q is not None:
        w1, w2, s1, s2 = quantize_weights(w1, w2, q)
        kw = dict(w1_scale=s1, w2_scale=s2)
        if q.static_activation_scale:
            kw.update(a1_scale=torch.tensor([4.0 / 448], device=DEV), a2_scale=torch.tensor([0.5 / 448], device=DEV))
    return x, w1, w2, tw, ids, q, kw


def _kernel(experts=None, cap=None):
    return MoEKernel(BatchedPrepareFinalize(cap), experts or BatchedTritonExperts())


def _problem(x, w1, ids, q):
    M, H = x.shape
    E, two_i, _ = w1.shape
    return MoEProblem(M, H, two_i // 2, E, E, ids.shape[1], x.dtype, w1.dtype, "silu", False, False, q)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_batched_gpu_vs_reference_and_poison(shape, quant):
    x, w1, w2, tw, ids, q, kw = _case(*shape, quant, seed=shape[0])
    p = _problem(x, w1, ids, q)
    k = _kernel()
    assert k.plan(p).zero_nbytes == 0
    inp = ExpertsInputs(x, w1, w2, tw, ids, **kw)
    out = k(inp, p, manager=WorkspaceManager(DEV))
    ref = fused_moe_reference(x, w1, w2, tw, ids, quant=q, **kw)
    assert relative_error(out, ref) < (2e-2 if q is None else 6e-2)
    assert torch.equal(out, k(inp, p, manager=WorkspaceManager(DEV, poison=True)))


def test_batched_torch_experts_gpu():
    x, w1, w2, tw, ids, q, kw = _case(64, 1024, 512, 16, 4, None)
    p = _problem(x, w1, ids, q)
    k = _kernel(BatchedTorchExperts())
    out = k(ExpertsInputs(x, w1, w2, tw, ids), p, manager=WorkspaceManager(DEV, poison=True))
    assert relative_error(out, fused_moe_reference(x, w1, w2, tw, ids)) < 2e-2


@pytest.mark.parametrize("quant", QUANTS)
def test_batched_poison_under_cuda_graph_replay(quant):
    """Capture one call in a CUDA graph on a frozen arena; poison the arena (every byte, padded rows included)
    before each replay; replays with new routing give the eager, unpoisoned result bit for bit."""
    M, H, I, E, k = 96, 1024, 512, 16, 4
    x, w1, w2, tw, ids, q, kw = _case(M, H, I, E, k, quant, seed=1)
    p = _problem(x, w1, ids, q)
    kern = _kernel()
    mgr = WorkspaceManager(DEV)
    with mgr.slot("graph"):  # warm-up and capture run on a side stream: name the slot so they share the arena
        mgr.reserve(kern.plan(p))
    mgr.freeze()
    xs, tws, idss = x.clone(), tw.clone(), ids.clone()
    inp = ExpertsInputs(xs, w1, w2, tws, idss, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), mgr.slot("graph"):
        for _ in range(2):
            kern(inp, p, manager=mgr)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            out = kern(inp, p, manager=mgr)
    torch.cuda.current_stream().wait_stream(s)
    with mgr.slot("graph"):
        ws = mgr.acquire(kern.plan(p))
    for seed in (2, 3, 4):
        x2, _, _, tw2, ids2, _, _ = _case(M, H, I, E, k, None, seed=seed)
        if seed == 4:  # expert 3 gets every token; the other slots avoid it (distinct ids per token)
            v = torch.rand(M, E - 1, device=DEV).argsort(dim=1)[:, : k - 1]
            ids2 = torch.cat([torch.full((M, 1), 3, device=DEV), v + (v >= 3)], dim=1).to(torch.int32)
        xs.copy_(x2)
        tws.copy_(tw2)
        idss.copy_(ids2)
        poison_views(ws)
        graph.replay()
        torch.cuda.synchronize()
        eager = _kernel()(ExpertsInputs(x2, w1, w2, tw2, ids2, **kw), p, manager=WorkspaceManager(DEV))
        assert torch.equal(out, eager), seed


def test_seed_case_fp8_per_tensor_garbage_in_padded_rows():
    """vLLM's BatchedTritonExperts zero-filled its GEMM1 cache for fp8 because padded rows past
    expert_num_tokens fed the per-tensor dynamic scale. Here: garbage (huge values, NaN) in every padded row
    of the batched input and of GEMM1's output, no fill, same result."""
    E, T, H, I = 8, 64, 1024, 512
    g = torch.Generator(device=DEV).manual_seed(7)
    counts = torch.tensor([0, 64, 3, 17, 0, 1, 40, 9], dtype=torch.int32, device=DEV)
    a = torch.randn(E, T, H, device=DEV, generator=g, dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * I, H, device=DEV, generator=g, dtype=torch.bfloat16) / H**0.5
    w2 = torch.randn(E, H, I, device=DEV, generator=g, dtype=torch.bfloat16) / I**0.5
    q = QuantConfig("fp8_tensor")
    w1q, w2q, s1, s2 = quantize_weights(w1, w2, q)
    p = MoEProblem(E * T, H, I, E, E, 1, torch.bfloat16, w1q.dtype, quant=q, max_tokens_per_expert=T)
    ex = BatchedTritonExperts()
    launch = ex.launch(p)
    prog = Program([], ex.steps(p, launch), [], ex.buffers(p, launch))  # the experts alone
    plan = prog.plan
    assert plan.zero_nbytes == 0
    pad = torch.arange(T, device=DEV)[None, :] >= counts[:, None]

    def run(garbage):
        ws = WorkspaceManager(DEV, poison=garbage).acquire(plan)
        x = a.clone()
        if garbage:
            x[pad] = 3.0e4
            x[:, -1][pad[:, -1]] = float("nan")
        out = torch.full((E, T, H), float("nan") if garbage else 0.0, device=DEV, dtype=torch.bfloat16)
        inputs = ExpertsInputs(x, w1q, w2q, None, None, expert_num_tokens=counts, w1_scale=s1, w2_scale=s2)
        prog.run(1, Call(p, launch, inputs, out, ex), ws.views)
        return out[~pad]

    assert torch.equal(run(False), run(True))
