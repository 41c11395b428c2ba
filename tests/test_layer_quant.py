"""FusedMoE with quantized experts (fp8 w8a8 modes, MXFP4): parameters in the checkpoints' layouts, forward against
the reference on the dequantized weights, loading, and the errors (CPU: torch backend and the interpreter)."""

from __future__ import annotations

import pytest
import torch
from devices import INTERPRETING

from fusedmoe import FusedMoE
from fusedmoe.checks import GradientNotSupportedError
from fusedmoe.mxfp4_layout import to_mma_layout
from fusedmoe.quant import FP8_DTYPE, quantize_weights
from fusedmoe.reference import fused_moe_reference

E, K, H, I = 4, 2, 64, 32


def _layer(quant, **kw):
    torch.manual_seed(0)
    return FusedMoE(E, K, H, I, dtype=torch.float32, quant=quant, **kw)


@pytest.mark.parametrize(
    "quant,w1,s1",
    [
        # MXFP4 re-laid for the tensor cores (fusedmoe.mxfp4_layout): row blocks of 16, 8 bytes per column of H
        ("mxfp4", ((E, 2 * I // 16, 8 * H), torch.uint8), ((E, 2 * I // 16, H // 2), torch.uint8)),
        ("fp8_tensor", ((E, 2 * I, H), FP8_DTYPE), ((E,), torch.float32)),
        ("fp8_token", ((E, 2 * I, H), FP8_DTYPE), ((E, 2 * I), torch.float32)),
        ("fp8_block", ((E, 2 * I, H), FP8_DTYPE), ((E, 1, 1), torch.float32)),
    ],
)
def test_parameters_in_the_quantized_layouts(quant, w1, s1):
    layer = _layer(quant)
    assert (tuple(layer.w1.shape), layer.w1.dtype) == w1 and (tuple(layer.w1_scale.shape), layer.w1_scale.dtype) == s1
    assert not any(p.requires_grad for p in layer.parameters())
    assert layer.compute_dtype == torch.float32 and f"quant={quant}" in repr(layer)
    names = set(layer.state_dict())
    assert {"w1", "w2", "w1_scale", "w2_scale", "gate"} <= names
    plain = _layer(None)
    assert plain.w1_scale is None and "w1_scale" not in plain.state_dict()


@pytest.mark.parametrize(
    "quant,backend", [("mxfp4", "torch"), ("mxfp4", "triton"), ("fp8_token", "triton"), ("fp8_block", "triton")]
)
def test_forward_matches_the_reference_on_dequantized_weights(quant, backend):
    if backend == "triton" and not INTERPRETING:
        pytest.skip("the Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    layer = _layer(quant, backend=backend)
    x = torch.randn(9, H)
    with torch.no_grad():
        out = layer(x)
        tw, ids = layer.route(x)
    ref = fused_moe_reference(
        x, layer.w1, layer.w2, tw, ids, quant=layer.quant, w1_scale=layer.w1_scale, w2_scale=layer.w2_scale
    )
    tol = 1e-5 if quant == "mxfp4" else 5e-2  # fp8 rounds the activations too (the reference models it)
    assert torch.isfinite(out).all() and (out.double() - ref).norm() / ref.norm() < tol
    again = layer(x)  # the cached verdict path gives the same result
    assert torch.equal(again, out)
    assert layer.reserve_workspace(64) > 0


def test_load_weights_and_state_dict_round_trip():
    src = _layer("mxfp4")
    w1, w2, s1, s2 = quantize_weights(torch.randn(E, 2 * I, H), torch.randn(E, H, I), "mxfp4")
    src.load_weights(w1, w2, w1_scale=s1, w2_scale=s2)  # the checkpoint's layout, re-laid once
    assert src.quant.name == "mxfp4_mma"
    v1, t1 = to_mma_layout(w1, s1, gated=True)
    v2, t2 = to_mma_layout(w2, s2, gated=False)
    assert torch.equal(src.w1, v1) and torch.equal(src.w1_scale, t1) and torch.equal(src.w2_scale, t2)
    checkpoint_layout = _layer("mxfp4")  # a state dict in the checkpoint's layout loads into the mma layout too
    checkpoint_layout.load_state_dict({**src.state_dict(), "w1": w1, "w2": w2, "w1_scale": s1, "w2_scale": s2})
    assert torch.equal(checkpoint_layout.w2, v2)
    dst = _layer("mxfp4")
    dst.load_state_dict(src.state_dict())
    x = torch.randn(5, H)
    with torch.no_grad():
        assert torch.equal(dst(x), src(x))
    with pytest.raises(ValueError, match="w1_scale is required for quant='mxfp4'"):
        src.load_weights(w1, w2)
    with pytest.raises(ValueError, match=r"w2_scale must be torch.uint8 of shape \[4, 64, 1\]"):
        src.load_weights(w1, w2, w1_scale=s1, w2_scale=s2[..., :0])
    with pytest.raises(ValueError, match="not quantized"):
        _layer(None).load_weights(torch.randn(E, 2 * I, H), torch.randn(E, H, I), w1_scale=s1)


def test_weights_the_mma_layout_cannot_hold_keep_the_checkpoint_layout():
    """A scale above 2^1 (byte 129) does not fit the mma layout: the layer keeps the checkpoint layout, and computes
    the same function as the reference on it."""
    layer = _layer("mxfp4", backend="torch")
    w1, w2, s1, s2 = quantize_weights(torch.randn(E, 2 * I, H), torch.randn(E, H, I) * 40, "mxfp4")
    assert int(s2.max()) > 128
    layer.load_weights(w1, w2, w1_scale=s1, w2_scale=s2)
    assert layer.quant.name == "mxfp4" and torch.equal(layer.w1, w1) and torch.equal(layer.w2_scale, s2)
    x = torch.randn(5, H)
    with torch.no_grad():
        out = layer(x)
        tw, ids = layer.route(x)
    ref = fused_moe_reference(x, w1, w2, tw, ids, quant="mxfp4", w1_scale=s1, w2_scale=s2)
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


@pytest.mark.parametrize("quant", ["mxfp4", "fp8_token", "fp8_block"])
def test_batched_layout_matches_the_standard_one(quant):
    """A quantized layer in the batched layout (the Triton batched kernels; under the interpreter on the CPU)
    gives the standard layout's output; the torch batched experts refuse quantized weights by name."""
    if not INTERPRETING:
        pytest.skip("the Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    std = _layer(quant, backend="triton")
    batched = _layer(quant, backend="triton", layout="batched", max_tokens_per_expert=16)
    batched.load_state_dict(std.state_dict())
    x = torch.randn(9, H)
    with torch.no_grad():
        want, got = std(x), batched(x)
    assert torch.isfinite(got).all() and (got - want).norm() / want.norm() < 1e-5
    with pytest.raises(ValueError, match=f"do not implement quantized weights \\({quant}\\)"):
        with torch.no_grad():
            _layer(quant, backend="torch", layout="batched", max_tokens_per_expert=16)(x)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="divisible by 32"):
        FusedMoE(E, K, 48, I, quant="mxfp4")
    with pytest.raises(ValueError, match="quant mode must be one of"):
        _layer("int4")
    layer = _layer("mxfp4")
    with pytest.raises(TypeError, match=r"router and activations \(quantized experts\) \(torch.float32\)"):
        layer(torch.randn(3, H, dtype=torch.float64))
    layer.gate.requires_grad_(True)  # training the router of quantized experts: the experts have no backward
    with pytest.raises(GradientNotSupportedError, match="quantized calls"):
        layer(torch.randn(3, H))
