"""GPU regressions of the correctness issue: float32 on every preset's shape, the Triton swigluoai path at vLLM's
CPU-kernel tolerance and a pinned BLOCK_M change on one shape. Their CPU twins carry the rest as cuda cases: NaN /
±Inf router logits through the routing kernel (test_routing_nonfinite.py) and fp8 per-tensor dynamic quantization
at M = 1..3 under poison (test_lifetimes.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fusedmoe import fused_moe
from fusedmoe.ops.configs import MoEConfig, pinned_config
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.tools.presets import PRESETS
from fusedmoe.workspace.manager import WorkspaceManager

sys.path.insert(0, str(Path(__file__).parent))
from test_precision import ATOL, RTOL, fp32_reference, vllm_grid_case  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("M", [1, 64, 777])
def test_float32_every_preset(name, M):
    """float32 activations and weights at each preset's H and I (tiles fitted to 4-byte elements; before: Triton
    OutOfResources: shared memory). IEEE dots by default (torch's float32 matmul precision is "highest")."""
    pr = PRESETS[name]
    E = min(pr.experts_on_gpu, 16)
    g = torch.Generator(device=DEV).manual_seed(M)
    H, I, k = pr.hidden_size, pr.intermediate_size, min(pr.top_k, E)
    x = torch.randn(M, H, device=DEV, generator=g)
    w1 = torch.randn(E, 2 * I, H, device=DEV, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, device=DEV, generator=g) / I**0.5
    ids = torch.rand(M, E, device=DEV, generator=g).argsort(dim=1)[:, :k].to(torch.int32)
    tw = torch.rand(M, k, device=DEV, generator=g)
    out = fused_moe(
        x, w1, w2, tw, ids, backend="triton", activation=pr.activation, workspace=WorkspaceManager(DEV, poison=True)
    )
    assert relative_error(out, fused_moe_reference(x, w1, w2, tw, ids, activation=pr.activation)) < 1e-5


@pytest.mark.parametrize(
    "M,H,I", [(1, 128, 128), (64, 128, 128), (256, 128, 128), (64, 2880, 128), (16, 128, 2880), (256, 2880, 2880)]
)
@pytest.mark.parametrize("activation", ["silu", "gelu", "swigluoai"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_triton_within_vllm_tolerance(M, H, I, activation, bias):
    """vLLM's CPU fused-MoE grid against its reference's rounding points (float32 math, activation rounded to
    bf16, one output rounding): the Triton path (GEMM2 rows in float32, one rounding in the top-k sum) matches
    it at atol 1e-3 / rtol 1.6e-2 and is no further from float64."""
    case = [t.to(DEV) if t is not None else None for t in vllm_grid_case(M, H, I, bias)]
    x, w1, w2, b1, b2, w, ids = case
    out = fused_moe(x, w1, w2, w, ids, activation=activation, w1_bias=b1, w2_bias=b2, backend="triton")
    ref32 = fp32_reference(*(t.cpu() if t is not None else None for t in case), activation).to(DEV)
    torch.testing.assert_close(out.float(), ref32.float(), atol=ATOL, rtol=RTOL)
    ref64 = fused_moe_reference(x, w1, w2, w, ids, activation=activation, w1_bias=b1, w2_bias=b2)
    assert (out.double() - ref64).norm() <= 1.1 * (ref32.double() - ref64).norm()


def test_pinned_block_m_change_on_one_shape():
    g = torch.Generator(device=DEV).manual_seed(0)
    M, E, H, I, k = 64, 16, 256, 128, 4
    x = torch.randn(M, H, device=DEV, generator=g, dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * I, H, device=DEV, generator=g, dtype=torch.bfloat16) / H**0.5
    w2 = torch.randn(E, H, I, device=DEV, generator=g, dtype=torch.bfloat16) / I**0.5
    ids = torch.rand(M, E, device=DEV, generator=g).argsort(dim=1)[:, :k].to(torch.int32)
    tw = torch.rand(M, k, device=DEV, generator=g)
    ref = fused_moe_reference(x, w1, w2, tw, ids)
    for bm in (16, 64, 128, 16):
        with pinned_config(MoEConfig.simple(bm, 64, 64)):
            assert relative_error(fused_moe(x, w1, w2, tw, ids, backend="triton"), ref) < 2e-2
