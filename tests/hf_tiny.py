"""Tiny random-initialised transformers MoE models (offline), shared by the tests/test_hf_*.py files."""

from __future__ import annotations

import copy

import pytest
import torch

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)

# DeepSeek's multi-head latent attention has one key/value head per query head (transformers' DeepSeek
# attention fails on a padding mask, and torch.export, with fewer).
CONFIGS = {
    "qwen3_moe": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        head_dim=16,
    ),
    "qwen2_moe": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    ),
    "mixtral": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, eos_token_id=None, pad_token_id=1),
    "deepseek_v2": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.0,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=0,
        num_key_value_heads=4,
    ),
    "deepseek_v3": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=1,
        num_hidden_layers=3,
        norm_topk_prob=True,
        num_key_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "gpt_oss": dict(
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    ),
}

ARCHS = tuple(CONFIGS)


@pytest.fixture(scope="module")
def one_thread():
    """These models are tiny: intra-op threads only add contention (100x slower on a loaded 2-core machine).
    Use as ``pytestmark = pytest.mark.usefixtures("one_thread")`` after importing it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(model_type: str, **overrides):
    from transformers import AutoConfig

    kw = dict(COMMON)
    kw.update(CONFIGS[model_type])
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Unit-scale random weights (std 1/sqrt(fan_in)), random biases and correction biases: the experts then
    move every logit, so an error in them cannot hide under the residual stream."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            std = p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)
    return model


def tiny_model(model_type: str, seed: int = 0, dtype=torch.float32, device="cpu", **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(cfg)
    randomize_(model, seed)
    return model.to(device=device, dtype=dtype).eval()


def tiny_dense_model():
    """A tiny Llama: a transformers model without any MoE block or experts module."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=64,
        )
    )


def use_fusedmoe(model: torch.nn.Module, mode: str):
    """Switch ``model`` to fusedmoe: ``patch_model`` for mode "patch", else the registered experts
    implementation (with a workspace manager of its own); the manager whose call count shows fusedmoe ran."""
    from fusedmoe.integrations import hf

    if mode == "patch":
        return hf.patch_model(model)
    hf.register()
    model.set_experts_implementation("fusedmoe")
    return hf.attach_workspace(model)


def fusedmoe_pair(model_type: str, mode: str, **kwargs):
    """(a tiny model on transformers' default experts implementation, an identical copy switched to fusedmoe by
    :func:`use_fusedmoe`, its manager). ``kwargs`` go to :func:`tiny_model`."""
    ref = tiny_model(model_type, **kwargs)
    model = copy.deepcopy(ref)
    return ref, model, use_fusedmoe(model, mode)


def fully_shard_through_fusedmoe(model: torch.nn.Module, mode: str, extra=()):
    """``model`` switched to fusedmoe (:func:`use_fusedmoe`), then FSDP2-sharded as a transformers model is: each
    decoder layer, then the root; ``extra`` may hold "checkpointing" (non-reentrant activation checkpointing) and
    "compile" (each layer compiled). Needs a process group; returns the manager of :func:`use_fusedmoe`."""
    from torch.distributed.fsdp import fully_shard

    handle = use_fusedmoe(model, mode)
    if "checkpointing" in extra:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in model.model.layers:
        fully_shard(layer)
        if "compile" in extra:
            layer.compile()
    fully_shard(model)
    return handle


def prompt(batch: int = 2, length: int = 12, seed: int = 1, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, COMMON["vocab_size"], (batch, length), generator=g).to(device)


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [3, 10], attention mask): row 1 left-padded, row 2 right-padded (pad id 1)."""
    ids = prompt(batch=3, length=10)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 7:] = 0  # right padding
    return ids.masked_fill(mask == 0, 1), mask


def routed_logits(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(float32 logits, the sorted top-k expert ids of every routing decision, in call order): transformers' own
    routing (the ids its experts modules receive) or, in a patched model, the ids fusedmoe's layers chose. Used
    to tell a near-tie routing flip from an error in the experts."""
    from fusedmoe.integrations.hf import experts_modules, patched_blocks

    seen: list[torch.Tensor] = []

    def record(module, args, kwargs):
        index = args[1] if len(args) > 1 else next(v for k, v in kwargs.items() if "ind" in k)
        seen.append(index.sort(dim=-1).values.cpu())

    def record_route(layer, args):
        _, index = layer.route(*args)  # the layer's routing of the logits its block hands it
        seen.append(index.long().sort(dim=-1).values.cpu())

    blocks = patched_blocks(model)
    handles = [b.moe.register_forward_pre_hook(record_route) for b in blocks]
    if not blocks:
        handles += [m.register_forward_pre_hook(record, with_kwargs=True) for m in experts_modules(model)]
    try:
        with torch.no_grad():
            logits = model(ids).logits.float()
    finally:
        for h in handles:
            h.remove()
    return logits, seen


def routes_differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    """How many (call, token) routing decisions differ between two :func:`routed_logits` records."""
    return sum(int((x != y).any(dim=-1).sum()) for x, y in zip(a, b, strict=True))
