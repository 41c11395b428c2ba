"""torch.compile(fullgraph=True) of transformers models running fusedmoe (CPU, float32): no graph break."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import one_thread, prompt, tiny_model  # noqa: E402, F401

from fusedmoe.integrations import hf  # noqa: E402
from fusedmoe.reference import relative_error  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: the models' forward code objects are shared by every test here, and their
    compiled variants would add up to dynamo's recompile limit (8) across tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def test_compile_patched_qwen3_inductor_fullgraph():
    model = tiny_model("qwen3_moe")
    ids = prompt()
    ref = _logits(model, ids)
    manager = hf.patch_model(model)
    compiled = torch.compile(model, fullgraph=True)
    out = _logits(compiled, ids)
    assert relative_error(out, ref) < 1e-5
    assert manager.stats.calls == model.config.num_hidden_layers  # the op ran fusedmoe with the model's manager


@pytest.mark.parametrize(
    "arch,mode", [("qwen3_moe", "register"), ("gpt_oss", "patch"), ("gpt_oss", "register"), ("qwen2_moe", "patch")]
)
def test_compile_fullgraph_aot_eager(arch, mode):
    hf.register()
    model = tiny_model(arch)
    ids = prompt()
    ref = _logits(model, ids)
    if mode == "patch":
        manager = hf.patch_model(model)
    else:
        model.set_experts_implementation("fusedmoe")
        manager = hf.attach_workspace(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert relative_error(_logits(compiled, ids), ref) < 1e-5
    assert manager.stats.calls > 0


@pytest.mark.parametrize("quant", ["mxfp4", "fp8_block"])
def test_compiled_model_follows_quantize_experts(quant):
    """A model compiled with fusedmoe's float experts recompiles when quantize_experts switches them (its own
    implementation name is guarded), even with the float weights kept; and again after dequantize_experts."""
    from fusedmoe.integrations.hf_quant import dequantize_experts, quantize_experts

    hf.register()
    model = tiny_model("gpt_oss")
    ids = prompt()
    model.set_experts_implementation("fusedmoe")
    hf.attach_workspace(model, backend="torch")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    floats = _logits(compiled, ids)
    quantize_experts(model, quant, keep_float_weights=True)  # no parameter, workspace or backend changes
    quantized = _logits(compiled, ids)
    eager = _logits(model, ids)
    assert relative_error(quantized, eager) < 1e-5 and relative_error(quantized, floats) > 1e-3
    dequantize_experts(model)
    assert relative_error(_logits(compiled, ids), floats) < 1e-5
