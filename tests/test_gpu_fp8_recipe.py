"""fp8 128x128 blocks at DeepSeek-V3's K = 7168, checked the way vLLM's block-fp8 MoE test checks its own kernel:
its inputs (bf16 activations randn / 10, bf16 weights randn / 15 quantized per 128 x 128 block, softmax top-k
routing without renormalization), its reference's rounding points (each block GEMM's output rounded to bf16, the
SiLU-and-mul in bf16, GEMM2's input quantized per token and 128 columns, the weighted top-k sum in bf16) and its
element-wise tolerance (atol = rtol = 0.035). The reference below is written from that description.

No fp8 tensor-core kernel meets that tolerance at every element here: an fp8 group's scale follows its largest
element, so a last-bit difference in GEMM1's output moves all 128 elements of a group against the e4m3 grid. On the
H200, vLLM 0.34.0's own kernel leaves 2 and 4 of these cases' elements outside it, fusedmoe 5 and 3
(``scripts/fp8_recipe_diag.py``, BENCHMARKS.md). What is asserted: almost every element within the tolerance, and
an error against float64 math on the same fp8 weights below the reference's own (fusedmoe quantizes GEMM2's input
from the float32 activation; the reference and vLLM's kernel round it to bf16 twice first)."""

import pytest
import torch

from fusedmoe import fused_moe
from fusedmoe.quant import FP8_DTYPE, FP8_MAX, QuantConfig, quantize_weights
from fusedmoe.reference import fused_moe_reference, relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.big_gpu]

BLOCK = 128
TOLERANCE = 0.035
#: fraction of elements allowed outside it (measured: at most 4.4e-5 for fusedmoe, 3.5e-5 for vLLM's kernel)
MAX_OUTSIDE = 1e-4


def _group_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 of ``x`` [R, K] per row and 128 columns (amax / 448 scales), and the scales [R, K / 128]."""
    g = x.float().view(x.shape[0], -1, BLOCK)
    s = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    return (g / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(x.shape), s.squeeze(-1)


def _block_gemm(aq, a_s, w, w_s) -> torch.Tensor:
    """bf16 of (fp8 ``aq`` x its group scales) @ (fp8 ``w`` [N, K] x its block scales).T, in float32."""
    a = aq.float() * a_s.repeat_interleave(BLOCK, dim=1)
    ws = w_s.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[: w.shape[0], : w.shape[1]]
    return (a @ (w.float() * ws).T).to(torch.bfloat16)


def _reference(x, w1, w2, s1, s2, topk_weights, topk_ids) -> torch.Tensor:
    M, k = topk_ids.shape
    aq, a_s = _group_quant(x.repeat_interleave(k, dim=0))
    out = torch.zeros(M * k, w2.shape[1], dtype=torch.bfloat16, device=x.device)
    flat = topk_ids.reshape(-1)
    for e in range(w1.shape[0]):
        rows = flat == e
        if rows.any():
            h = _block_gemm(aq[rows], a_s[rows], w1[e], s1[e])
            half = h.shape[1] // 2
            act = torch.nn.functional.silu(h[:, :half]) * h[:, half:]  # bf16 ops
            out[rows] = _block_gemm(*_group_quant(act), w2[e], s2[e])
    return (out.view(M, k, -1) * topk_weights.view(M, k, 1).to(torch.bfloat16)).sum(dim=1)


#: (M, I, E, top_k) at H = 7168
CASES = [
    (16, 4608, 6, 2),  # DeepSeek-V3's H with its TP-8 intermediate slice
    (83, 4608, 8, 2),
    (192, 1024, 8, 6),  # a DeepGEMM-test shape
    (1, 4608, 2, 1),
]


def recipe_inputs(M: int, I: int, E: int, top_k: int, H: int = 7168, seed: int = 0):
    """(x, w1, w2, w1_scale, w2_scale, quant, topk_weights, topk_ids) of the recipe on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(M, H, device="cuda", generator=g) / 10).to(torch.bfloat16)
    w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / 15).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / 15).to(torch.bfloat16)
    q = QuantConfig("fp8_block")
    w1, w2, s1, s2 = quantize_weights(w1, w2, q)
    score = torch.randn(M, E, device="cuda", generator=g).to(torch.bfloat16)
    topk_weights, topk_ids = torch.topk(torch.softmax(score.float(), dim=-1), top_k)
    return x, w1, w2, s1, s2, q, topk_weights, topk_ids.to(torch.int32)


@pytest.mark.parametrize("M,I,E,top_k", CASES)
def test_fp8_block_within_vllm_tolerance_at_k7168(M, I, E, top_k):
    x, w1, w2, s1, s2, q, topk_weights, topk_ids = recipe_inputs(M, I, E, top_k)
    out = fused_moe(x, w1, w2, topk_weights, topk_ids, quant=q, w1_scale=s1, w2_scale=s2, backend="triton")
    ref = _reference(x, w1, w2, s1, s2, topk_weights, topk_ids)
    outside = (out.double() - ref.double()).abs() > TOLERANCE * (1 + ref.double().abs())
    assert int(outside.sum()) <= MAX_OUTSIDE * out.numel()
    exact = fused_moe_reference(x, w1, w2, topk_weights, topk_ids, quant=q, w1_scale=s1, w2_scale=s2)
    assert relative_error(out, exact) < relative_error(ref, exact)
