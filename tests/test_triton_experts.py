"""TritonExperts end to end, on the CPU (Triton interpreter, float32/float16, tiny shapes and pinned small tiles)
and on CUDA (float32 and bf16; plus every preset's shape and CUDA-graph replay): vs the float64 reference in
float and every fp8 mode, edge cases, and poison equality (NaN / 0x7F in every workspace byte gives
bit-identical output)."""

import os
from dataclasses import replace

import pytest
import torch
from devices import INTERPRETING, TRITON_DEVICE_DTYPES, TRITON_DEVICES, interpreter, tolerance

from fusedmoe import LocalPrepareFinalize, MoEKernel
from fusedmoe.experts.base import ExpertsInputs
from fusedmoe.experts.triton_experts import TritonExperts
from fusedmoe.ops.configs import GemmConfig, MoEConfig, pinned_config
from fusedmoe.problem import MoEProblem
from fusedmoe.quant import QuantConfig, quantize_weights
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.tools.presets import PRESETS
from fusedmoe.workspace.manager import WorkspaceManager

#: small tiles keep the interpreter fast; on a GPU the tuned tables decide
PIN = MoEConfig.simple(16, 32, 32)

#: activation dtype per device for the fp8 cases (the interpreter has no bf16)
ACT_DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}


@pytest.fixture(autouse=True)
def _pin():
    if not INTERPRETING:
        yield
        return
    with pinned_config(PIN):
        yield


def _case(M, H, I, E, k, *, device="cpu", dtype=torch.float32, gE=None, ids=None, quant=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    gE = gE or E
    x = torch.randn(M, H, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    if ids is None:
        ids = (
            torch.stack([torch.randperm(gE, generator=g)[:k] for _ in range(M)]).int()
            if M
            else torch.empty(0, k, dtype=torch.int32)
        )
    tw = torch.rand(M, k, generator=g) + 0.1
    x, w1, w2 = (t.to(device, dtype) for t in (x, w1, w2))
    ids, tw = ids.to(device), tw.to(device)
    q = QuantConfig.parse(quant)
    kw = {}
    if q is not None:
        w1, w2, s1, s2 = quantize_weights(w1, w2, q)
        kw = dict(w1_scale=s1, w2_scale=s2)
        if q.static_activation_scale:
            kw.update(
                a1_scale=torch.tensor([3.0 / 448], device=device), a2_scale=torch.tensor([1.0 / 448], device=device)
            )
    return x, w1, w2, tw, ids, q, kw


def _run(
    x, w1, w2, tw, ids, q, kw, *, activation="silu", on_input=False, emap=None, gE=None, poison=False, strategy="shared"
):
    M, H = x.shape
    E, two_i, _ = w1.shape
    gE = gE or (emap.numel() if emap is not None else E)
    p = MoEProblem(M, H, two_i // 2, E, gE, ids.shape[1], x.dtype, w1.dtype, activation, on_input, emap is not None, q)
    ex = TritonExperts()
    assert ex.supports(p) is None
    kernel = MoEKernel(LocalPrepareFinalize(), ex)
    assert kernel.plan(p).zero_nbytes == 0
    out = kernel(
        ExpertsInputs(x, w1, w2, tw, ids, expert_map=emap, **kw),
        p,
        manager=WorkspaceManager(x.device, strategy=strategy, poison=poison),
    )
    ref = fused_moe_reference(
        x,
        w1,
        w2,
        tw,
        ids,
        activation=activation,
        apply_router_weight_on_input=on_input,
        expert_map=emap,
        global_num_experts=gE,
        quant=q,
        **kw,
    )
    return out, ref


def check_pin_against(baseline: MoEConfig, candidate: MoEConfig, case, *, emap=None) -> None:
    """The layer of ``case`` (from :func:`_case`) under the ``candidate`` pin, with poison: finite, within the
    dtype's tolerance of the float64 reference and of the same layer under the ``baseline`` pin."""
    dtype, quantized = case[0].dtype, case[5] is not None
    with pinned_config(baseline):
        want, _ = _run(*case, emap=emap)
    with pinned_config(candidate):
        out, ref = _run(*case, emap=emap, poison=True)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < tolerance(dtype, quantized=quantized)
    assert relative_error(out, want) < tolerance(dtype)


def check_edges(pin: MoEConfig, device: str, dtype: torch.dtype, H: int, I: int) -> None:
    """Under ``pin``, against the float64 reference: M = 1 with top_k = E, and every token on one expert of 8
    (the others without tokens)."""
    with pinned_config(pin):
        out, ref = _run(*_case(1, H, I, 4, 4, device=device, dtype=dtype))
        assert relative_error(out, ref) < tolerance(dtype)
        x, w1, w2, tw, ids, q, kw = _case(9, H, I, 8, 1, device=device, dtype=dtype)
        out, ref = _run(x, w1, w2, tw, torch.full_like(ids, 5), q, kw)
        assert relative_error(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize(
    "M,H,I,E,k,activation,on_input",
    [
        (13, 40, 24, 4, 2, "silu", False),  # H, I not multiples of the blocks
        (9, 64, 48, 8, 3, "gelu", False),
        (7, 40, 24, 4, 2, "silu", True),  # router weight on the input
        (1, 32, 32, 4, 4, "silu", False),  # M=1, top_k=E
        (6, 32, 16, 1, 1, "gelu", False),  # one expert
        (20, 32, 16, 8, 2, "silu", False),  # experts with no tokens (E > slots per expert)
    ],
)
def test_matches_reference(M, H, I, E, k, activation, on_input, device, dtype):
    out, ref = _run(*_case(M, H, I, E, k, device=device, dtype=dtype), activation=activation, on_input=on_input)
    assert out.dtype == dtype and out.device.type == device
    assert relative_error(out, ref) < tolerance(dtype)


@interpreter
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_float16_matches_reference_on_the_interpreter(activation):
    out, ref = _run(*_case(13, 40, 24, 4, 2, dtype=torch.float16), activation=activation)
    assert out.dtype == torch.float16
    assert relative_error(out, ref) < tolerance(torch.float16)


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
def test_all_tokens_on_one_expert(device, dtype):
    ids = torch.full((12, 2), 3, dtype=torch.int32)
    ids[:, 1] = 1
    out, ref = _run(*_case(12, 40, 24, 4, 2, ids=ids, device=device, dtype=dtype))
    assert relative_error(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
def test_expert_map_and_out_of_range_ids(device, dtype):
    emap = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(-3, 11, (11, 3), generator=g, dtype=torch.int32)
    ids[0] = torch.tensor([0, 2, 5])  # a token with no local slot -> zero row
    x, w1, w2, tw, ids, q, kw = _case(11, 40, 24, 4, 3, ids=ids, device=device, dtype=dtype)
    out, ref = _run(x, w1, w2, tw, ids, q, kw, emap=emap)
    assert relative_error(out, ref) < tolerance(dtype)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    # no map: ids in [E, global_E) and outside [0, global_E) are non-local
    out, ref = _run(x, w1, w2, tw, ids, q, kw, gE=8)
    assert relative_error(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_m_zero(device):
    out, ref = _run(*_case(0, 40, 24, 4, 2, device=device))
    assert out.shape == (0, 40) and out.device.type == device


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("quant", ["fp8_tensor", "fp8_tensor_static", "fp8_token", "fp8_block"])
def test_fp8_matches_reference(quant, device):
    dtype = ACT_DTYPE[device]
    emap = torch.tensor([0, -1, 1, 2, 3, -1], dtype=torch.int32, device=device)
    out, ref = _run(*_case(10, 40, 24, 4, 2, gE=6, quant=quant, device=device, dtype=dtype), emap=emap)
    assert relative_error(out, ref) < tolerance(dtype, quantized=True)
    case = _case(10, 40, 24, 4, 2, quant=quant, device=device, dtype=dtype)
    out, ref = _run(*case, on_input=True, activation="gelu")
    assert relative_error(out, ref) < tolerance(dtype, quantized=True)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("quant", [None, "fp8_tensor", "fp8_token", "fp8_block"])
def test_poison_bit_identical(quant, device):
    emap = torch.tensor([0, -1, 1, 2, 3, -1], dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(-2, 8, (9, 2), generator=g, dtype=torch.int32)
    case = _case(9, 40, 24, 4, 2, ids=ids, quant=quant, device=device, dtype=ACT_DTYPE[device])
    clean, _ = _run(*case, emap=emap, strategy="alloc_zeros")
    dirty, _ = _run(*case, emap=emap, poison=True)
    assert torch.isfinite(clean).all()
    assert torch.equal(clean, dirty)


def _weight_only_reference(x, w1, w2, tw, ids, q, kw, **extra):
    """fp8 weights at decode are weight-only (w8a16): the float reference on the dequantized weights, activations
    unquantized."""
    from fusedmoe.quant import dequantize_weight

    if q is None:
        return fused_moe_reference(x, w1, w2, tw, ids, **extra)
    d1, d2 = (dequantize_weight(w, kw[s], q, x.dtype) for w, s in ((w1, "w1_scale"), (w2, "w2_scale")))
    return fused_moe_reference(x, d1, d2, tw, ids, **extra)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("quant", [None, "fp8_tensor", "fp8_tensor_static", "fp8_token", "fp8_block"])
@pytest.mark.parametrize("block_m", [1, 4])
def test_decode_sized_blocks(quant, block_m, device):
    """Blocks of fewer than 16 rows take the multiply-add K loop (no tensor-core tile), fp8 weight-only (the
    activations unquantized, static scales unused): against the float reference on the dequantized weights (with
    non-local experts; activation on the input side for one), bit-identical under poison, no fp8 scratch planned;
    K and N not multiples of the tiles."""
    dtype = ACT_DTYPE[device] if quant else (torch.float32 if device == "cpu" else torch.bfloat16)
    emap = torch.tensor([0, -1, 1, 2, 3, -1], dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(-2, 6, (9, 2), generator=g, dtype=torch.int32)
    case = _case(9, 40, 24, 4, 2, ids=ids, quant=quant, device=device, dtype=dtype)
    tol = tolerance(dtype)
    with pinned_config(MoEConfig.simple(block_m, 16, 32)):
        clean, _ = _run(*case, emap=emap, strategy="alloc_zeros")
        dirty, _ = _run(*case, emap=emap, poison=True)
        ref = _weight_only_reference(*case, expert_map=emap, global_num_experts=6)
        assert relative_error(clean, ref) < tol and torch.isfinite(clean).all() and torch.equal(clean, dirty)
        small = _case(7, 40, 24, 4, 2, quant=quant, device=device, dtype=dtype)
        out, _ = _run(*small, on_input=True)
        assert relative_error(out, _weight_only_reference(*small, apply_router_weight_on_input=True)) < tol
        x, w1, _, _, ids7, q, _ = small
        p = MoEProblem(7, 40, 24, 4, 4, 2, x.dtype, w1.dtype, quant=q)
        names = {b.name for b in MoEKernel(LocalPrepareFinalize(), TritonExperts()).plan(p).buffers}
        assert not {"a1q", "a2q", "a1_scale", "a2_scale"} & names


def test_small_tiles_compile_without_dots():
    """Tiles of fewer than 16 rows take the multiply-add K loops in every format: the grouped GEMM compiled for
    sm_90 offline (scripts/compile_probe.py, no GPU needed) has no mma/wgmma at BLOCK_M 1 and 4 for bf16, fp8
    per-token, fp8 128-block and both MXFP4 codes; at 16 rows MXFP4's scaled dot is a tensor-core one."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).resolve().parent.parent / "scripts" / "compile_probe.py"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    runs = (("0,2,3,4,5", "1,16,128:4,16,128"), ("5", "16,32,64"))
    dots = {}
    for quant, tiles in runs:
        out = subprocess.run(
            [sys.executable, str(probe), "--quant", quant, "--tiles", tiles, "--warps", "4", "--stages", "2"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for q, bm, dot in re.findall(r"QUANT=(\d+) tile (\d+)x\S+ .*?'dot': '([^']+)'", out):
            dots[int(q), int(bm)] = dot
    assert {key: d for key, d in dots.items() if key[1] < 16} == {
        (q, bm): "fma" for q in (0, 2, 3, 4, 5) for bm in (1, 4)
    }
    assert dots[5, 16] in ("wgmma", "mma.sync")


@pytest.mark.slow
@interpreter
def test_multi_program_alignment_path(monkeypatch):
    """The two-launch alignment (its planned histogram buffer poisoned too) inside the whole layer."""
    import fusedmoe.ops.align as align
    from fusedmoe.api import get_kernel

    def clear():
        align.align_params.cache_clear()
        get_kernel("triton")._programs.clear()

    monkeypatch.setattr(align, "SINGLE_MAX_SLOTS", 256)  # 70 * 8 = 560 slots -> two launches
    clear()
    try:
        assert align.align_params(560, 16, 16).launches == 2
        case = _case(70, 32, 16, 16, 8)
        clean, ref = _run(*case, strategy="alloc_zeros")
        dirty, _ = _run(*case, poison=True)
        assert relative_error(clean, ref) < 1e-5 and torch.equal(clean, dirty)
    finally:
        monkeypatch.undo()
        clear()


@interpreter
def test_plan_is_pure_and_aliases():
    kernel = MoEKernel(LocalPrepareFinalize(), TritonExperts())
    p = MoEProblem(64, 2048, 768, 128, 128, 8, torch.float32, torch.float32)
    a, b = kernel.plan(p), MoEKernel(LocalPrepareFinalize(), TritonExperts()).plan(p)
    assert a == b
    names = {s.name for s in a.buffers}
    assert {"sorted_ids", "block_expert", "num_padded", "act", "y"} <= names
    q = MoEProblem(64, 2048, 768, 128, 128, 8, torch.float32, torch.float8_e4m3fn, quant=QuantConfig("fp8_tensor"))
    plan = kernel.plan(q)
    assert plan.nbytes < plan.sum_nbytes  # y reuses the bytes of buffers dead before GEMM2
    assert all(s.zero is None for s in plan.buffers)


@interpreter
def test_supports_reasons():
    ex = TritonExperts()
    bf = MoEProblem(4, 32, 16, 4, 4, 2, torch.bfloat16, torch.bfloat16)
    assert isinstance(ex.supports(bf), str)  # interpreter: bf16 unsupported
    mixed = MoEProblem(4, 32, 16, 4, 4, 2, torch.float32, torch.float16)
    assert isinstance(ex.supports(mixed), str)
    fp8 = MoEProblem(4, 32, 16, 4, 4, 2, torch.float32, torch.float32, quant=QuantConfig("fp8_token"))
    assert isinstance(ex.supports(fp8), str)


# ----------------------------------------------------------------------------------------------------
# CUDA only: every preset's shape (bf16 and the fp8 modes) and CUDA-graph replay on a frozen shared arena
# ----------------------------------------------------------------------------------------------------

DEV = "cuda"
MS = (1, 3, 64, 777, 4096)
#: local experts kept per preset (an EP slice keeps memory and reference time sane); routing is over all.
MAX_LOCAL = {"qwen3-235b-a22b": 32, "deepseek-v3": 32, "qwen3-30b-a3b": 128}
_WEIGHTS: dict = {}


def _preset_weights(name, E, H, I, quant):
    key = (name, E, quant)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        g = torch.Generator(device=DEV).manual_seed(0)
        w1 = torch.randn(E, 2 * I, H, device=DEV, generator=g, dtype=torch.bfloat16) / H**0.5
        w2 = torch.randn(E, H, I, device=DEV, generator=g, dtype=torch.bfloat16) / I**0.5
        kw = {}
        q = QuantConfig.parse(quant)
        if q is not None:
            w1, w2, s1, s2 = quantize_weights(w1, w2, q)
            kw = dict(w1_scale=s1, w2_scale=s2)
            if q.static_activation_scale:
                kw.update(
                    a1_scale=torch.tensor([4.0 / 448], device=DEV), a2_scale=torch.tensor([0.5 / 448], device=DEV)
                )
        _WEIGHTS[key] = (w1, w2, q, kw)
    return _WEIGHTS[key]


def _preset_inputs(M, H, gE, k, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, H, device=DEV, generator=g, dtype=torch.bfloat16)
    ids = torch.rand(M, gE, device=DEV, generator=g).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    tw = torch.rand(M, k, device=DEV, generator=g) + 0.05
    return x, ids, tw


def _preset_problem(M, H, I, E, gE, k, w1, q, emap):
    return MoEProblem(M, H, I, E, gE, k, torch.bfloat16, w1.dtype, "silu", False, emap is not None, q)


def _slice_map(E, gE):
    if E == gE:
        return None
    m = torch.full((gE,), -1, dtype=torch.int32, device=DEV)
    m[torch.randperm(gE, generator=torch.Generator().manual_seed(3))[:E].to(DEV)] = torch.arange(
        E, dtype=torch.int32, device=DEV
    )
    return m


# (deepseek-v3-routed is deepseek-v3's layer with all its experts: sliced to 32 here, the same case)
PRESET_CASES = [(name, "bf16", M) for name in PRESETS if name != "deepseek-v3-routed" for M in MS]
PRESET_CASES += [
    ("qwen3-30b-a3b", qm, M)
    for qm in ("fp8_tensor", "fp8_tensor_static", "fp8_token", "fp8_block")
    for M in (1, 64, 777)
]
PRESET_CASES += [("deepseek-v3", "fp8_block", M) for M in (3, 777)] + [("mixtral-8x7b", "fp8_token", 64)]


@pytest.mark.gpu
@pytest.mark.big_gpu
@pytest.mark.parametrize("name,dtype,M", PRESET_CASES)
def test_preset_vs_reference(name, dtype, M):
    pr = PRESETS[name]
    gE, k, H, I = pr.num_experts, pr.top_k, pr.hidden_size, pr.intermediate_size
    E = min(pr.experts_on_gpu, MAX_LOCAL.get(name, pr.experts_on_gpu))
    w1, w2, q, kw = _preset_weights(name, E, H, I, None if dtype == "bf16" else dtype)
    emap = _slice_map(E, gE)
    x, ids, tw = _preset_inputs(M, H, gE, k, seed=M)
    p = _preset_problem(M, H, I, E, gE, k, w1, q, emap)
    kernel = MoEKernel(LocalPrepareFinalize(), TritonExperts())
    assert kernel.unsupported(p) is None
    out = kernel(
        ExpertsInputs(x, w1, w2, tw, ids, expert_map=emap, **kw), p, manager=WorkspaceManager(DEV, poison=True)
    )
    ref = fused_moe_reference(x, w1, w2, tw, ids, expert_map=emap, global_num_experts=gE, quant=q, **kw)
    if ref.norm() == 0:  # an EP slice may own none of the chosen experts
        assert (out == 0).all()
    else:
        assert relative_error(out, ref) < tolerance(torch.bfloat16, quantized=q is not None)


@pytest.mark.gpu
@pytest.mark.big_gpu
@pytest.mark.parametrize("quant", [None, "fp8_tensor", "fp8_token", "fp8_block"])
@pytest.mark.parametrize("M", [1, 200])
def test_poison_eager_and_cuda_graph(quant, M):
    name = "qwen3-30b-a3b"
    pr = PRESETS[name]
    E, k, H, I = 64, pr.top_k, pr.hidden_size, pr.intermediate_size
    gE = 128
    w1, w2, q, kw = _preset_weights(name + "-slice", E, H, I, quant)
    emap = _slice_map(E, gE)
    p = _preset_problem(M, H, I, E, gE, k, w1, q, emap)
    kernel = MoEKernel(LocalPrepareFinalize(), TritonExperts())
    plan = kernel.plan(p)

    def eager(x, ids, tw, mgr):
        return kernel(ExpertsInputs(x, w1, w2, tw, ids, expert_map=emap, **kw), p, manager=mgr)

    a = _preset_inputs(M, H, gE, k, seed=1)
    clean = eager(*a, WorkspaceManager(DEV, strategy="alloc_zeros"))
    assert torch.isfinite(clean).all()
    assert torch.equal(clean, eager(*a, WorkspaceManager(DEV, poison=True)))

    mgr = WorkspaceManager(DEV, strategy="shared", poison=True)
    mgr.reserve(plan)
    mgr.freeze()
    x_s, ids_s, tw_s = (t.clone() for t in a)
    out_s = torch.empty(M, H, device=DEV, dtype=torch.bfloat16)
    ws = mgr.acquire(plan)  # poisoned before capture; the graph itself fills nothing
    inputs = ExpertsInputs(x_s, w1, w2, tw_s, ids_s, expert_map=emap, **kw)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel.run(inputs, p, ws, out_s)  # warm up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.run(inputs, p, ws, out_s)
    b = _preset_inputs(M, H, gE, k, seed=2)
    for dst, src in zip((x_s, ids_s, tw_s), b):
        dst.copy_(src)
    ws.views["y"].fill_(float("nan"))  # stale garbage between replays must not matter
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_s, eager(*b, WorkspaceManager(DEV, strategy="alloc_zeros")))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp8_tensor", "fp8_token", "fp8_block"])
@pytest.mark.parametrize("layout", ["standard", "batched"])
def test_gpu_fp8_with_k_below_an_fp8_dot_tile(mode, layout):
    """I = 16 (GEMM2's K) is below the 32-deep minimum of an fp8 dot on the GPU: the launch widens BLOCK_K (the K
    loop masks the rest) instead of failing to compile; 16-wide fp8_block scale groups are refused by name."""
    from fusedmoe import fused_moe, route
    from fusedmoe.api import get_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    M, E, k, H, I = 10, 4, 2, 64, 16
    x = torch.randn(M, H, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).bfloat16()
    tw, ids = route(torch.randn(M, E, device="cuda", generator=g), k)
    q = QuantConfig(mode, block_shape=(16, 32)) if mode == "fp8_block" else QuantConfig(mode)
    w1q, w2q, s1, s2 = quantize_weights(w1, w2, q)
    if layout == "standard":
        out = fused_moe(x, w1q, w2q, tw, ids, quant=q, w1_scale=s1, w2_scale=s2)
    else:
        from fusedmoe import BatchedPrepareFinalize, BatchedTritonExperts

        kernel = MoEKernel(BatchedPrepareFinalize(M * k), BatchedTritonExperts())
        p = MoEProblem(M=M, H=H, I=I, E=E, global_E=E, top_k=k, dtype=torch.bfloat16, weight_dtype=w1q.dtype, quant=q)
        out = kernel(ExpertsInputs(x, w1q, w2q, tw, ids, w1_scale=s1, w2_scale=s2), p, manager=WorkspaceManager("cuda"))
    ref = fused_moe_reference(x, w1, w2, tw, ids)
    assert relative_error(out, ref) < 0.1  # fp8 weights and activations
    if mode == "fp8_block":
        narrow = QuantConfig(mode, block_shape=(16, 16))
        p16 = MoEProblem(
            M=M, H=H, I=I, E=E, global_E=E, top_k=k, dtype=torch.bfloat16, weight_dtype=w1q.dtype, quant=narrow
        )
        assert "needs scale groups of >= 32" in get_kernel("triton").unsupported(p16)


@interpreter
def test_y_dtype_follows_gemm2s_grid():
    """GEMM2's weighted rows ``y`` are float32 (one rounding in the top-k sum), except under a flattened
    persistent GEMM2, whose output tile must fit in shared memory: there they take the activation dtype."""
    kernel = MoEKernel(LocalPrepareFinalize(), TritonExperts())
    g = GemmConfig(16, 32, 32, num_warps=4, num_stages=2)
    for dtype in (torch.bfloat16, torch.float32):
        p = MoEProblem(64, 256, 128, 8, 8, 2, dtype, dtype)
        cases = ((g, torch.float32), (replace(g, persistent=2), dtype), (replace(g, persistent=1), torch.float32))
        for gemm2, want in cases:
            with pinned_config(MoEConfig(g, gemm2)):
                (y,) = [s for s in kernel.plan(p).buffers if s.name == "y"]
            assert y.dtype == want and tuple(y.shape) == (64 * 2, 256)
