"""Selecting fusedmoe's experts implementation on transformers architectures beyond the seven the other files
build: the activation comes from what the experts module applies (its ``act_fn``), not from a config field it
may not read; modules fusedmoe cannot compute are refused at selection, by ``set_experts_implementation`` and by
``from_config`` / ``from_pretrained`` alike; a model with no experts module to dispatch is refused rather than
accepted and never run. (Found by sweeping transformers' MoE architectures against their eager experts.)"""

from __future__ import annotations

import copy
import functools
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")

from hf_tiny import prompt, randomize_  # noqa: E402

from fusedmoe.integrations import hf  # noqa: E402
from fusedmoe.reference import activation_reference  # noqa: E402


def _model(model_type: str, config_name: str, model_name: str, **config):
    """(config, model class) of a tiny ``model_type`` (skipped where this transformers has none)."""
    try:
        cfg_mod = importlib.import_module(f"transformers.models.{model_type}.configuration_{model_type}")
        model_mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        pytest.skip(f"this transformers has no {model_type}")
    cfg = getattr(cfg_mod, config_name)(vocab_size=128, max_position_embeddings=256, **config)
    cls = getattr(model_mod, model_name)
    return cfg, cls


def _randomized(cls, cfg):
    torch.manual_seed(0)
    return randomize_(cls._from_config(cfg)).eval()


def _logits(model):
    with torch.no_grad():
        return model(input_ids=prompt(length=7), use_cache=False).logits


# ---- the activation is the module's --------------------------------------------------------------------------
def _act2fn_names() -> list[str]:
    from transformers.activations import ACT2CLS

    return sorted(ACT2CLS)


@pytest.mark.parametrize("name", _act2fn_names())
def test_every_transformers_activation_is_mapped_exactly_or_refused(name):
    """For each ACT2FN entry: fusedmoe's activation of that name computes act(gate) * up to float64 rounding, or the
    name is refused with NotImplementedError."""
    from transformers.activations import ACT2FN

    act = ACT2FN[name]
    try:
        kind = hf.act_fn_activation(act)
    except NotImplementedError as err:
        assert "no fusedmoe kernel" in str(err)
        return
    gate_up = torch.linspace(-12, 12, 4002, dtype=torch.float64).reshape(-1, 2)
    gate, up = gate_up[:, :1], gate_up[:, 1:]
    torch.testing.assert_close(activation_reference(gate_up, kind), act(gate) * up, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "fn,kind",
    [
        (F.silu, "silu"),
        (nn.SiLU(), "silu"),
        (F.gelu, "gelu_exact"),
        (nn.GELU(), "gelu_exact"),
        (nn.GELU(approximate="tanh"), "gelu"),
        (functools.partial(F.gelu, approximate="tanh"), "gelu"),
    ],
)
def test_torch_activation_callables(fn, kind):
    assert hf.act_fn_activation(fn) == kind


def test_look_alike_activations_are_refused():
    class MySiLU(nn.SiLU):  # a subclass may compute anything
        def forward(self, x):
            return F.silu(x) * 2

    for fn in (MySiLU(), F.relu, nn.Mish(), functools.partial(F.gelu, approximate="none", out=None), lambda x: x):
        with pytest.raises(NotImplementedError, match="no fusedmoe kernel"):
            hf.act_fn_activation(fn)


def test_gemma4_experts_compute_their_gelu_tanh():
    """Gemma-4 builds its experts' act_fn from ``hidden_activation`` (GELU, tanh) and has no ``hidden_act``: fusedmoe
    took SiLU from the missing field (logits off by 0.23 relative)."""
    cfg, cls = _model(
        "gemma4",
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=32,
    )
    hf.register()
    ref = _randomized(cls, cfg)
    assert hf._activation_of(hf.experts_modules(ref)[0]) == "gelu"
    model = copy.deepcopy(ref)
    model.set_experts_implementation("fusedmoe")
    want = _logits(ref)
    got = _logits(model)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_lfm2_moe_experts_compute_silu_whatever_hidden_act_says():
    cfg, cls = _model(
        "lfm2_moe",
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_dense_layers=0,
        num_experts_per_tok=2,
        num_experts=8,
        layer_types=["conv", "full_attention"],
        hidden_act="gelu",
    )
    hf.register()
    ref = _randomized(cls, cfg)
    model = copy.deepcopy(ref)
    model.set_experts_implementation("fusedmoe")
    want = _logits(ref)
    assert (_logits(model) - want).abs().max() <= 1e-4 * want.abs().max()


# ---- refusals at selection -------------------------------------------------------------------------------------
def _refused_both_ways(cls, cfg, match: str):
    hf.register()
    model = cls._from_config(cfg)
    with pytest.raises(NotImplementedError, match=match):
        model.set_experts_implementation("fusedmoe")
    assert model.config._experts_implementation != "fusedmoe"
    with pytest.raises(NotImplementedError, match=match):  # at load: checked once the modules exist
        cls._from_config(cfg, experts_implementation="fusedmoe")


def test_ungated_experts_are_refused():
    cfg, cls = _model(
        "nemotron_h",
        "NemotronHConfig",
        "NemotronHForCausalLM",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=32,
    )
    _refused_both_ways(cls, cfg, "ungated experts")


def test_custom_gate_is_refused_at_load_too():
    cfg, cls = _model(
        "deepseek_v4",
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        q_lora_rank=32,
        num_experts_per_tok=2,
        n_routed_experts=8,
        layer_types=["heavily_compressed_attention"] * 2,
        mlp_layer_types=["moe", "moe"],
        qk_rope_head_dim=8,
    )
    _refused_both_ways(cls, cfg, "custom gate")


def test_moe_without_an_experts_module_is_refused():
    """JetMoE has no ``@use_experts_implementation`` module: transformers would accept the name and never call it."""
    cfg, cls = _model(
        "jetmoe",
        "JetMoeConfig",
        "JetMoeForCausalLM",
        hidden_size=64,
        num_hidden_layers=2,
        num_key_value_heads=2,
        kv_channels=16,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    hf.register()
    model = cls._from_config(cfg)
    with pytest.raises(NotImplementedError, match="no transformers experts module"):
        model.set_experts_implementation("fusedmoe")
