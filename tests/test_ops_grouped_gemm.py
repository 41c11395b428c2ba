"""Grouped GEMM ops vs torch on the rows they own (CPU interpreter, float32 / fp8 inputs)."""

import os

import pytest
import torch

from fusedmoe.ops.align import align_params, local_expert_reference, moe_align
from fusedmoe.ops.configs import GemmConfig
from fusedmoe.ops.expert_gemm import Numerics
from fusedmoe.ops.grouped_gemm import grid_blocks, moe_gemm1, moe_gemm2
from fusedmoe.quant import FP8_DTYPE, QuantConfig, dequantize_weight, quantize_weights
from fusedmoe.reference import activation_reference

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU-interpreter tests; on a GPU tests/test_triton_experts.py runs these kernels at model shapes",
)

CFG = GemmConfig(16, 32, 32)


def _setup(M, k, E, gE=None):
    gE = gE or E
    ids = torch.stack([torch.randperm(gE)[:k] for _ in range(M)]).int()
    s, b, _ = moe_align(ids, E, CFG.block_m, global_num_experts=gE)
    nb = grid_blocks(M * k, align_params(M * k, E, CFG.block_m).max_blocks)
    loc = local_expert_reference(ids.reshape(-1), E, None, gE)
    return ids, s, b, nb, loc


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("on_input", [False, True])
def test_gemm1(activation, on_input):
    M, k, E, H, I = 11, 2, 4, 40, 24
    ids, s, b, nb, loc = _setup(M, k, E, gE=6)  # ids 4, 5 are non-local
    x, w1 = torch.randn(M, H), torch.randn(E, 2 * I, H)
    tw = torch.rand(M, k)
    out = torch.full((M * k, I), float("nan"))
    moe_gemm1(
        x,
        w1,
        out,
        s,
        b,
        top_k=k,
        num_blocks=nb,
        config=CFG,
        activation=activation,
        topk_weights=tw if on_input else None,
    )
    for slot in range(M * k):
        e = int(loc[slot])
        if e < 0:
            assert out[slot].isnan().all()  # never written
            continue
        a = x[slot // k].double() * (float(tw.reshape(-1)[slot]) if on_input else 1.0)
        ref = activation_reference(a @ w1[e].double().T, activation)
        torch.testing.assert_close(out[slot].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mul_weight", [True, False])
def test_gemm2(mul_weight):
    M, k, E, H, I = 9, 3, 5, 40, 24
    ids, s, b, nb, loc = _setup(M, k, E)
    a, w2, tw = torch.randn(M * k, I), torch.randn(E, H, I), torch.rand(M, k)
    out = torch.full((M * k, H), float("nan"))
    moe_gemm2(a, w2, out, s, b, num_blocks=nb, config=CFG, topk_weights=tw if mul_weight else None)
    for slot in range(M * k):
        e = int(loc[slot])
        ref = a[slot].double() @ w2[e].double().T
        if mul_weight:
            ref = ref * float(tw.reshape(-1)[slot])
        torch.testing.assert_close(out[slot].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["fp8_tensor", "fp8_token", "fp8_block"])
def test_gemm2_fp8(mode):
    M, k, E, H, I = 6, 2, 3, 40, 24
    ids, s, b, nb, loc = _setup(M, k, E)
    w1, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    _, w2q, _, w2s = quantize_weights(w1, w2, mode)
    a = (torch.randn(M * k, I) * 4).to(FP8_DTYPE)
    a_s = {
        "fp8_tensor": torch.tensor([0.5]),
        "fp8_token": torch.rand(M * k, 1) + 0.5,
        "fp8_block": torch.rand(M * k, 1) + 0.5,
    }[mode]
    w2s_k = w2s.reshape(E, -1) if mode == "fp8_token" else w2s
    out = torch.empty(M * k, H)
    moe_gemm2(a, w2q, out, s, b, num_blocks=nb, config=CFG, numerics=Numerics(mode, a_s, w2s_k))
    wd = dequantize_weight(w2q, w2s, QuantConfig(mode)).double()
    ad = a.double() * a_s.double()
    for slot in range(M * k):
        torch.testing.assert_close(out[slot].double(), ad[slot] @ wd[int(loc[slot])].T, rtol=1e-5, atol=1e-5)
