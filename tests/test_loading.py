"""Weights from transformers blocks, state dicts (fused and per-expert layouts) and safetensors files."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import ARCHS, tiny_model  # noqa: E402

from fusedmoe import FusedMoE  # noqa: E402
from fusedmoe.integrations import hf  # noqa: E402
from fusedmoe.integrations.loading import (  # noqa: E402
    convert_hf_state_dict,
    fused_to_gpt_oss,
    gpt_oss_to_fused,
    layer_kwargs,
    load_safetensors,
    per_expert_to_fused,
)
from fusedmoe.reference import relative_error  # noqa: E402


def _block(model):
    return next(m for m in model.modules() if type(m).__name__ in hf.PATCHABLE_BLOCKS)


def _block_name(model):
    return next(n for n, m in model.named_modules() if type(m).__name__ in hf.PATCHABLE_BLOCKS)


def _compare(layer, block, seed=0):
    x = torch.randn(2, 20, layer.hidden_size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = block(x)
        ref = ref[0] if isinstance(ref, tuple) else ref
        logits = None
        if type(block).__name__.startswith("Deepseek"):  # routers in float32 (same here: fp32 model)
            logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).float(), block.gate.weight.float())
        out = layer(x, logits) if logits is not None else layer(x)
    assert relative_error(out, ref) < 1e-5


def _per_expert(sd: dict, prefix: str) -> dict:
    """Rewrite a transformers-5 fused block state dict into the older per-expert layout."""
    out = {}
    for k, v in sd.items():
        if k == prefix + "experts.gate_up_proj":
            I = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}experts.{e}.gate_proj.weight"] = v[e, :I].clone()
                out[f"{prefix}experts.{e}.up_proj.weight"] = v[e, I:].clone()
        elif k == prefix + "experts.down_proj":
            for e in range(v.shape[0]):
                out[f"{prefix}experts.{e}.down_proj.weight"] = v[e].clone()
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_from_hf_experts_block(arch):
    model = tiny_model(arch)
    block = _block(model)
    layer = FusedMoE.from_hf_experts(block)
    assert isinstance(layer, FusedMoE)
    if arch != "gpt_oss":
        assert layer.w1.data_ptr() == block.experts.gate_up_proj.data_ptr()  # shared, no copy
    _compare(layer, block)
    copied = FusedMoE.from_hf_experts(block, share_weights=False)
    assert copied.w1.data_ptr() != block.experts.gate_up_proj.data_ptr()


@pytest.mark.parametrize("arch", ARCHS)
def test_from_state_dict_fused_and_per_expert(arch):
    model = tiny_model(arch)
    prefix = _block_name(model) + "."
    full = model.state_dict()
    block = _block(model)
    layer = FusedMoE.from_hf_state_dict(full, model.config, prefix=prefix)
    _compare(layer, block)
    if arch != "gpt_oss":
        old = _per_expert(full, prefix)
        assert prefix + "experts.0.gate_proj.weight" in old and prefix + "experts.gate_up_proj" not in old
        _compare(FusedMoE.from_hf_state_dict(old, model.config, prefix=prefix), block)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_safetensors_files(tmp_path, arch, layout):
    from safetensors.torch import save_file

    if arch == "gpt_oss" and layout == "per_expert":
        pytest.skip("gpt-oss checkpoints only exist in their fused layout")
    model = tiny_model(arch)
    prefix = _block_name(model) + "."
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if layout == "per_expert":
        sd = _per_expert(sd, prefix)
    keys = sorted(sd)
    half = len(keys) // 2  # two shards, as real checkpoints are
    save_file({k: sd[k] for k in keys[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: sd[k] for k in keys[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    loaded = load_safetensors(tmp_path, prefix)
    assert loaded and all(k.startswith(prefix) for k in loaded)
    layer = FusedMoE.from_hf_state_dict(tmp_path, model.config, prefix=prefix)
    _compare(layer, _block(model))


def test_mixtral_w1_w3_w2_names():
    model = tiny_model("mixtral")
    block = _block(model)
    sd = {"gate.weight": block.gate.weight.detach()}
    I = model.config.intermediate_size
    for e in range(model.config.num_local_experts):
        sd[f"experts.{e}.w1.weight"] = block.experts.gate_up_proj[e, :I].detach()
        sd[f"experts.{e}.w3.weight"] = block.experts.gate_up_proj[e, I:].detach()
        sd[f"experts.{e}.w2.weight"] = block.experts.down_proj[e].detach()
    _compare(FusedMoE.from_hf_state_dict(sd, model.config), block)


def test_gpt_oss_conversion_round_trip_and_semantics():
    g = torch.Generator().manual_seed(0)
    E, H, I = 3, 16, 8
    gu, gub = torch.randn(E, H, 2 * I, generator=g), torch.randn(E, 2 * I, generator=g)
    dp, dpb = torch.randn(E, I, H, generator=g), torch.randn(E, H, generator=g)
    w1, b1, w2, b2 = gpt_oss_to_fused(gu, gub, dp, dpb)
    assert w1.shape == (E, 2 * I, H) and w2.shape == (E, H, I) and w1.is_contiguous()
    x = torch.randn(5, H, generator=g)
    ref = x @ gu[1] + gub[1]  # gate in even columns, up in odd ones
    ours = x @ w1[1].T + b1[1]  # gate rows, then up rows
    assert torch.allclose(ours[:, :I], ref[:, 0::2], atol=1e-5)
    assert torch.allclose(ours[:, I:], ref[:, 1::2], atol=1e-5)
    h = torch.randn(5, I, generator=g)
    assert torch.allclose(h @ w2[1].T, h @ dp[1], atol=1e-5)
    back = fused_to_gpt_oss(w1, b1, w2, b2)
    for a, b in zip(back, (gu, gub, dp, dpb)):
        assert torch.equal(a, b)


def test_errors():
    model = tiny_model("qwen3_moe")
    sd = model.state_dict()
    prefix = _block_name(model) + "."
    old = _per_expert(sd, prefix)
    del old[prefix + "experts.3.up_proj.weight"]
    with pytest.raises(KeyError, match="expert 3"):
        convert_hf_state_dict(old, model.config, prefix)
    with pytest.raises(KeyError, match="no per-expert weights"):
        per_expert_to_fused({}, "experts.")
    from transformers import LlamaConfig

    with pytest.raises(NotImplementedError, match="model_type"):
        layer_kwargs(LlamaConfig())
    cfg = tiny_model("gpt_oss").config
    cfg.swiglu_limit = 5.0
    with pytest.raises(NotImplementedError, match="swiglu"):
        layer_kwargs(cfg)
