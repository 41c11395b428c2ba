"""A transformers model running fusedmoe behaves like the same model running transformers' default experts
implementation, in everything transformers' own model tests exercise: every supported architecture x
{experts interface, patch_model}, float32 on the CPU (tests/test_gpu_hf.py: bf16 on the GPU).

Logits agree to float32 rounding (TOL); token sequences, names, files and storage agree exactly. Where
transformers itself fails (a generation mode a model does not support), fusedmoe must fail the same way.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import (  # noqa: E402
    ARCHS,
    fusedmoe_pair,
    one_thread,  # noqa: F401 (a fixture)
    padded_batch,
    prompt,
    tiny_model,
    use_fusedmoe,
)

from fusedmoe.integrations import hf  # noqa: E402
from fusedmoe.reference import relative_error  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
MODES = ("experts", "patch")
NEW_TOKENS = 5


@pytest.fixture(scope="module", autouse=True)
def _registered():
    hf.register()


def _run(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw)


params = pytest.mark.parametrize("mode", MODES)
archs = pytest.mark.parametrize("arch", ARCHS)


# ---- forward -------------------------------------------------------------------------------------------------
@params
@archs
def test_forward_with_and_without_padding(arch, mode):
    ref, model, manager = fusedmoe_pair(arch, mode)
    ids, mask = padded_batch()
    for kw in ({}, {"attention_mask": mask}):
        out, expected = _run(model, ids, **kw).logits, _run(ref, ids, **kw).logits
        valid = mask.bool() if kw else torch.ones_like(mask, dtype=torch.bool)
        assert out.shape == expected.shape
        assert relative_error(out[valid], expected[valid]) < TOL
    assert manager.stats.calls > 0  # fusedmoe computed it


@params
@archs
def test_router_logits_and_aux_loss(arch, mode):
    """output_router_logits as an argument and as the config flag: the same router logits (transformers'
    recorders see the routers run) and the same load-balancing loss."""
    ref, model, manager = fusedmoe_pair(arch, mode)
    ids, mask = padded_batch()
    for how in ("argument", "config"):
        kw = dict(attention_mask=mask, labels=ids)
        if how == "argument":
            kw["output_router_logits"] = True
        else:
            ref.config.output_router_logits = model.config.output_router_logits = True
        calls = manager.stats.calls
        out, expected = _run(model, ids, **kw), _run(ref, ids, **kw)
        assert manager.stats.calls > calls
        assert (out.router_logits is None) == (expected.router_logits is None)
        if expected.router_logits is not None:
            assert len(out.router_logits) == len(expected.router_logits) > 0
            for got, want in zip(out.router_logits, expected.router_logits):
                assert got.shape == want.shape and got.dtype == want.dtype
                assert relative_error(got, want) < TOL
        assert (getattr(out, "aux_loss", None) is None) == (getattr(expected, "aux_loss", None) is None)
        if getattr(expected, "aux_loss", None) is not None:
            assert relative_error(out.aux_loss, expected.aux_loss) < TOL
        assert relative_error(out.loss, expected.loss) < TOL


# ---- generate ------------------------------------------------------------------------------------------------
GENERATE = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, temperature=0.8, top_k=0),
    "beam": dict(do_sample=False, num_beams=2),
    "static_cache": dict(do_sample=False, cache_implementation="static"),
    "assisted": dict(do_sample=False),
}


def _generate(model, ids, how, assistant):
    kw = dict(GENERATE[how], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    if how == "assisted":
        kw["assistant_model"] = assistant
    torch.manual_seed(1234)
    with torch.no_grad():
        return model.generate(ids, **kw)


@params
@archs
def test_generate(arch, mode):
    ref, model, manager = fusedmoe_pair(arch, mode)
    assistant = copy.deepcopy(ref)
    ids = prompt(batch=1, length=8)
    for how in GENERATE:
        try:
            expected = _generate(ref, ids, how, assistant)
        except Exception as err:  # transformers cannot do it for this model: neither may fusedmoe
            with pytest.raises(type(err)):
                _generate(model, ids, how, assistant)
            continue
        calls = manager.stats.calls
        assert torch.equal(_generate(model, ids, how, assistant), expected), how
        assert manager.stats.calls > calls, how


# ---- weights: state dict, checkpoints, loading, resizing, casts ---------------------------------------------
def _files(path):
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@params
@archs
def test_save_pretrained_and_from_pretrained(arch, mode, tmp_path):
    """A checkpoint saved after switching to fusedmoe is the one saved before, tensor for tensor; loading
    either gives identical logits, and a loaded model switched to fusedmoe matches the switched original."""
    from transformers import AutoModelForCausalLM

    ref, model, _ = fusedmoe_pair(arch, mode)
    ids = prompt()
    fused_logits = _run(model, ids).logits
    ref.save_pretrained(tmp_path / "before")
    model.save_pretrained(tmp_path / "after")
    before, after = _files(tmp_path / "before"), _files(tmp_path / "after")
    assert list(before) == list(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    loaded = {}
    for name in ("before", "after"):
        m, info = AutoModelForCausalLM.from_pretrained(tmp_path / name, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        loaded[name] = m.eval()
    expected = _run(ref, ids).logits
    assert torch.equal(_run(loaded["before"], ids).logits, expected)
    assert torch.equal(_run(loaded["after"], ids).logits, expected)
    use_fusedmoe(loaded["after"], mode)
    assert torch.equal(_run(loaded["after"], ids).logits, fused_logits)


@archs
def test_patched_state_dict_is_the_original(arch):
    """patch_model changes no name, tensor or storage the model exposes: the FusedMoE layers hold the model's
    own Parameter and buffer objects (gpt-oss: a converted copy of its experts, outside the state dict)."""
    model = tiny_model(arch)
    ids = prompt()

    def exposed(m):
        sd = {k: (v.data_ptr(), v.dtype, tuple(v.shape)) for k, v in m.state_dict().items()}
        return (
            sd,
            [n for n, _ in m.named_parameters()],
            [n for n, _ in m.named_buffers()],
            [n for n, _ in m.named_modules()],
        )

    before = exposed(model)
    classes = {n: type(m) for n, m in model.named_modules()}
    hf.patch_model(model)
    _run(model, ids)
    assert exposed(model) == before
    for block in hf.patched_blocks(model):
        layer = block.moe
        if arch != "gpt_oss":
            assert layer.w1 is block.experts.gate_up_proj and layer.w2 is block.experts.down_proj
        assert layer.gate is (block.router if arch == "gpt_oss" else block.gate).weight
    # unpatching gives back the original modules: classes, tensors, implementation, no leftovers
    hf.unpatch_model(model)
    assert exposed(model) == before
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert model.config._experts_implementation == tiny_model(arch).config._experts_implementation
    assert not any("_fusedmoe" in m.__dict__ or m._load_state_dict_post_hooks for m in model.modules())
    assert torch.equal(_run(model, ids).logits, _run(tiny_model(arch), ids).logits)


@archs
def test_load_state_dict_into_patched_model(arch):
    """In place (the default) and by assignment (new tensor objects): the patched model computes the loaded
    weights."""
    model = tiny_model(arch)
    hf.patch_model(model)
    ids = prompt()
    _run(model, ids)
    for seed, assign in ((1, False), (2, True)):
        other = tiny_model(arch, seed=seed)
        result = model.load_state_dict(other.state_dict(), assign=assign)
        assert not result.missing_keys and not result.unexpected_keys
        assert relative_error(_run(model, ids).logits, _run(other, ids).logits) < TOL


@params
@archs
def test_resize_token_embeddings(arch, mode):
    ref, model, manager = fusedmoe_pair(arch, mode)
    vocab = ref.config.vocab_size + 24
    for m in (ref, model):
        torch.manual_seed(7)  # the new rows are drawn at random
        m.resize_token_embeddings(vocab)
    ids = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(3))
    out, expected = _run(model, ids).logits, _run(ref, ids).logits
    assert out.shape[-1] == vocab
    assert relative_error(out, expected) < TOL
    assert manager.stats.calls > 0


@params
@archs
def test_dtype_casts(arch, mode):
    """bf16 and back (the layers follow the cast tensors), float64 (transformers' own code runs it, with a
    warning: bit-identical to transformers' eager model) and back to float32 (fusedmoe again)."""
    ref, model, manager = fusedmoe_pair(arch, mode)
    ids = prompt()
    for m in (ref, model):
        m.to(torch.bfloat16).to(torch.float32)
    calls = manager.stats.calls
    assert relative_error(_run(model, ids).logits, _run(ref, ids).logits) < TOL
    assert manager.stats.calls > calls

    ref.set_experts_implementation("eager")  # transformers' grouped_mm has no CPU float64 kernel
    for m in (ref, model):
        m.to(torch.float64)
    calls = manager.stats.calls
    with pytest.warns(UserWarning, match="float64"):
        out = _run(model, ids).logits
    assert out.dtype == torch.float64 and torch.equal(out, _run(ref, ids).logits)
    assert manager.stats.calls == calls  # fusedmoe left it to transformers

    for m in (ref, model):
        m.to(torch.float32)
    ref.set_experts_implementation("grouped_mm")
    assert relative_error(_run(model, ids).logits, _run(ref, ids).logits) < TOL
    assert manager.stats.calls > calls


@archs
def test_set_experts_implementation_after_patch(arch):
    """A patched model follows set_experts_implementation: another implementation runs transformers' own
    blocks with it (bit-identical to the unpatched model), "fusedmoe" brings the patched blocks back."""
    ref = tiny_model(arch)
    model = copy.deepcopy(ref)
    manager = hf.patch_model(model)
    assert model.get_experts_implementation()[""] == "fusedmoe"
    ids = prompt()
    for impl in ("eager", "grouped_mm"):
        ref.set_experts_implementation(impl)
        model.set_experts_implementation(impl)
        calls = manager.stats.calls
        assert torch.equal(_run(model, ids).logits, _run(ref, ids).logits), impl
        assert manager.stats.calls == calls
    model.set_experts_implementation("fusedmoe")
    calls = manager.stats.calls
    assert relative_error(_run(model, ids).logits, _run(ref, ids).logits) < TOL
    assert manager.stats.calls > calls
    assert hf.unpatch_model(model) > 0
    assert model.get_experts_implementation() == tiny_model(arch).get_experts_implementation()


# ---- configurations transformers' own tests use --------------------------------------------------------------
@params
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gpt_oss"])
def test_exact_gelu_models(arch, mode):
    """hidden_act="gelu" (exact GELU, transformers' test default) runs fusedmoe's "gelu_exact"."""
    ref, model, manager = fusedmoe_pair(arch, mode, hidden_act="gelu")
    ids = prompt()
    assert relative_error(_run(model, ids).logits, _run(ref, ids).logits) < TOL
    assert manager.stats.calls > 0
    if mode == "patch":
        assert {b.moe.activation for b in hf.patched_blocks(model)} == {"gelu_exact"}
    ids = ids[:1]
    assert torch.equal(_generate(model, ids, "greedy", None), _generate(ref, ids, "greedy", None))


DEEPSEEK_FILL = {  # top_k beyond the experts of the kept groups: the last slots come from dropped groups
    "v3-test-config": ("deepseek_v3", dict(n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=8)),
    "v3-k3-of-2": ("deepseek_v3", dict(n_routed_experts=8, n_group=4, topk_group=1, num_experts_per_tok=3)),
    "v2-k3-of-2": ("deepseek_v2", dict(n_routed_experts=8, n_group=4, topk_group=1, num_experts_per_tok=3)),
}


@params
@pytest.mark.parametrize("case", DEEPSEEK_FILL)
def test_deepseek_top_k_beyond_kept_groups(case, mode):
    arch, overrides = DEEPSEEK_FILL[case]
    ref, model, manager = fusedmoe_pair(arch, mode, **overrides)
    ids = prompt()
    assert relative_error(_run(model, ids).logits, _run(ref, ids).logits) < TOL
    assert manager.stats.calls > 0
    ids = ids[:1]
    assert torch.equal(_generate(model, ids, "greedy", None), _generate(ref, ids, "greedy", None))


# ---- refused at setup, never at the first forward ------------------------------------------------------------
def _unsupported(arch):
    return dict(swiglu_limit=5.0) if arch == "gpt_oss" else dict(hidden_act="relu")


@params
@archs
def test_unsupported_model_is_refused_at_setup_and_keeps_working(arch, mode):
    model = tiny_model(arch, **_unsupported(arch))
    ids = prompt()
    expected = _run(model, ids).logits
    implementation = model.get_experts_implementation()
    name = "model.layers.1.mlp" if arch == "deepseek_v3" else "model.layers.0.mlp"  # v3's layer 0 is dense
    what = "swiglu" if arch == "gpt_oss" else "hidden_act='relu'"
    with pytest.raises(NotImplementedError, match=rf"{name}[\s\S]*{what}"):
        use_fusedmoe(model, mode)
    assert model.get_experts_implementation() == implementation
    assert not hf.patched_blocks(model)
    assert torch.equal(_run(model, ids).logits, expected)


def test_from_pretrained_refuses_unsupported_model(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_model("qwen3_moe", hidden_act="relu").save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="hidden_act='relu'"):
        AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="fusedmoe")
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._experts_implementation != "fusedmoe"


def test_patch_twice_is_refused():
    model = tiny_model("olmoe")
    hf.patch_model(model)
    with pytest.raises(ValueError, match="patched already"):
        hf.patch_model(model)


# ---- torch.export and torch.compile --------------------------------------------------------------------------
def _export_parity(arch, mode):
    ref, model, manager = fusedmoe_pair(arch, mode)
    ids = prompt()
    try:
        with torch.no_grad():
            torch.export.export(ref, args=(ids,), kwargs={"use_cache": False})
    except Exception as err:  # transformers cannot export this model: neither can fusedmoe
        with pytest.raises(type(err)), torch.no_grad():
            torch.export.export(model, args=(ids,), kwargs={"use_cache": False})
        return
    with torch.no_grad():
        program = torch.export.export(model, args=(ids,), kwargs={"use_cache": False})
        calls = manager.stats.calls
        other = prompt(seed=5)
        out = program.module()(other, use_cache=False).logits
        assert relative_error(out, _run(ref, other, use_cache=False).logits) < TOL
    assert manager.stats.calls > calls  # the exported program calls fusedmoe's op


@params
def test_export_qwen3(mode):
    _export_parity("qwen3_moe", mode)


@pytest.mark.slow
@params
@archs
def test_export_every_architecture(arch, mode):
    _export_parity(arch, mode)


@pytest.mark.slow
@params
@archs
def test_compile_fullgraph_every_architecture(arch, mode):
    torch._dynamo.reset()  # every model compiles the same transformers code: keep under the recompile limit
    ref, model, manager = fusedmoe_pair(arch, mode)
    ids = prompt()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    calls = manager.stats.calls
    out = _run(compiled, ids, use_cache=False).logits
    assert relative_error(out, _run(ref, ids, use_cache=False).logits) < TOL
    assert manager.stats.calls > calls


@pytest.mark.parametrize("arch, weights_dtype", [("qwen3_moe", torch.bfloat16), ("mixtral", torch.float32)])
def test_experts_interface_passes_transformers_tensors_as_they_come(arch, weights_dtype, monkeypatch):
    """The experts interface hands transformers' routing weights (bf16 in a bf16 Qwen3-MoE, float32 in Mixtral)
    and int64 ids to fusedmoe as they are: no conversion op per call (the kernels read them in their own dtype)."""
    ref, model, manager = fusedmoe_pair(arch, "experts", dtype=torch.bfloat16)
    given, seen = [], []
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    for m in experts:
        m.register_forward_pre_hook(lambda mod, args: given.append(args[1:3]))
    real = hf.fused_moe

    def recording(x, w1, w2, topk_weights, topk_ids, **kw):
        seen.append((topk_ids, topk_weights))
        return real(x, w1, w2, topk_weights, topk_ids, **kw)

    monkeypatch.setattr(hf, "fused_moe", recording)
    ids = prompt()
    out = _run(model, ids).logits
    assert experts and len(seen) == len(given) > 0
    for (ids_in, w_in), (ids_used, w_used) in zip(given, seen):
        assert w_in.dtype == weights_dtype and ids_in.dtype == torch.int64
        assert w_used is w_in and ids_used is ids_in
    assert relative_error(out.float(), _run(ref, ids).logits.float()) < 2e-2  # bf16 on both sides
