"""Quantized checkpoints into FusedMoE, offline: tiny gpt-oss MXFP4 and Qwen3-MoE fp8-block checkpoints in their
own tensor names (safetensors + config.json), against float layers and references on the dequantized weights."""

from __future__ import annotations

import pytest
import torch
from devices import INTERPRETING
from hf_tiny import tiny_config

from fusedmoe.integrations.loading import checkpoint_quant, convert_hf_state_dict, from_hf_state_dict
from fusedmoe.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from fusedmoe.quant import FP8_DTYPE, quantize_weights
from fusedmoe.reference import fused_moe_reference

transformers = pytest.importorskip("transformers")
PREFIX = "model.layers.0.mlp."


def _gpt_oss_checkpoint():
    """A gpt-oss MoE block as its MXFP4 checkpoint stores it, and the same block dequantized (float names)."""
    cfg = tiny_config("gpt_oss")
    E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(E, H, 2 * I, generator=g) / H**0.5  # gpt-oss: x @ gate_up, gate/up interleaved columns
    down = torch.randn(E, I, H, generator=g) / I**0.5
    p1, s1 = quantize_mxfp4(gate_up.transpose(1, 2))  # stored out-major: [E, 2I, H]
    p2, s2 = quantize_mxfp4(down.transpose(1, 2))
    common = {
        "experts.gate_up_proj_bias": torch.randn(E, 2 * I, generator=g),
        "experts.down_proj_bias": torch.randn(E, H, generator=g),
        "router.weight": torch.randn(E, H, generator=g),
        "router.bias": torch.randn(E, generator=g),
    }
    quantized = {
        "experts.gate_up_proj_blocks": p1.unflatten(-1, (H // 32, 16)),
        "experts.gate_up_proj_scales": s1,
        "experts.down_proj_blocks": p2.unflatten(-1, (I // 32, 16)),
        "experts.down_proj_scales": s2,
        **common,
    }
    floats = {
        "experts.gate_up_proj": dequantize_mxfp4(p1, s1).transpose(1, 2).contiguous(),
        "experts.down_proj": dequantize_mxfp4(p2, s2).transpose(1, 2).contiguous(),
        **common,
    }
    add = lambda sd: {PREFIX + k: v for k, v in sd.items()}  # noqa: E731
    return cfg, add(quantized), add(floats)


def test_mxfp4_bytes_decode_as_transformers_decodes_them():
    """Our reading of gpt-oss's blocks and scales equals transformers' own MXFP4 dequantization."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg, q, f = _gpt_oss_checkpoint()
    theirs = convert_moe_packed_tensors(
        q[PREFIX + "experts.gate_up_proj_blocks"], q[PREFIX + "experts.gate_up_proj_scales"], dtype=torch.float32
    )
    assert torch.equal(theirs, f[PREFIX + "experts.gate_up_proj"])


def test_gpt_oss_mxfp4_checkpoint_from_safetensors(tmp_path):
    from safetensors.torch import save_file

    cfg, q, f = _gpt_oss_checkpoint()
    cfg.save_pretrained(tmp_path)
    save_file(q, tmp_path / "model.safetensors")
    layer = from_hf_state_dict(tmp_path, cfg, prefix=PREFIX, backend="torch")
    assert layer.quant.mode == "mxfp4" and layer.w1.dtype == torch.uint8 and layer.gate.dtype == torch.float32
    assert layer.w1.numel() == q[PREFIX + "experts.gate_up_proj_blocks"].numel()  # re-laid: no second copy
    ref = from_hf_state_dict(f, cfg, prefix=PREFIX, backend="torch")
    x = torch.randn(11, cfg.hidden_size)
    with torch.no_grad():
        got, want = layer(x), ref(x)
    assert torch.isfinite(got).all() and (got - want).norm() / want.norm() < 1e-5


def _qwen3_fp8_checkpoint(block=(128, 128)):
    cfg = tiny_config(
        "qwen3_moe",
        hidden_size=128,
        moe_intermediate_size=128,
        num_experts=4,
        quantization_config={"quant_method": "fp8", "weight_block_size": list(block)},
    )
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    g = torch.Generator().manual_seed(1)
    w1q, w2q, s1, s2 = quantize_weights(
        torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g), "fp8_block"
    )
    sd = {PREFIX + "gate.weight": torch.randn(E, H, generator=g) / H**0.5}
    nb = I // block[0]
    for e in range(E):
        p = f"{PREFIX}experts.{e}."
        sd.update(
            {
                p + "gate_proj.weight": w1q[e, :I],
                p + "gate_proj.weight_scale_inv": s1[e, :nb],
                p + "up_proj.weight": w1q[e, I:],
                p + "up_proj.weight_scale_inv": s1[e, nb:],
                p + "down_proj.weight": w2q[e],
                p + "down_proj.weight_scale_inv": s2[e],
            }
        )
    return cfg, sd, (w1q, w2q, s1, s2)


def test_qwen3_fp8_block_checkpoint():
    cfg, sd, (w1q, w2q, s1, s2) = _qwen3_fp8_checkpoint()
    converted = convert_hf_state_dict(sd, cfg, PREFIX)
    assert checkpoint_quant(converted, cfg).block_shape == (128, 128)
    layer = from_hf_state_dict(sd, cfg, prefix=PREFIX, dtype=torch.float32, backend="triton")
    assert layer.w1.dtype == FP8_DTYPE and torch.equal(layer.w1.view(torch.uint8), w1q.view(torch.uint8))
    assert torch.equal(layer.w1_scale, s1) and torch.equal(layer.w2_scale, s2)
    if not INTERPRETING:
        pytest.skip("fp8 experts run in the Triton kernels: the CPU needs TRITON_INTERPRET=1")
    x = torch.randn(7, cfg.hidden_size)
    with torch.no_grad():
        out = layer(x)
        tw, ids = layer.route(x)
    ref = fused_moe_reference(x, w1q, w2q, tw, ids, quant=layer.quant, w1_scale=s1, w2_scale=s2)
    assert torch.isfinite(out).all() and (out.double() - ref).norm() / ref.norm() < 2e-2


def test_fp8_checkpoint_needs_its_block_size():
    cfg, sd, _ = _qwen3_fp8_checkpoint()
    cfg.quantization_config = None
    with pytest.raises(NotImplementedError, match="weight_block_size"):
        from_hf_state_dict(sd, cfg, prefix=PREFIX)


def _fp8_experts_module(implementation: str):
    """transformers' own FP8Experts (what FineGrainedFP8 puts in a Qwen3-MoE-FP8 model), holding block-quantized
    weights, dispatching through ``implementation``."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers.integrations.moe import use_experts_implementation

    from fusedmoe.integrations.hf import register

    register()
    cfg, _, (w1q, w2q, s1, s2) = _qwen3_fp8_checkpoint()
    cfg._experts_implementation = implementation
    cls = use_experts_implementation(
        experts_class=fp8.FP8Experts, experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS, has_bias=False, has_gate=True
    )
    m = cls(config=cfg, block_size=(128, 128))
    with torch.no_grad():
        for name, t in (
            ("gate_up_proj", w1q),
            ("down_proj", w2q),
            ("gate_up_proj_scale_inv", s1),
            ("down_proj_scale_inv", s2),
        ):
            getattr(m, name).copy_(t)
    return m, cfg, (w1q, w2q, s1, s2)


def test_transformers_fp8_experts_run_through_fusedmoe():
    """experts_implementation="fusedmoe" on transformers' FP8Experts: fused_moe(quant="fp8_block") on its own
    e4m3 weights and *_scale_inv, against the reference on them; a call needing a gradient falls back, warned."""
    from unittest import mock

    import fusedmoe.integrations.hf as hf

    m, cfg, (w1q, w2q, s1, s2) = _fp8_experts_module("fusedmoe")
    x = torch.randn(6, cfg.hidden_size)
    tw = torch.rand(6, 2)
    ids = torch.stack([torch.randperm(cfg.num_experts)[:2] for _ in range(6)])
    calls = []
    real = hf.fused_moe

    def spy(*args, **kwargs):
        calls.append(kwargs["quant"])
        return real(*args, **{**kwargs, "backend": "triton" if INTERPRETING else "auto"})

    with mock.patch.object(hf, "fused_moe", spy):
        if not INTERPRETING:
            pytest.skip("fp8 experts run in the Triton kernels: the CPU needs TRITON_INTERPRET=1")
        with torch.no_grad():
            out = m(x, ids, tw)
    assert calls and calls[0].mode == "fp8_block" and calls[0].block_shape == (128, 128)
    ref = fused_moe_reference(x, w1q, w2q, tw, ids, quant=calls[0], w1_scale=s1, w2_scale=s2)
    assert (out.double() - ref).norm() / ref.norm() < 2e-2
    assert hf.fp8_experts_unsupported(m) is None
    m.activation_scheme = "static"
    assert "static fp8 activation scales" in hf.fp8_experts_unsupported(m)


def test_fp8_experts_verdict_is_cached_and_follows_the_module():
    """The FP8Experts verdict is computed once per module and remade when what decides it changes: a setting, the
    hidden dtype, the weights' shape; an unhashable setting is checked on every call."""
    import fusedmoe.integrations.hf as hf

    m, _, _ = _fp8_experts_module("fusedmoe")
    first = hf._fp8_verdict(m, torch.bfloat16, hf._fp8_tensors(m))
    activation, quant, reason = first
    assert reason is None and activation == "silu" and quant.mode == "fp8_block" and quant.block_shape == (128, 128)
    assert hf._fp8_verdict(m, torch.bfloat16, hf._fp8_tensors(m)) is first  # cached
    assert "float64" in hf._fp8_verdict(m, torch.float64, hf._fp8_tensors(m))[2]
    m.activation_scheme = "static"
    assert "static fp8 activation scales" in hf._fp8_verdict(m, torch.bfloat16, hf._fp8_tensors(m))[2]
    m.activation_scheme = "dynamic"
    assert hf._fp8_verdict(m, torch.bfloat16, hf._fp8_tensors(m))[2] is None
    w = m.gate_up_proj
    m.gate_up_proj = torch.nn.Parameter(w[:, : w.shape[1] // 2].contiguous(), requires_grad=False)
    assert "is not one scale per 128x128 block" in hf._fp8_verdict(m, torch.bfloat16, hf._fp8_tensors(m))[2]
    m.gate_up_proj = w
    m.block_size = [128, 128]  # a list: no cache key, the checks run each time
    assert hf._fp8_verdict(m, torch.bfloat16, hf._fp8_tensors(m))[2] is None


def test_fp8_experts_with_clamped_swiglu_read_the_modules_limit():
    """FP8Experts keeps its clamp in ``limit``: gpt-oss's constants are computed (swigluoai), others refused."""
    import fusedmoe.integrations.hf as hf

    m, _, _ = _fp8_experts_module("fusedmoe")
    m.swiglu_alpha, m.limit = 1.702, 7.0
    assert hf.fp8_experts_unsupported(m) is None
    assert hf._fp8_verdict(m, torch.bfloat16, hf._fp8_tensors(m))[0] == "swigluoai"
    m.limit = 5.0
    assert "limit=5.0" in hf.fp8_experts_unsupported(m)
    m.swiglu_alpha = None
    assert "clamped at swiglu_limit=5.0" in hf.fp8_experts_unsupported(m)


def test_fp8_fallback_reaches_transformers_own_forward_under_every_dispatcher():
    """FineGrainedFP8 decorates FP8Experts once per MoE layer, each dispatcher wrapping the previous one: the fallback
    must reach the class's own forward, not a dispatcher that calls fusedmoe again (an endless recursion)."""
    import inspect

    import fusedmoe.integrations.hf as hf

    m, _, _ = _fp8_experts_module("fusedmoe")
    _fp8_experts_module("fusedmoe")  # decorated once more, as by a second MoE layer
    depth, fn = 0, type(m).forward
    while hasattr(fn, "__wrapped__"):
        depth, fn = depth + 1, fn.__wrapped__
    assert depth >= 2
    own = hf._eager_experts_forward(m)
    assert own is inspect.unwrap(type(m).forward) and not hf._is_experts_dispatcher(own)


def test_fp8_experts_clamped_without_swiglu_alpha_are_refused():
    """FP8Experts clamps gate and up at ``swiglu_limit`` before the activation when the config has no swiglu_alpha
    (GLM-5-Next, HY-V4, DeepSeek-V4): fusedmoe has no such gate, so it must not compute plain SiLU."""
    import fusedmoe.integrations.hf as hf

    m, _, _ = _fp8_experts_module("fusedmoe")
    assert hf.fp8_experts_unsupported(m) is None
    m.limit = 7.0
    assert "swiglu_limit" in hf.fp8_experts_unsupported(m)


def test_fp8_experts_are_checked_as_fp8_at_selection():
    """Selecting "fusedmoe" on a model holding transformers' FP8Experts checks them as fp8 experts (what their
    forward serves), so a loaded fp8 model can switch back to fusedmoe after "eager"."""
    import fusedmoe.integrations.hf as hf

    m, _, _ = _fp8_experts_module("eager")
    model = torch.nn.Module()
    model.experts = m
    hf.check_experts_implementation(model)  # no refusal: fp8 weights are what these modules hold
    m.limit = 7.0
    with pytest.raises(NotImplementedError, match="swiglu_limit"):
        hf.check_experts_implementation(model)


def test_quantize_experts_refuses_a_model_without_experts_modules():
    from hf_tiny import tiny_dense_model

    from fusedmoe.integrations.hf_quant import quantize_experts

    with pytest.raises(NotImplementedError, match="no transformers experts module"):
        quantize_experts(tiny_dense_model(), "mxfp4")
