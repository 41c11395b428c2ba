"""The torch experts' fp8 (w8a8) emulation, which serves fp8 weights on any device: every fp8 mode against the
float64 reference (which models the same e4m3 roundings) over the edge grid with poisoned scratch, and the Triton
kernels (interpreter) within the fp8 tolerance of it."""

import pytest
import torch
from devices import interpreter, tolerance

from fusedmoe import fused_moe
from fusedmoe.experts.torch_experts import TorchExperts
from fusedmoe.problem import MoEProblem
from fusedmoe.quant import FP8_DTYPE, QuantConfig, quantize_weights
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.workspace.manager import WorkspaceManager

#: fp8_block also with 64x32 blocks (whole blocks along K: the broadcast path) and 96x64 blocks (a block row
#: straddles the 256-row weight chunks; the torch experts only: the Triton kernels take powers of two)
MODES = [
    "fp8_tensor",
    "fp8_tensor_static",
    "fp8_token",
    "fp8_block",
    QuantConfig("fp8_block", block_shape=(64, 32)),
    QuantConfig("fp8_block", block_shape=(96, 64)),
]
#: float32 activations: the emulation rounds exactly where the reference does, so only float32 against float64
#: GEMM rounding separates them (measured: below 2e-5); a missing or misplaced rounding step costs ~5%.
EMULATION_TOL = 1e-3

# H = 160 and I = 96 leave partial 128-wide fp8 blocks along both dimensions of both weights.
H, I = 160, 96
CASES = {
    "plain": dict(M=7, E=4, k=2),
    # rows past one W_CHUNK (256) of both weights, and K not a multiple of the block width
    "two_chunks": dict(M=5, E=2, k=2, H=300, I=200),
    # the largest |x| belongs to a token routed only to other ranks' experts: GEMM1's per-tensor scale still
    # spans it (the kernels quantize x over all tokens)
    "max_token_not_local": dict(M=6, E=4, k=2, global_E=8, ids=torch.tensor([[0, 2]] + [[1, 3]] * 5), boost=0),
    "M1": dict(M=1, E=4, k=2),
    "topk_equals_E": dict(M=5, E=4, k=4),
    "all_on_one": dict(M=6, E=4, k=1, ids=torch.full((6, 1), 2)),
    "idle_experts": dict(M=9, E=8, k=2, ids=torch.tensor([[0, 1], [1, 0]] * 4 + [[0, 1]])),
    "expert_map": dict(M=8, E=4, k=3, global_E=8),
    "on_input": dict(M=6, E=4, k=1, on_input=True),
    "bias": dict(M=5, E=4, k=2, bias=True),
    "empty": dict(M=0, E=4, k=2),
}


def _call(
    mode, M, E, k, *, H=H, I=I, ids=None, global_E=None, on_input=False, bias=False, boost=None, dtype=torch.float32
):
    """(args, keywords) of one fused_moe call with ``mode``'s fp8 weights on the CPU (token ``boost`` scaled 8x)."""
    g = torch.Generator().manual_seed(0)
    gE = global_E or E
    x = torch.randn(M, H, generator=g)
    if boost is not None:
        x[boost] *= 8
    x = x.to(dtype)
    w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    if ids is None:
        ids = torch.stack([torch.randperm(gE, generator=g)[:k] for _ in range(M)]) if M else torch.empty(0, k)
    tw = torch.rand(M, k, generator=g) + 0.1
    q = QuantConfig.parse(mode)
    w1q, w2q, s1, s2 = quantize_weights(w1, w2, q)
    kw = dict(quant=q, w1_scale=s1, w2_scale=s2)
    if q.static_activation_scale:
        kw.update(a1_scale=torch.tensor([4.0 / 448]), a2_scale=torch.tensor([0.5 / 448]))
    if global_E:  # experts 1, 3, 5, 7 of 8 are local, in reverse order; the others belong to other ranks
        emap = torch.full((gE,), -1, dtype=torch.int32)
        emap[torch.tensor([7, 5, 3, 1])] = torch.arange(E, dtype=torch.int32)
        kw.update(expert_map=emap, global_num_experts=gE)
    if on_input:
        kw["apply_router_weight_on_input"] = True
    if bias:
        kw.update(w1_bias=torch.randn(E, 2 * I, generator=g), w2_bias=torch.randn(E, H, generator=g))
    return (x, w1q, w2q, tw, ids.to(torch.int32)), kw


def _id(mode) -> str:
    return mode if isinstance(mode, str) else f"{mode.mode}_{mode.block_shape[0]}x{mode.block_shape[1]}"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", MODES, ids=_id)
def test_torch_fp8_matches_the_reference_roundings(mode, case):
    args, kw = _call(mode, **CASES[case])
    out = fused_moe(*args, backend="torch", workspace=WorkspaceManager("cpu", poison=True), **kw)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    if args[0].shape[0] == 0:
        return
    ref = fused_moe_reference(*args, **kw)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < EMULATION_TOL


@pytest.mark.parametrize("mode", MODES, ids=_id)
def test_torch_fp8_bf16_activations(mode):
    """bf16 inputs and output: within the fp8 tolerance of the float64 reference (bf16 roundings on top of the
    fp8 ones)."""
    args, kw = _call(mode, M=7, E=4, k=2, dtype=torch.bfloat16)
    out = fused_moe(*args, backend="torch", workspace=WorkspaceManager("cpu", poison=True), **kw)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, fused_moe_reference(*args, **kw)) < tolerance(torch.bfloat16, quantized=True)


def test_torch_fp8_rounds_activations_not_only_weights():
    """The emulation is w8a8: the same call on float weights dequantized from the fp8 ones (w8a16, no activation
    rounding) differs by more than the emulation's tolerance, so the activation rounding is really applied."""
    from fusedmoe.quant import dequantize_weight

    args, kw = _call("fp8_token", M=7, E=4, k=2)
    x, w1q, w2q, tw, ids = args
    out = fused_moe(*args, backend="torch", **kw)
    w1f = dequantize_weight(w1q, kw["w1_scale"], kw["quant"])
    w2f = dequantize_weight(w2q, kw["w2_scale"], kw["quant"])
    weight_only = fused_moe(x, w1f, w2f, tw, ids, backend="torch")
    assert relative_error(out, weight_only) > EMULATION_TOL
    assert relative_error(out, fused_moe_reference(*args, **kw)) < EMULATION_TOL


@pytest.mark.parametrize("mode", MODES, ids=_id)
def test_torch_fp8_takes_rows_quantized_by_prepare(mode):
    """e4m3 hidden_states with their a1_scale (what expert parallelism's prepare hands over) give the call on the
    float rows they came from: dequantized, not rounded again."""
    from fusedmoe import LocalPrepareFinalize, MoEKernel
    from fusedmoe.experts.base import ExpertsInputs
    from fusedmoe.quant import activation_scales, per_element_scales

    (x, w1q, w2q, tw, ids), kw = _call(mode, M=7, E=4, k=2)
    q = kw["quant"]
    a1 = activation_scales(x, q, kw.get("a1_scale"))
    xq = (x / per_element_scales(a1, q, H)).clamp(-448, 448).to(FP8_DTYPE)
    p = MoEProblem(7, H, I, 4, 4, 2, torch.float32, FP8_DTYPE, quant=q)  # the problem keeps the float dtype
    scales = {n: kw[n] for n in ("w1_scale", "w2_scale", "a2_scale") if n in kw}
    inputs = ExpertsInputs(xq, w1q, w2q, tw, ids, a1_scale=a1, **scales)
    kernel = MoEKernel(LocalPrepareFinalize(), TorchExperts())
    manager = WorkspaceManager("cpu", poison=True)
    out = torch.full((7, H), float("nan"))
    kernel.run(inputs, p, manager.acquire(kernel.plan(p)), out)
    want = fused_moe(x, w1q, w2q, tw, ids, backend="torch", **kw)
    assert relative_error(out, want) < 1e-6


@interpreter
@pytest.mark.parametrize("mode", MODES, ids=_id)
def test_torch_fp8_agrees_with_the_triton_kernels(mode):
    """The same fp8 call on the Triton kernels (interpreter) and the torch emulation: within the fp8 tolerance."""
    from fusedmoe.ops.configs import MoEConfig, pinned_config

    if not isinstance(mode, str) and mode.block_shape == (96, 64):
        pytest.skip("the Triton kernels take power-of-two fp8 blocks")
    args, kw = _call(mode, M=5, E=4, k=2)
    with pinned_config(MoEConfig.simple(16, 32, 32)):
        triton_out = fused_moe(*args, backend="triton", **kw)
    torch_out = fused_moe(*args, backend="torch", **kw)
    assert relative_error(torch_out, triton_out) < EMULATION_TOL  # measured: ~2e-7
