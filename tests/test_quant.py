"""fp8 helpers in quant.py and the activation-quantization kernels (CPU interpreter); MXFP4: tests/test_mxfp4.py."""

import pytest
import torch

from fusedmoe.ops.quantize import num_partials, quantize_activation, scale_shape
from fusedmoe.quant import (
    FP8_DTYPE,
    FP8_MODES,
    QuantConfig,
    activation_scales,
    dequantize_weight,
    fake_quantize_activation,
    quantize_weights,
)


@pytest.mark.parametrize("mode", FP8_MODES)
def test_quantize_weights_shapes_and_roundtrip(mode):
    E, I, H = 3, 72, 200
    w1, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    w1q, w2q, s1, s2 = quantize_weights(w1, w2, mode)
    assert w1q.dtype == w2q.dtype == FP8_DTYPE and s1.dtype == s2.dtype == torch.float32
    want = {
        "fp8_tensor": ((E,), (E,)),
        "fp8_token": ((E, 2 * I), (E, H)),
        "fp8_block": ((E, 2, 2), (E, 2, 1)),
    }[mode]
    assert (tuple(s1.shape), tuple(s2.shape)) == want
    for w, wq, s in ((w1, w1q, s1), (w2, w2q, s2)):
        d = dequantize_weight(wq, s, mode)
        assert d.shape == w.shape and d.dtype == torch.float32
        assert ((d - w).norm() / w.norm()) < 0.04
        assert (wq.float().abs() <= 448).all()


@pytest.mark.parametrize("mode", FP8_MODES)
def test_quantize_weights_by_expert_chunks_matches_all_at_once(mode, monkeypatch):
    import fusedmoe.quant as quant

    E, I, H = 5, 40, 136
    w1, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    whole = quantize_weights(w1, w2, mode)
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 2 * H * I)  # two experts at a time, the last one alone
    chunked = quantize_weights(w1, w2, mode)
    for a, b in zip(whole, chunked):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(
            a.view(torch.uint8) if a.dtype == FP8_DTYPE else a, b.view(torch.uint8) if b.dtype == FP8_DTYPE else b
        )
    empty = quantize_weights(w1[:0], w2[:0], mode)
    assert [t.shape[0] for t in empty] == [0, 0, 0, 0]


@pytest.mark.parametrize("mode", FP8_MODES)
def test_fake_quantize_activation(mode):
    x = torch.randn(6, 300, dtype=torch.float64) * 5
    y = fake_quantize_activation(x, mode)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert ((y - x).norm() / x.norm()) < 0.05
    s = activation_scales(x, mode)
    assert tuple(s.shape) == scale_shape(mode, 6, 300)
    # idempotent: already-quantized values stay put
    assert torch.allclose(fake_quantize_activation(y, mode), y)


def test_fake_quantize_static_scale():
    x = torch.randn(4, 32)
    quant = QuantConfig("fp8_tensor", static_activation_scale=True)
    y = fake_quantize_activation(x, quant, scale=torch.tensor([0.001]))
    assert y.abs().max() <= 448 * 0.001 + 1e-9


def _torch_quant(x, mode, scale):
    s = scale if mode != "fp8_block" else scale.repeat_interleave(128, 1)[:, : x.shape[1]]
    return (x.float() / s).clamp(-448, 448).to(FP8_DTYPE)


@pytest.mark.parametrize("mode", FP8_MODES)
def test_quantize_kernel_matches_torch_rule(mode):
    # values near powers of two hit the interpreter's cast bug unless the kernel pre-rounds (it does on CPU)
    x = torch.cat([torch.randn(5, 300) * 3, torch.full((1, 300), 1.987), torch.zeros(1, 300)])
    q, s = quantize_activation(x, mode)
    rs = activation_scales(x, mode)
    assert torch.equal(s, rs)
    assert torch.equal(q.float(), _torch_quant(x, mode, rs).float())


@pytest.mark.parametrize("mode", FP8_MODES)
def test_quantize_kernel_gated_rows(mode):
    # rows of non-local slots hold NaN (never written by GEMM1): they must be skipped and stay unwritten
    M, k, E = 5, 2, 4
    ids = torch.tensor([[0, 1], [5, 2], [-1, 3], [1, 9], [2, 2]], dtype=torch.int32)
    x = torch.randn(M * k, 160)
    valid = ((ids >= 0) & (ids < E)).reshape(-1)
    x[~valid] = float("nan")
    out = torch.full((M * k, 160), 0x7F, dtype=torch.uint8).view(FP8_DTYPE)
    q, s = quantize_activation(
        x,
        mode,
        out=out,
        topk_ids=ids,
        num_experts=E,
        global_num_experts=8,
        partial=torch.full((num_partials(M * k),), float("nan")),
    )
    assert torch.isfinite(s[valid] if s.dim() == 2 else s).all()
    rs = activation_scales(x[valid], mode)
    if mode == "fp8_tensor":
        assert torch.equal(s, rs)
    else:
        assert torch.equal(s[valid], rs)
    assert torch.equal(q[valid].float(), _torch_quant(x[valid], mode, rs).float())
    assert (q[~valid].view(torch.uint8) == 0x7F).all()
