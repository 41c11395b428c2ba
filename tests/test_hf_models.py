"""fusedmoe inside transformers models (float32, CPU): patch_model and the registered experts implementation
against the unpatched models, for every supported architecture."""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import ARCHS, one_thread, prompt, tiny_config, tiny_model  # noqa: E402, F401

from fusedmoe import WorkspaceManager  # noqa: E402
from fusedmoe.integrations import hf  # noqa: E402
from fusedmoe.reference import relative_error  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
NEW_TOKENS = 32


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _greedy(model, ids):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[:, ids.shape[1] :]


def _moe_blocks(model):
    return [m for m in model.modules() if isinstance(m, hf.FusedMoEBlock)]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    hf.register()


@pytest.mark.parametrize("arch", ARCHS)
def test_patch_model_matches_transformers(arch):
    model = tiny_model(arch)
    ids = prompt()
    ref_logits = _logits(model, ids)
    ref_tokens = _greedy(model, ids[:1])
    n_blocks = sum(type(m).__name__ in hf.PATCHABLE_BLOCKS for m in model.modules())

    manager = hf.patch_model(model)
    blocks = _moe_blocks(model)
    assert len(blocks) == n_blocks > 0
    assert all(b.moe.workspace is manager for b in blocks)  # one manager for the whole model
    logits = _logits(model, ids)
    assert relative_error(logits, ref_logits) < TOL
    assert torch.equal(_greedy(model, ids[:1]), ref_tokens)
    assert manager.stats.calls > 0 and manager.stats.device_allocations >= 1

    assert hf.unpatch_model(model) == n_blocks
    assert not _moe_blocks(model)
    assert torch.equal(_logits(model, ids), ref_logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_patched_block_matches_original_block(arch):
    """Block level, many tokens (every expert hit), router and shared experts included."""
    model = tiny_model(arch)
    original = copy.deepcopy(model)
    hf.patch_model(model)
    name = next(n for n, m in model.named_modules() if isinstance(m, hf.FusedMoEBlock))
    block, original_block = model.get_submodule(name), original.get_submodule(name)
    assert type(original_block) in type(block).__mro__  # the same transformers class underneath
    x = torch.randn(3, 40, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out, ref = block(x), original_block(x)
    if isinstance(ref, tuple):  # gpt-oss returns (hidden, router_scores)
        assert isinstance(out, tuple)
        out, ref = out[0], ref[0]
    assert out.shape == ref.shape
    assert relative_error(out, ref) < TOL
    assert ref.norm() > 0.1 * x.norm()  # the experts matter: a wrong one could not hide


@pytest.mark.parametrize("arch", ARCHS)
def test_set_experts_implementation(arch):
    model = tiny_model(arch)
    ids = prompt()
    ref_logits = _logits(model, ids)
    ref_tokens = _greedy(model, ids[:1])
    model.set_experts_implementation("fusedmoe")
    manager = hf.attach_workspace(model)
    logits = _logits(model, ids)
    assert manager.stats.calls > 0  # fusedmoe really ran
    assert relative_error(logits, ref_logits) < TOL
    assert torch.equal(_greedy(model, ids[:1]), ref_tokens)
    model.set_experts_implementation("eager")
    calls = manager.stats.calls
    _logits(model, ids)
    assert manager.stats.calls == calls


def test_from_config_experts_implementation():
    from transformers import AutoModelForCausalLM

    ref = tiny_model("qwen3_moe")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), experts_implementation="fusedmoe").eval()
    model.load_state_dict(ref.state_dict())
    assert model.config._experts_implementation == "fusedmoe"
    manager = hf.attach_workspace(model, WorkspaceManager("cpu"))
    ids = prompt()
    assert relative_error(_logits(model, ids), _logits(ref, ids)) < TOL
    assert manager.stats.calls == model.config.num_hidden_layers


def test_from_pretrained_experts_implementation(tmp_path):
    from transformers import AutoModelForCausalLM

    ref = tiny_model("mixtral")
    ref.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="fusedmoe").eval()
    assert model.config._experts_implementation == "fusedmoe"
    ids = prompt()
    assert relative_error(_logits(model, ids), _logits(ref, ids)) < TOL


def test_experts_function_contract():
    """int64 index, model-dtype weights, dense [T, E] weights; returns [T, H] in hidden's dtype."""
    model = tiny_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    T, H, E, k = 7, model.config.hidden_size, model.config.num_experts, 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int64)
    w = torch.rand(T, k, generator=g)
    model.set_experts_implementation("eager")
    with torch.no_grad():
        ref = experts(x, idx, w)
        out = hf.fusedmoe_experts_forward(experts, x, idx, w)
        dense = torch.zeros(T, E).scatter(1, idx, w)
        out_dense = hf.fusedmoe_experts_forward(experts, x, idx, dense)
    assert out.dtype == x.dtype and out.shape == (T, H)
    assert relative_error(out, ref) < TOL
    assert relative_error(out_dense, ref) < TOL


def test_gpt_oss_conversion_is_cached_and_refreshed():
    model = tiny_model("gpt_oss")
    model.set_experts_implementation("fusedmoe")
    experts = model.model.layers[0].mlp.experts
    ids = prompt()
    _logits(model, ids)
    first = experts.__dict__[hf._CACHE_ATTR][1][0]
    _logits(model, ids)
    assert experts.__dict__[hf._CACHE_ATTR][1][0] is first  # converted once
    with torch.no_grad():
        experts.down_proj_bias.add_(1.0)  # in-place update bumps the version: the cache follows
    model.set_experts_implementation("eager")
    ref = _logits(model, ids)
    model.set_experts_implementation("fusedmoe")
    assert relative_error(_logits(model, ids), ref) < TOL


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU tensors needs the interpreter")
def test_triton_backend_gpt_oss_block():
    """gpt-oss's biases and clamped SwiGLU through the Triton kernels (CPU interpreter)."""
    model = tiny_model("gpt_oss")
    original = copy.deepcopy(model)
    hf.patch_model(model, backend="triton")
    x = torch.randn(1, 24, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out, ref = model.model.layers[0].mlp(x)[0], original.model.layers[0].mlp(x)[0]
    assert isinstance(model.model.layers[0].mlp, hf.FusedMoEBlock)
    assert relative_error(out, ref) < TOL


def test_patch_model_errors():
    from hf_tiny import tiny_dense_model

    dense = tiny_dense_model()
    with pytest.raises(ValueError, match="no MoE block"):
        hf.patch_model(dense)
    with pytest.raises(NotImplementedError, match="hidden_act"):
        hf.patch_model(tiny_model("mixtral", hidden_act="relu"))


def test_patch_model_given_workspace_and_unpatch_idempotent():
    model = tiny_model("olmoe")
    mgr = WorkspaceManager("cpu", strategy="per_layer")
    assert hf.patch_model(model, mgr) is mgr
    _logits(model, prompt())
    assert mgr.stats.calls == model.config.num_hidden_layers
    assert hf.unpatch_model(model) == model.config.num_hidden_layers
    assert hf.unpatch_model(model) == 0


def test_patched_model_deepcopy_and_pickle():
    """A deep copy is a patched model of its own tensors sharing the workspace manager; pickling is refused
    with a clear error (save the state dict instead)."""
    import pickle

    model = tiny_model("qwen2_moe")
    manager = hf.patch_model(model)
    ids = prompt()
    expected = _logits(model, ids)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
    calls = manager.stats.calls
    assert not torch.equal(_logits(clone, ids), expected)  # the copy computes its own tensors
    assert manager.stats.calls > calls  # through the shared manager
    assert torch.equal(_logits(model, ids), expected)
    assert all(b.moe.w1 is b.experts.gate_up_proj for b in hf.patched_blocks(clone))
    with pytest.raises(TypeError, match="save_pretrained"):
        pickle.dumps(model)
    hf.unpatch_model(model)
    pickle.dumps(model)


def test_router_hooks_see_the_router_run():
    """A user's hook on a patched block's router sees the router run, with the logits the block routes on."""
    ref = tiny_model("deepseek_v3")
    model = copy.deepcopy(ref)
    hf.patch_model(model)
    seen, expected = [], []
    model.model.layers[1].mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[0]))
    ref.model.layers[1].mlp.gate.register_forward_hook(lambda m, a, out: expected.append(out[0]))
    ids = prompt()
    assert relative_error(_logits(model, ids), _logits(ref, ids)) < TOL
    assert len(seen) == len(expected) == 1 and torch.equal(seen[0], expected[0])


def test_manual_parameter_replacement_is_picked_up():
    model = tiny_model("mixtral")
    hf.patch_model(model)
    ids = prompt()
    _logits(model, ids)
    other = tiny_model("mixtral", seed=3)
    model.load_state_dict({k: v for k, v in other.state_dict().items() if ".mlp." not in k}, strict=False)
    for layer, src in zip(model.model.layers, other.model.layers):  # the MoE weights: new Parameter objects
        layer.mlp.experts.gate_up_proj = torch.nn.Parameter(src.mlp.experts.gate_up_proj.detach().clone())
        layer.mlp.experts.down_proj = torch.nn.Parameter(src.mlp.experts.down_proj.detach().clone())
        layer.mlp.gate.weight = torch.nn.Parameter(src.mlp.gate.weight.detach().clone())
    model.requires_grad_(False)
    assert relative_error(_logits(model, ids), _logits(other, ids)) < TOL


def test_mixtral_training_jitter_runs_the_patched_path():
    """In training mode with router jitter the patched block draws the noise as transformers does (the same draw
    from the same generator), then routes and runs the experts through its FusedMoE layer: seeded alike, the
    two models compute the same logits. (Gradients: tests/test_hf_training.py.)"""
    ref = tiny_model("mixtral", router_jitter_noise=0.1)
    model = copy.deepcopy(ref)
    manager = hf.patch_model(model)
    ids = prompt()
    ref.train()
    model.train()
    calls = manager.stats.calls
    outs = []
    for m in (ref, model):
        torch.manual_seed(5)
        outs.append(_logits(m, ids))
    assert relative_error(outs[1], outs[0]) < TOL
    assert manager.stats.calls > calls  # the patched path
    torch.manual_seed(6)
    assert relative_error(_logits(model, ids), outs[0]) > 100 * TOL  # another draw: the noise is applied


def test_patch_model_refuses_what_it_would_not_run():
    """A block whose forward is replaced on the instance (as accelerate's hooks do) and quantized expert
    weights are refused at patch time, naming the module; the model is left as it was."""
    model = tiny_model("olmoe")
    block = model.model.layers[1].mlp
    block.forward = block.forward  # an instance-level forward shadows the class's
    with pytest.raises(NotImplementedError, match=r"model\.layers\.1\.mlp \(OlmoeSparseMoeBlock\).*instance"):
        hf.patch_model(model)
    assert not hf.patched_blocks(model) and model.config._experts_implementation != "fusedmoe"
    del block.forward
    experts = model.model.layers[0].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(
        experts.gate_up_proj.detach().to(torch.float8_e4m3fn), requires_grad=False
    )
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.mlp .*float8_e4m3fn"):
        hf.patch_model(model)
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.mlp\.experts .*float8_e4m3fn"):
        model.set_experts_implementation("fusedmoe")


def test_patched_router_runs_only_while_observed():
    """After router logits were recorded once (transformers' recorder hooks then stay on the routers), a plain
    forward of a patched model computes its logits without running transformers' router (its top-k)."""
    from unittest import mock

    model = tiny_model("qwen3_moe")
    hf.patch_model(model)
    ids = prompt()
    router_cls = type(model.model.layers[0].mlp.gate)
    with mock.patch.object(router_cls, "forward", autospec=True, side_effect=router_cls.forward) as forward:
        with torch.no_grad():
            out = model(ids, output_router_logits=True)
        assert forward.call_count == model.config.num_hidden_layers == len(out.router_logits)
        _logits(model, ids)
        assert forward.call_count == model.config.num_hidden_layers


def test_the_experts_verdict_key_reads_hidden_act_from_any_config_object():
    """The interface's verdict key reads ``config.hidden_act`` past transformers' slow attribute hook, and still
    from a config without an instance dict or without the attribute."""
    from types import SimpleNamespace

    from fusedmoe.integrations.hf import _hidden_act_of

    class Slots:
        __slots__ = ("hidden_act",)

    slots = Slots()
    slots.hidden_act = "gelu"
    module = torch.nn.Module()
    assert _hidden_act_of(module) is None
    for config, want in ((SimpleNamespace(hidden_act="silu"), "silu"), (slots, "gelu"), (SimpleNamespace(), None)):
        module.config = config
        assert _hidden_act_of(module) == want
    module.config = tiny_model("qwen3_moe", hidden_act="gelu").config
    assert _hidden_act_of(module) == "gelu"


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_an_unobserved_patched_block_leaves_the_router_logits_to_its_layer(arch):
    """A plain forward hands the block's FusedMoE layer no logits where the layer's gate (and gpt-oss' bias) give
    the router's own (so the routing launch can compute them); DeepSeek's routers compute float32 logits, which the
    block still passes. Either way the model computes transformers' logits."""
    from unittest import mock

    from fusedmoe import FusedMoE

    ref = tiny_model(arch)
    model = copy.deepcopy(ref)
    hf.patch_model(model)
    ids = prompt()
    with mock.patch.object(FusedMoE, "forward", autospec=True, side_effect=FusedMoE.forward) as forward:
        logits = _logits(model, ids)
    calls = forward.call_args_list
    given = [call.args[2] if len(call.args) > 2 else call.kwargs.get("router_logits") for call in calls]
    assert len(given) == len(_moe_blocks(model))
    if arch == "deepseek_v3":
        assert all(g is not None and g.dtype == torch.float32 for g in given)
    else:
        assert all(g is None for g in given)
    assert relative_error(logits, _logits(ref, ids)) < TOL
