"""The "gelu_exact" activation (GeGLU with the exact, erf GELU: transformers' ``hidden_act="gelu"``) in every
experts backend: the float64 reference, the torch experts, the Triton kernels (CPU interpreter; bf16 on the GPU),
standard and batched layouts."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from fusedmoe import FusedMoE, fused_moe, route
from fusedmoe.reference import activation_reference, fused_moe_reference, relative_error

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="Triton needs a GPU or the CPU interpreter"
)


def _case(M=37, H=64, I=32, E=8, k=2, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g) * 2  # wide enough that erf and tanh GELU differ visibly
    w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5 * 2
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    tw, ti = route(torch.randn(M, E, generator=g), k)
    x, w1, w2 = (t.to(device=device, dtype=dtype) for t in (x, w1, w2))
    return x, w1, w2, tw.to(device), ti.to(device)


def test_reference_is_exact_gelu_and_differs_from_tanh():
    gate_up = torch.randn(50, 16, dtype=torch.float64) * 3
    gate, up = gate_up[:, :8], gate_up[:, 8:]
    assert torch.allclose(activation_reference(gate_up, "gelu_exact"), F.gelu(gate) * up, rtol=1e-12, atol=1e-12)
    tanh = activation_reference(gate_up, "gelu")
    assert (tanh - F.gelu(gate) * up).abs().max() > 1e-5  # the two GELUs are different functions


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_fused_moe_gelu_exact(backend):
    if backend == "triton" and not INTERPRET:
        pytest.skip("CPU tensors need the interpreter")
    x, w1, w2, tw, ti = _case()
    out = fused_moe(x, w1, w2, tw, ti, activation="gelu_exact", backend=backend)
    ref = fused_moe_reference(x, w1, w2, tw, ti, activation="gelu_exact")
    assert relative_error(out, ref) < 5e-6
    tanh_ref = fused_moe_reference(x, w1, w2, tw, ti, activation="gelu")
    assert relative_error(tanh_ref, ref) > 2e-5  # the tanh GELU would fail the bound above


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_batched_layout_gelu_exact(backend):
    if backend == "triton" and not INTERPRET:
        pytest.skip("CPU tensors need the interpreter")
    layer = FusedMoE(8, 2, 64, 32, activation="gelu_exact", layout="batched", backend=backend)
    x = torch.randn(21, 64) * 2
    with torch.no_grad():
        tw, ti = layer.route(x)
        out = layer(x)
    ref = fused_moe_reference(x, layer.w1, layer.w2, tw, ti, activation="gelu_exact")
    assert relative_error(out, ref) < 5e-6


@pytest.mark.gpu
def test_gpu_bf16_gelu_exact():
    x, w1, w2, tw, ti = _case(M=300, H=256, I=128, E=16, k=4, dtype=torch.bfloat16, device="cuda")
    ref = fused_moe_reference(x, w1, w2, tw, ti, activation="gelu_exact")
    out = fused_moe(x, w1, w2, tw, ti, activation="gelu_exact", backend="triton")
    assert relative_error(out, ref) < 1e-2
    out_torch = fused_moe(x, w1, w2, tw, ti, activation="gelu_exact", backend="torch")
    assert relative_error(out_torch, ref) < 1e-2
