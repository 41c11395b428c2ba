"""BatchedTritonExperts on the CPU (Triton interpreter, float32, tiny shapes) and on CUDA (float32 and bf16, model
shapes, CUDA-graph replay), in float and every fp8 w8a8 mode, vs the float64 reference; and the no-fill contract:
NaN in every workspace byte, padded rows included, gives bit-identical output."""

import pytest
import torch
from devices import INTERPRETING, TRITON_DEVICE_DTYPES, TRITON_DEVICES, interpreter, tolerance

from fusedmoe.experts.base import ExpertsInputs
from fusedmoe.experts.batched_triton_experts import BatchedTritonExperts
from fusedmoe.kernel import MoEKernel
from fusedmoe.ops.batched_quantize import batched_num_partials, batched_quantize
from fusedmoe.ops.configs import MoEConfig, pinned_config
from fusedmoe.prepare_finalize.batched import BatchedPrepareFinalize
from fusedmoe.problem import MoEProblem
from fusedmoe.quant import FP8_DTYPE, QuantConfig, activation_scales, quantize_weights
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.steps import Call, Program
from fusedmoe.workspace.manager import WorkspaceManager, poison_views

#: small tiles keep the interpreter fast; on a GPU the tuned tables decide
PIN = MoEConfig.simple(16, 32, 16)

#: activation dtype per device for the fp8 cases (the interpreter has no bf16)
ACT_DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}


@pytest.fixture(autouse=True)
def _pin():
    if not INTERPRETING:
        yield
        return
    with pinned_config(PIN):
        yield


def _case(M, H, I, E, k, *, device="cpu", dtype=torch.float32, gE=None, quant=None, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    gE = gE or E
    x = torch.randn(M, H, generator=g, device=device).to(dtype)
    w1 = (torch.randn(E, 2 * I, H, generator=g, device=device) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g, device=device) / I**0.5).to(dtype)
    if device == "cpu":
        ids = torch.stack([torch.randperm(gE, generator=g)[:k] for _ in range(M)]).int()
    else:
        ids = torch.rand(M, gE, device=device, generator=g).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    tw = torch.rand(M, k, generator=g, device=device) + 0.1
    q = QuantConfig.parse(quant)
    if q is not None and q.mode == "fp8_block" and device == "cpu":  # blocks of 16 fit the tiny shapes
        q = QuantConfig("fp8_block", block_shape=(16, 16))
    kw = {}
    if q is not None:
        w1, w2, s1, s2 = quantize_weights(w1, w2, q)
        kw = dict(w1_scale=s1, w2_scale=s2)
        if q.static_activation_scale:
            kw.update(
                a1_scale=torch.tensor([3.0 / 448], device=device), a2_scale=torch.tensor([1.0 / 448], device=device)
            )
    return x, w1, w2, tw, ids, q, kw


def _kernel():
    return MoEKernel(BatchedPrepareFinalize(), BatchedTritonExperts())


def _problem(x, w1, ids, q, *, activation="silu", emap=None):
    M, H = x.shape
    E, two_i, _ = w1.shape
    gE = emap.numel() if emap is not None else E
    return MoEProblem(M, H, two_i // 2, E, gE, ids.shape[1], x.dtype, w1.dtype, activation, False, emap is not None, q)


def _run(x, w1, w2, tw, ids, q, kw, *, activation="silu", emap=None, poison=False):
    p = _problem(x, w1, ids, q, activation=activation, emap=emap)
    kernel = _kernel()
    assert kernel.experts.supports(kernel.prepare_finalize.problem(p)) is None
    assert kernel.plan(p).zero_nbytes == 0
    mgr = WorkspaceManager(x.device, poison=poison)
    out = kernel(ExpertsInputs(x, w1, w2, tw, ids, expert_map=emap, **kw), p, manager=mgr)
    assert mgr.stats.bytes_zeroed == 0
    return out


QUANTS = [None, "fp8_tensor", "fp8_tensor_static", "fp8_token", "fp8_block"]
#: (device, (M, H, I, E, k), seed); on the CPU H, I are not multiples of the blocks and E > slots per expert
#: leaves experts without tokens
SHAPES = [pytest.param("cpu", (9, 40, 24, 6, 2), 1, marks=interpreter, id="cpu")] + [
    pytest.param("cuda", shape, shape[0], marks=pytest.mark.gpu, id=f"cuda-M{shape[0]}")
    for shape in [(1, 1024, 512, 16, 4), (77, 2048, 768, 32, 8), (512, 2048, 768, 16, 2)]
]


@pytest.mark.parametrize("device,shape,seed", SHAPES)
@pytest.mark.parametrize("quant", QUANTS)
def test_batched_triton_vs_reference_and_poison(quant, device, shape, seed):
    dtype = ACT_DTYPE[device]
    x, w1, w2, tw, ids, q, kw = _case(*shape, device=device, dtype=dtype, quant=quant, seed=seed)
    out = _run(x, w1, w2, tw, ids, q, kw)
    ref = fused_moe_reference(x, w1, w2, tw, ids, quant=q, **kw)
    assert relative_error(out, ref) < tolerance(dtype, quantized=q is not None)
    assert torch.equal(out, _run(x, w1, w2, tw, ids, q, kw, poison=True))


@pytest.mark.parametrize("device,shape,seed", SHAPES[:2])
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("block_m", [1, 4])
def test_batched_decode_sized_blocks(quant, block_m, device, shape, seed):
    """Tiles of fewer than 16 rows (the multiply-add K loop) over the batched layout's per-expert rows, in float
    and every fp8 mode: the reference, and bit-identical under poison."""
    dtype = ACT_DTYPE[device]
    x, w1, w2, tw, ids, q, kw = _case(*shape, device=device, dtype=dtype, quant=quant, seed=seed)
    with pinned_config(MoEConfig.simple(block_m, 16, 16)):
        out = _run(x, w1, w2, tw, ids, q, kw)
        assert torch.equal(out, _run(x, w1, w2, tw, ids, q, kw, poison=True))
    ref = fused_moe_reference(x, w1, w2, tw, ids, quant=q, **kw)
    assert relative_error(out, ref) < tolerance(dtype, quantized=q is not None)


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize("M,E,k,activation", [(1, 4, 4, "gelu"), (7, 1, 1, "silu"), (5, 8, 1, "swigluoai")])
def test_batched_triton_edges(M, E, k, activation, device, dtype):
    x, w1, w2, tw, ids, q, kw = _case(M, 32, 16, E, k, device=device, dtype=dtype, seed=M)
    out = _run(x, w1, w2, tw, ids, q, kw, activation=activation, poison=True)
    ref = fused_moe_reference(x, w1, w2, tw, ids, activation=activation)
    assert relative_error(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("quant", [None, "fp8_tensor"])
def test_batched_triton_one_expert_gets_all_and_expert_map(quant, device):
    E, gE = 4, 8
    dtype = ACT_DTYPE[device] if quant else torch.float32
    x, w1, w2, tw, ids, q, kw = _case(10, 32, 16, E, 2, gE=gE, quant=quant, device=device, dtype=dtype, seed=4)
    ids[:, 0] = 5  # every token on global expert 5 (local 0)
    ids[:, 1] = torch.where(ids[:, 1] == 5, 2, ids[:, 1])
    emap = torch.full((gE,), -1, dtype=torch.int32, device=device)
    emap[torch.tensor([5, 1, 7, 3], device=device)] = torch.arange(E, dtype=torch.int32, device=device)
    out = _run(x, w1, w2, tw, ids, q, kw, emap=emap)
    assert torch.equal(out, _run(x, w1, w2, tw, ids, q, kw, emap=emap, poison=True))
    if q is None:
        ref = fused_moe_reference(x, w1, w2, tw, ids, expert_map=emap, global_num_experts=gE)
        assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize(
    "device,T,H,I,counts",
    [
        pytest.param("cpu", 8, 32, 16, [0, 8, 3, 5, 0, 1, 6, 2], marks=interpreter, id="cpu"),
        pytest.param("cuda", 64, 1024, 512, [0, 64, 3, 17, 0, 1, 40, 9], marks=pytest.mark.gpu, id="cuda"),
    ],
)
def test_fp8_per_tensor_experts_ignore_garbage_in_padded_rows(device, T, H, I, counts):
    """The per-tensor dynamic activation scale covers the valid rows only: garbage (huge values, NaN) in every
    padded row of the batched input and of GEMM1's output, with no fill, gives the same valid rows."""
    dtype = ACT_DTYPE[device]
    E = len(counts)  # experts with no, few and all T rows
    g = torch.Generator(device=device).manual_seed(7)
    counts = torch.tensor(counts, dtype=torch.int32, device=device)
    a = torch.randn(E, T, H, device=device, generator=g).to(dtype)
    w1 = (torch.randn(E, 2 * I, H, device=device, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device=device, generator=g) / I**0.5).to(dtype)
    q = QuantConfig("fp8_tensor")
    w1q, w2q, s1, s2 = quantize_weights(w1, w2, q)
    p = MoEProblem(E * T, H, I, E, E, 1, dtype, w1q.dtype, quant=q, max_tokens_per_expert=T)
    ex = BatchedTritonExperts()
    launch = ex.launch(p)
    prog = Program([], ex.steps(p, launch), [], ex.buffers(p, launch))  # the experts alone
    plan = prog.plan
    assert plan.zero_nbytes == 0
    pad = torch.arange(T, device=device)[None, :] >= counts[:, None]

    def run(garbage):
        ws = WorkspaceManager(device, poison=garbage).acquire(plan)
        x = a.clone()
        if garbage:
            x[pad] = 3.0e4
            x[:, -1][pad[:, -1]] = float("nan")
        out = torch.full((E, T, H), float("nan") if garbage else 0.0, device=device, dtype=dtype)
        inputs = ExpertsInputs(x, w1q, w2q, None, None, expert_num_tokens=counts, w1_scale=s1, w2_scale=s2)
        prog.run(1, Call(p, launch, inputs, out, ex), ws.views)
        return out[~pad]

    clean = run(False)
    assert torch.isfinite(clean).all()
    assert torch.equal(clean, run(True))


@interpreter
@pytest.mark.parametrize("mode", ["fp8_tensor", "fp8_token", "fp8_block"])
def test_batched_quantize_reads_valid_rows_only(mode):
    """A dynamic scale covers the valid rows only: padded rows hold NaN and huge values, and the scales and the
    quantized valid rows must equal those of the valid rows alone."""
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


# ----------------------------------------------------------------------------------------------------
# CUDA only: CUDA-graph replay on a frozen arena
# ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS)
def test_batched_poison_under_cuda_graph_replay(quant):
    """Capture one call in a CUDA graph on a frozen arena; poison the arena (every byte, padded rows included)
    before each replay; replays with new routing give the eager, unpoisoned result bit for bit."""
    dev = "cuda"
    M, H, I, E, k = 96, 1024, 512, 16, 4
    x, w1, w2, tw, ids, q, kw = _case(M, H, I, E, k, device=dev, dtype=torch.bfloat16, quant=quant, seed=1)
    p = _problem(x, w1, ids, q)
    kern = _kernel()
    mgr = WorkspaceManager(dev)
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
        x2, _, _, tw2, ids2, _, _ = _case(M, H, I, E, k, device=dev, dtype=torch.bfloat16, seed=seed)
        if seed == 4:  # expert 3 gets every token; the other slots avoid it (distinct ids per token)
            v = torch.rand(M, E - 1, device=dev).argsort(dim=1)[:, : k - 1]
            ids2 = torch.cat([torch.full((M, 1), 3, device=dev), v + (v >= 3)], dim=1).to(torch.int32)
        xs.copy_(x2)
        tws.copy_(tw2)
        idss.copy_(ids2)
        poison_views(ws)
        graph.replay()
        torch.cuda.synchronize()
        eager = _kernel()(ExpertsInputs(x2, w1, w2, tw2, ids2, **kw), p, manager=WorkspaceManager(dev))
        assert torch.equal(out, eager), seed
