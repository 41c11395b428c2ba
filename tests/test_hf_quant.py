"""Quantized experts inside transformers models (fusedmoe.integrations.hf_quant): a gpt-oss model loaded by
transformers from an MXFP4 checkpoint (its experts dequantized at load time) gets its MXFP4 experts back and runs
them through fusedmoe; fp8 quantization of a float model; what it refuses."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from devices import TRITON_DEVICES  # noqa: E402
from hf_tiny import one_thread, prompt, routed_logits, routes_differ, tiny_model  # noqa: E402, F401

from fusedmoe.checks import GradientNotSupportedError  # noqa: E402
from fusedmoe.integrations import hf  # noqa: E402
from fusedmoe.integrations.hf_quant import (  # noqa: E402
    QUANTIZED_IMPLEMENTATION,
    dequantize_experts,
    is_quantized,
    quantize_experts,
)
from fusedmoe.mxfp4 import quantize_mxfp4  # noqa: E402
from fusedmoe.reference import relative_error  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def gpt_oss_checkpoint(tmp_path_factory):
    """A tiny gpt-oss checkpoint as OpenAI ships it: experts as ``*_blocks`` / ``*_scales`` (MXFP4), the rest
    float, ``quantization_config.quant_method = "mxfp4"`` in config.json."""
    from safetensors.torch import save_file

    model = tiny_model("gpt_oss")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        packed, scales = quantize_mxfp4(sd.pop(name).transpose(1, 2))  # stored [E, N, K]: out-features major
        sd[name + "_blocks"] = packed.unflatten(-1, (packed.shape[-1] // 16, 16)).contiguous()
        sd[name + "_scales"] = scales.contiguous()
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    model.config.quantization_config = {"quant_method": "mxfp4"}
    model.config.save_pretrained(path)
    save_file(sd, os.path.join(path, "model.safetensors"))
    return path


def _load(path):
    """transformers' own loader: without OpenAI's kernels it dequantizes the experts."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    return model.eval()


#: (device, dtype, backend, tolerance): float32 through the torch experts on the CPU; bf16 through the Triton
#: kernels on the GPU, against the bf16 model's own experts.
RUNS = [
    pytest.param("cpu", torch.float32, "torch", 1e-5, id="cpu-fp32"),
    pytest.param("cuda", torch.bfloat16, "triton", 2e-2, marks=pytest.mark.gpu, id="cuda-bf16"),
]


def _assert_close_but_for_flips(got, want, truth_routes, tol):
    """``got`` (logits, routes) within ``tol`` of ``want``, unless one of them routed a token differently from the
    float32 model (a near tie that bf16 rounding tips): then within 5 x tol (test_gpu_hf's rule; the H200 saw
    0.063 for this tiny gpt-oss in bf16)."""
    err = relative_error(got[0], want[0])
    if err >= tol:
        flips = routes_differ(want[1], truth_routes) + routes_differ(got[1], truth_routes)
        assert flips > 0, f"{err:.4f} from transformers' experts, though both route exactly like float32"
        assert err < 5 * tol, f"{err:.4f} from transformers' experts: more than a few flipped tokens explain"


@pytest.mark.parametrize("device,dtype,backend,tol", RUNS)
def test_gpt_oss_mxfp4_checkpoint_runs_its_experts_in_mxfp4(gpt_oss_checkpoint, device, dtype, backend, tol):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ids = prompt(device=device)
    model = _load(gpt_oss_checkpoint).to(device=device)
    _, truth_routes = routed_logits(model, ids)  # float32: the routing bf16 rounding may tip
    model = model.to(dtype=dtype)  # MXFP4 values are exact in bf16
    calls = []  # each experts module's inputs and output in transformers' own run
    hooks = [
        e.register_forward_hook(lambda m, a, kw, out: calls.append((m, a, kw, out)), with_kwargs=True)
        for e in hf.experts_modules(model)
    ]
    try:
        want = routed_logits(model, ids)  # transformers' eager experts on the dequantized weights
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == model.config.num_hidden_layers
    floats = [(e.gate_up_proj.clone(), e.down_proj.clone()) for e in hf.experts_modules(model)]

    assert quantize_experts(model, "mxfp4") == model.config.num_hidden_layers
    assert model.config._experts_implementation == QUANTIZED_IMPLEMENTATION  # a name of its own: compile guards it
    manager = hf.attach_workspace(model, backend=backend)
    for experts in hf.experts_modules(model):
        assert is_quantized(experts) and experts.gate_up_proj.numel() == 0 and experts.down_proj.numel() == 0
        assert experts.fusedmoe_w1.dtype == torch.uint8  # the checkpoint's bytes per weight: half a byte
        assert experts.fusedmoe_w1.numel() * 2 == floats[0][0].numel()
    assert "model.layers.0.mlp.experts.fusedmoe_w1" not in model.state_dict()  # buffers are not saved
    with torch.no_grad():  # each module on the very inputs it had (no routing flips): the MXFP4 kernels' error
        for module, args, kwargs, out in calls:
            assert relative_error(module(*args, **kwargs), out) < tol
    got = routed_logits(model, ids)
    assert manager.stats.calls > 0  # fusedmoe computed the experts
    _assert_close_but_for_flips(got, want, truth_routes, tol)

    # the values came from MXFP4, so quantizing gave them back exactly
    assert dequantize_experts(model) == model.config.num_hidden_layers
    for experts, (gate_up, down) in zip(hf.experts_modules(model), floats):
        assert torch.equal(experts.gate_up_proj, gate_up) and torch.equal(experts.down_proj, down)
        assert not is_quantized(experts) and not hasattr(experts, "fusedmoe_w1")
    assert model.config._experts_implementation == hf.EXPERTS_IMPLEMENTATION
    _assert_close_but_for_flips(routed_logits(model, ids), want, truth_routes, tol)  # float experts via fusedmoe


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_fp8_quantization_of_a_float_model(device):
    """fp8 (dynamic activation scales; the Triton kernels) on a float Qwen3-MoE: lossy, close to the float
    model; the float weights kept on request."""
    model = tiny_model("qwen3_moe", device=device)
    ids = prompt(device=device)
    want = _logits(model, ids)
    assert quantize_experts(model, "fp8_token", keep_float_weights=True) == 2
    hf.attach_workspace(model, backend="triton")
    experts = hf.experts_modules(model)[0]
    assert experts.gate_up_proj.numel() > 0
    quantized = _logits(model, ids)
    err = relative_error(quantized, want)
    assert 0 < err < 0.1  # quantized (not the float path), and close
    model.double().float()  # a dtype round trip: the fp8 weights and float32 scales are not cast along
    assert torch.equal(_logits(model, ids), quantized)
    kept = experts.gate_up_proj
    assert dequantize_experts(model) == 2 and experts.gate_up_proj is kept  # the kept float weights stay
    assert relative_error(_logits(model, ids), want) < 1e-5


def test_quantized_experts_refuse_what_they_cannot_do(gpt_oss_checkpoint):
    model = _load(gpt_oss_checkpoint)
    with pytest.raises(ValueError, match="dynamic activation scales"):
        quantize_experts(model, "fp8_tensor_static")
    with pytest.raises(ValueError, match="unknown|mode"):
        quantize_experts(model, "int4")
    assert not any(is_quantized(e) for e in hf.experts_modules(model))  # nothing changed by a refusal
    quantize_experts(model, "mxfp4")
    hf.attach_workspace(model, backend="torch")
    with pytest.raises(TypeError, match="already quantized"):
        quantize_experts(model, "mxfp4")
    with pytest.raises(NotImplementedError, match="quantized"):
        hf.patch_model(model)
    experts = hf.experts_modules(model)[0]
    E, k, H = experts.num_experts, 2, model.config.hidden_size
    ids = torch.randint(0, E, (3, k))
    with pytest.raises(TypeError, match="float64"):
        experts(torch.randn(3, H, dtype=torch.float64), ids, torch.rand(3, k))
    x = torch.randn(3, H, requires_grad=True)
    with pytest.raises(GradientNotSupportedError, match="no backward"):
        experts(x, ids, torch.rand(3, k))
    with torch.no_grad():  # the same call without a gradient runs
        assert experts(x, ids, torch.rand(3, k)).shape == (3, H)


def test_what_quantize_experts_refuses_names_the_module():
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts .*divisible by 32"):
        quantize_experts(tiny_model("qwen3_moe", moe_intermediate_size=48), "mxfp4")
    patched = tiny_model("qwen3_moe")
    hf.patch_model(patched)
    with pytest.raises(NotImplementedError, match="unpatch_model first"):
        quantize_experts(patched, "mxfp4")
    hf.unpatch_model(patched)
    assert quantize_experts(patched, "mxfp4") == 2


def test_biases_are_the_modules_own_and_requires_grad_survives(gpt_oss_checkpoint):
    """The quantized path computes with the module's bias parameters as they are at each call (a bias changed
    in place after a call, when gpt-oss's re-ordered copy is kept, takes effect, as in transformers' own experts);
    dequantize_experts gives back requires_grad and drops the copy."""
    model = _load(gpt_oss_checkpoint)
    model.model.layers[0].mlp.experts.down_proj.requires_grad_(False)
    flags = [(e.gate_up_proj.requires_grad, e.down_proj.requires_grad) for e in hf.experts_modules(model)]
    ids = prompt()
    quantize_experts(model, "mxfp4")
    hf.attach_workspace(model, backend="torch")
    before = _logits(model, ids)  # keeps each module's re-ordered gate_up_proj_bias
    assert all(hasattr(e, "_fusedmoe_gate_then_up_bias") for e in hf.experts_modules(model))
    with torch.no_grad():
        for experts in hf.experts_modules(model):
            experts.gate_up_proj_bias.zero_()
            experts.down_proj_bias.mul_(-1)
    got = _logits(model, ids)
    assert relative_error(got, before) > 1e-3  # the changed biases took effect
    dequantize_experts(model)
    assert [(e.gate_up_proj.requires_grad, e.down_proj.requires_grad) for e in hf.experts_modules(model)] == flags
    assert not any(hasattr(e, "_fusedmoe_gate_then_up_bias") for e in hf.experts_modules(model))
    model.set_experts_implementation("eager")  # transformers' own experts, with the changed biases
    assert relative_error(got, _logits(model, ids)) < 1e-5


def test_a_failure_half_way_leaves_the_model_as_it_was(monkeypatch):
    """quantize_experts puts every module back when a later step fails (here: selecting the implementation);
    the float weights are only dropped once everything else succeeded."""
    model = tiny_model("qwen3_moe")
    before = [(e.gate_up_proj, e.down_proj) for e in hf.experts_modules(model)]

    def refuse(name):
        raise RuntimeError("selection refused")

    monkeypatch.setattr(model, "set_experts_implementation", refuse)
    with pytest.raises(RuntimeError, match="selection refused"):
        quantize_experts(model, "mxfp4")
    for experts, (gate_up, down) in zip(hf.experts_modules(model), before):
        assert not is_quantized(experts) and not hasattr(experts, "fusedmoe_w1")
        assert experts.gate_up_proj is gate_up and experts.down_proj is down


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_quantized_experts_take_routing_weights_in_any_float_dtype(gpt_oss_checkpoint, device):
    """Routing weights reach the quantized kernels in the dtype transformers passes (no cast per call): bf16
    weights give what the same values in float32 give."""
    model = _load(gpt_oss_checkpoint).to(device)
    quantize_experts(model, "mxfp4")
    hf.attach_workspace(model, backend="triton")  # the CPU interpreter runs the kernels on the CPU
    experts = hf.experts_modules(model)[0]
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(5, model.config.hidden_size, generator=g, device=device)
    ids = torch.randint(0, model.config.num_local_experts, (5, 2), generator=g, device=device)
    w = torch.rand(5, 2, generator=g, device=device).to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(experts(x, ids, w), experts(x, ids, w.float()), rtol=0, atol=0)
