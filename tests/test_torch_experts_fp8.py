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

MODES = ["fp8_tensor", "fp8_tensor_static", "fp8_token", "fp8_block"]
#: float32 activations: the emulation rounds exactly where the reference does, so only float32 against float64
#: GEMM rounding separates them (and a rare e4m3 tie decided differently); a missing rounding step costs ~5%.
EMULATION_TOL = 1e-2

# H = 160 and I = 96 leave partial 128-wide fp8 blocks along both dimensions of both weights.
H, I = 160, 96
CASES = {
    "plain": dict(M=7, E=4, k=2),
    "M1": dict(M=1, E=4, k=2),
    "topk_equals_E": dict(M=5, E=4, k=4),
    "all_on_one": dict(M=6, E=4, k=1, ids=torch.full((6, 1), 2)),
    "idle_experts": dict(M=9, E=8, k=2, ids=torch.tensor([[0, 1], [1, 0]] * 4 + [[0, 1]])),
    "expert_map": dict(M=8, E=4, k=3, global_E=8),
    "on_input": dict(M=6, E=4, k=1, on_input=True),
    "bias": dict(M=5, E=4, k=2, bias=True),
    "empty": dict(M=0, E=4, k=2),
}


def _call(mode, M, E, k, *, ids=None, global_E=None, on_input=False, bias=False, dtype=torch.float32, seed=0):
    """(args, keywords) of one fused_moe call with ``mode``'s fp8 weights on the CPU."""
    g = torch.Generator().manual_seed(seed)
    gE = global_E or E
    x = torch.randn(M, H, generator=g).to(dtype)
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


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_torch_fp8_matches_the_reference_roundings(mode, case):
    args, kw = _call(mode, **CASES[case])
    out = fused_moe(*args, backend="torch", workspace=WorkspaceManager("cpu", poison=True), **kw)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    if args[0].shape[0] == 0:
        return
    ref = fused_moe_reference(*args, **kw)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < EMULATION_TOL


@pytest.mark.parametrize("mode", MODES)
def test_torch_fp8_bf16_activations(mode):
    """bf16 inputs: GEMM2's input is rounded to bf16 before e4m3, as the kernels store it; within the fp8
    tolerance of the reference (which skips the bf16 step)."""
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


def test_torch_experts_refuse_prequantized_hidden_states():
    q = QuantConfig.parse("fp8_token")
    p = MoEProblem(4, H, I, 4, 4, 2, FP8_DTYPE, FP8_DTYPE, "silu", False, False, q)
    assert "float hidden_states" in TorchExperts().supports(p)


@interpreter
@pytest.mark.parametrize("mode", MODES)
def test_torch_fp8_agrees_with_the_triton_kernels(mode):
    """The same fp8 call on the Triton kernels (interpreter) and the torch emulation: within the fp8 tolerance."""
    from fusedmoe.ops.configs import MoEConfig, pinned_config

    args, kw = _call(mode, M=5, E=4, k=2)
    with pinned_config(MoEConfig.simple(16, 32, 32)):
        triton_out = fused_moe(*args, backend="triton", **kw)
    torch_out = fused_moe(*args, backend="torch", **kw)
    assert relative_error(torch_out, triton_out) < tolerance(torch.float32, quantized=True)
