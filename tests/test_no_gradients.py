"""No silent gradient drop: until fusedmoe has a backward pass, every entry point raises a typed error naming the
remedy when autograd would need a gradient of its result, and runs as before under no_grad / inference mode."""

from __future__ import annotations

import pytest
import torch

from fusedmoe import FusedMoE, fused_moe
from fusedmoe.checks import GradientNotSupportedError
from fusedmoe.op import fused_moe_op

REMEDY = r"torch.no_grad\(\) or torch.inference_mode\(\)"


def _inputs(requires=("hidden_states",)):
    g = torch.Generator().manual_seed(0)
    t = dict(
        hidden_states=torch.randn(5, 16, generator=g),
        w1=torch.randn(4, 32, 16, generator=g) / 4,
        w2=torch.randn(4, 16, 16, generator=g) / 4,
        topk_weights=torch.rand(5, 2, generator=g),
        topk_ids=torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]], dtype=torch.int32),
    )
    for name in requires:
        t[name].requires_grad_(True)
    return t


@pytest.mark.parametrize("which", ["hidden_states", "w1", "w2", "topk_weights"])
@pytest.mark.parametrize("call", ["fused_moe", "fused_moe_op"])
def test_functional_entry_points(which, call):
    fn = fused_moe if call == "fused_moe" else fused_moe_op
    t = _inputs((which,))
    with pytest.raises(GradientNotSupportedError, match=f"{which} requires grad.*{REMEDY}"):
        fn(**t, backend="torch")
    with torch.no_grad():
        a = fn(**t, backend="torch")
    with torch.inference_mode():
        b = fn(**t, backend="torch")
    assert torch.equal(a, b) and not a.requires_grad


def test_layer_with_trainable_weights_or_router():
    layer = FusedMoE(4, 2, 16, 8, backend="torch")
    x = torch.randn(3, 16)
    layer(x)  # inference weights (requires_grad=False) and an input without grad: fine
    layer.gate.requires_grad_(True)
    with pytest.raises(GradientNotSupportedError, match="FusedMoE: gate requires grad"):
        layer(x)
    with torch.no_grad():
        layer(x)
    layer.gate.requires_grad_(False)
    with pytest.raises(GradientNotSupportedError, match="hidden_states requires grad"):
        layer(x.requires_grad_(True))


@pytest.mark.parametrize("how", ["experts_interface", "patch_model"])
def test_transformers_training_forward_raises(how):
    pytest.importorskip("transformers")
    from hf_tiny import tiny_config
    from transformers import AutoModelForCausalLM

    from fusedmoe.integrations.hf import patch_model, register

    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    if how == "experts_interface":
        register()
        model.set_experts_implementation("fusedmoe")
    else:
        patch_model(model)
    ids = torch.randint(0, 128, (1, 6))
    model.train()
    with pytest.raises(GradientNotSupportedError, match=REMEDY):
        model(ids, labels=ids).loss.backward()
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
