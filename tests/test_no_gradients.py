"""No silent gradient drop: calls without a backward (fp8) raise a typed error naming the remedy when autograd
would need a gradient of their result (and run as before under no_grad / inference mode); the others
(fused_moe, the registered op, FusedMoE, a patched transformers model) build the graph."""

from __future__ import annotations

import pytest
import torch
from devices import INTERPRETING

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
@pytest.mark.parametrize("fn", [fused_moe, fused_moe_op], ids=["fused_moe", "fused_moe_op"])
def test_functional_entry_points_build_the_graph_and_match_no_grad(fn, which):
    t = _inputs((which,))
    out = fn(**t, backend="torch")
    assert out.requires_grad
    out.sum().backward()
    assert t[which].grad is not None and torch.isfinite(t[which].grad).all()
    with torch.no_grad():
        a = fn(**t, backend="torch")
    with torch.inference_mode():
        b = fn(**t, backend="torch")
    assert torch.equal(a, out.detach()) and torch.equal(b, a) and not a.requires_grad


@pytest.mark.skipif(not INTERPRETING, reason="the fp8 experts run on CPU tensors only under the interpreter")
def test_quantized_calls_refuse_gradients():
    from fusedmoe.quant import quantize_weights

    t = _inputs(())
    q1, q2, s1, s2 = quantize_weights(t["w1"], t["w2"], "fp8_tensor")
    t.update(w1=q1, w2=q2, w1_scale=s1, w2_scale=s2)
    t["hidden_states"].requires_grad_(True)
    for fn in (fused_moe, fused_moe_op):
        match = rf"quantized calls \(fp8, mxfp4\) have no backward.*{REMEDY}"
        with pytest.raises(GradientNotSupportedError, match=match):
            fn(**t, quant="fp8_tensor", backend="triton")


def test_layer_trains_only_when_asked():
    layer = FusedMoE(4, 2, 16, 8, backend="torch")
    x = torch.randn(3, 16)
    assert not layer(x).requires_grad  # inference weights (requires_grad=False), an input without grad
    layer.gate.requires_grad_(True)
    out = layer(x)
    assert out.requires_grad
    out.sum().backward()
    assert layer.gate.grad is not None and layer.w1.grad is None
    with torch.no_grad():
        torch.testing.assert_close(layer(x), out.detach(), rtol=0, atol=0)


def test_patch_model_trains():
    """A patched model builds the graph: the routers and the experts get gradients (their agreement with
    transformers' is tests/test_hf_training.py), and it still runs under no_grad."""
    pytest.importorskip("transformers")
    from hf_tiny import tiny_config
    from transformers import AutoModelForCausalLM

    from fusedmoe.integrations.hf import patch_model

    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    patch_model(model)
    ids = torch.randint(0, 128, (1, 6))
    model.train()
    model(ids, labels=ids).loss.backward()
    mlp = model.model.layers[0].mlp
    for p in (mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_patched_gpt_oss_layer_refuses_training_its_inference_copy():
    """A patched gpt-oss block's FusedMoE layer computes with a converted inference copy of the experts: called
    directly while they require grad it raises (their gradient would be lost); the block itself trains them."""
    pytest.importorskip("transformers")
    from hf_tiny import tiny_model

    from fusedmoe.integrations.hf import patch_model

    model = tiny_model("gpt_oss")
    patch_model(model)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 5, model.config.hidden_size)
    with pytest.raises(GradientNotSupportedError, match=rf"experts\.gate_up_proj.*call the block.*{REMEDY}"):
        block.moe(x)
    block(x)[0].sum().backward()
    assert block.experts.gate_up_proj.grad is not None and block.experts.down_proj_bias.grad is not None
    with torch.no_grad():
        assert torch.isfinite(block.moe(x)).all()
    block.experts.requires_grad_(False)  # frozen experts: the copy serves, the router still trains
    block.moe(x).sum().backward()
    assert block.router.weight.grad is not None


class TwoRanks:
    """Rank 0 of a stub transport of two ranks whose every collective fails the test."""

    rank, world_size = 0, 2

    def exchange_counts(self, *args):
        raise AssertionError("the refusal must come before any collective")

    all_to_all = max_int = exchange_counts


def test_quantized_expert_parallel_layer_refuses_gradients():
    """An expert-parallel layer trains (tests/test_ep_training_gloo.py) unless its experts are quantized: then
    autograd gets a typed refusal before any token is exchanged."""
    layer = FusedMoE(4, 2, 16, 8, ep_group=TwoRanks(), quant="fp8_tensor", backend="torch")
    x = torch.randn(3, 16, requires_grad=True)
    with pytest.raises(GradientNotSupportedError, match=rf"FusedMoE: hidden_states require.*quantized.*{REMEDY}"):
        layer(x)
