"""FSDP2 (``fully_shard``) over a bf16 transformers MoE model whose experts run through fusedmoe's Triton forward and
backward, world 1 over NCCL on the GPU: one training step's loss and the gradient of every parameter match the
unsharded model on transformers' default experts (relative error < 2e-2, a model with one MoE layer so no
routing decision differs through an earlier layer's rounding), plain, with activation checkpointing and with each
layer compiled. The world-2 comparison (gloo, float32) is tests/test_fsdp_gloo.py."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_tiny import fully_shard_through_fusedmoe, prompt, tiny_model  # noqa: E402

from fusedmoe.reference import relative_error  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16_TOL = 2e-2


@pytest.fixture(scope="module")
def nccl_world_of_one():
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(d, 'init')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("extra", [(), ("checkpointing",), ("compile",)], ids=["plain", "checkpointing", "compile"])
@pytest.mark.parametrize("mode", ["patch", "interface"])
def test_fsdp2_bf16_training_step(nccl_world_of_one, mode, extra):
    ids = prompt(device=DEV)
    ref = tiny_model("qwen3_moe", dtype=torch.bfloat16, device=DEV, num_hidden_layers=1).train()
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16, device=DEV, num_hidden_layers=1).train()
    manager = fully_shard_through_fusedmoe(model, mode, extra)
    calls = manager.stats.calls
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert manager.stats.calls > calls, "fusedmoe did not compute the experts"
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    assert relative_error(loss.detach().float(), want.detach().float()) < BF16_TOL
    errors = {}
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert hasattr(p, "full_tensor"), f"{name} is not sharded"
        errors[name] = relative_error(p.grad.full_tensor().float(), q.grad.float())
    worst = max(errors, key=errors.get)
    assert errors[worst] < BF16_TOL, f"{worst}: {errors[worst]:.4f}"
