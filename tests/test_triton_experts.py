"""TritonExperts end to end on the CPU interpreter: float32 and fp8 vs the float64 reference, edge cases,
and poison equality (NaN / 0x7F in every workspace byte gives bit-identical output)."""

import os

import pytest
import torch

from fusedmoe import LocalPrepareFinalize, MoEKernel
from fusedmoe.experts.base import ExpertsInputs
from fusedmoe.experts.triton_experts import TritonExperts
from fusedmoe.ops.configs import MoEConfig, pinned_config
from fusedmoe.problem import MoEProblem
from fusedmoe.quant import QuantConfig, quantize_weights
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.workspace.manager import WorkspaceManager

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU-interpreter tests; the GPU runs tests/test_gpu_triton.py"
)

PIN = MoEConfig.simple(16, 32, 32)


@pytest.fixture(autouse=True)
def _pin():
    with pinned_config(PIN):
        yield


def _case(M, H, I, E, k, *, gE=None, ids=None, quant=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    gE = gE or E
    x = torch.randn(M, H, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    if ids is None:
        ids = (torch.stack([torch.randperm(gE, generator=g)[:k] for _ in range(M)]).int() if M
               else torch.empty(0, k, dtype=torch.int32))
    tw = torch.rand(M, k, generator=g) + 0.1
    q = QuantConfig.parse(quant)
    kw = {}
    if q is not None:
        w1, w2, s1, s2 = quantize_weights(w1, w2, q)
        kw = dict(w1_scale=s1, w2_scale=s2)
        if q.static_activation_scale:
            kw.update(a1_scale=torch.tensor([3.0 / 448]), a2_scale=torch.tensor([1.0 / 448]))
    return x, w1, w2, tw, ids, q, kw


def _run(x, w1, w2, tw, ids, q, kw, *, activation="silu", on_input=False, emap=None, gE=None, poison=False,
         strategy="shared"):
    M, H = x.shape
    E, two_i, _ = w1.shape
    gE = gE or (emap.numel() if emap is not None else E)
    p = MoEProblem(M, H, two_i // 2, E, gE, ids.shape[1], x.dtype, w1.dtype, activation, on_input,
                   emap is not None, q)
    ex = TritonExperts()
    assert ex.supports(p) is None
    kernel = MoEKernel(LocalPrepareFinalize(), ex)
    assert kernel.plan(p).zero_nbytes == 0
    out = kernel(ExpertsInputs(x, w1, w2, tw, ids, expert_map=emap, **kw), p,
                 manager=WorkspaceManager("cpu", strategy=strategy, poison=poison))
    ref = fused_moe_reference(x, w1, w2, tw, ids, activation=activation, apply_router_weight_on_input=on_input,
                              expert_map=emap, global_num_experts=gE, quant=q, **kw)
    return out, ref


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
def test_fp32_matches_reference(M, H, I, E, k, activation, on_input):
    out, ref = _run(*_case(M, H, I, E, k), activation=activation, on_input=on_input)
    assert relative_error(out, ref) < 1e-5


def test_all_tokens_on_one_expert():
    ids = torch.full((12, 2), 3, dtype=torch.int32)
    ids[:, 1] = 1
    out, ref = _run(*_case(12, 40, 24, 4, 2, ids=ids))
    assert relative_error(out, ref) < 1e-5


def test_expert_map_and_out_of_range_ids():
    emap = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(-3, 11, (11, 3), generator=g, dtype=torch.int32)
    ids[0] = torch.tensor([0, 2, 5])  # a token with no local slot -> zero row
    x, w1, w2, tw, ids, q, kw = _case(11, 40, 24, 4, 3, ids=ids)
    out, ref = _run(x, w1, w2, tw, ids, q, kw, emap=emap)
    assert relative_error(out, ref) < 1e-5
    assert torch.equal(out[0], torch.zeros(40))
    # no map: ids in [E, global_E) and outside [0, global_E) are non-local
    out, ref = _run(x, w1, w2, tw, ids, q, kw, gE=8)
    assert relative_error(out, ref) < 1e-5


def test_m_zero():
    out, ref = _run(*_case(0, 40, 24, 4, 2))
    assert out.shape == (0, 40)


@pytest.mark.parametrize("quant", ["fp8_tensor", "fp8_tensor_static", "fp8_token", "fp8_block"])
def test_fp8_matches_reference(quant):
    emap = torch.tensor([0, -1, 1, 2, 3, -1], dtype=torch.int32)
    out, ref = _run(*_case(10, 40, 24, 4, 2, gE=6, quant=quant), emap=emap)
    assert relative_error(out, ref) < 6e-2
    out, ref = _run(*_case(10, 40, 24, 4, 2, quant=quant), on_input=True, activation="gelu")
    assert relative_error(out, ref) < 6e-2


@pytest.mark.parametrize("quant", [None, "fp8_tensor", "fp8_token", "fp8_block"])
def test_poison_bit_identical(quant):
    emap = torch.tensor([0, -1, 1, 2, 3, -1], dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(-2, 8, (9, 2), generator=g, dtype=torch.int32)
    case = _case(9, 40, 24, 4, 2, ids=ids, quant=quant)
    clean, _ = _run(*case, emap=emap, strategy="alloc_zeros")
    dirty, _ = _run(*case, emap=emap, poison=True)
    assert torch.isfinite(clean).all()
    assert torch.equal(clean, dirty)


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


def test_supports_reasons():
    ex = TritonExperts()
    bf = MoEProblem(4, 32, 16, 4, 4, 2, torch.bfloat16, torch.bfloat16)
    assert isinstance(ex.supports(bf), str)  # interpreter: bf16 unsupported
    mixed = MoEProblem(4, 32, 16, 4, 4, 2, torch.float32, torch.float16)
    assert isinstance(ex.supports(mixed), str)
    fp8 = MoEProblem(4, 32, 16, 4, 4, 2, torch.float32, torch.float32, quant=QuantConfig("fp8_token"))
    assert isinstance(ex.supports(fp8), str)
