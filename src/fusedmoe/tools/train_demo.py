"""``fusedmoe demo --train``: a few AdamW steps on a tiny random Qwen3-MoE whose experts run through fusedmoe.

The model is a transformers ``Qwen3MoeForCausalLM`` (random init, no download) with
``experts_implementation="fusedmoe"`` (:func:`fusedmoe.integrations.hf.register`, then
``set_experts_implementation``): routing, attention and everything else stay transformers', the experts'
forward and backward are fusedmoe's. It trains on one fixed batch of random token ids (the loss must fall as it
memorizes it) and prints the loss per step, tokens/s and peak memory, plus the first loss under transformers' own
experts for comparison. float32 with the torch backend on the CPU (a few seconds), bfloat16 with the Triton
kernels on a GPU.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import torch

#: A Qwen3-MoE small enough to train on a CPU in seconds (2 layers, 8 experts, top-2).
TRAIN_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    vocab_size=256,
    max_position_embeddings=256,
)


def build_model(device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-initialised tiny Qwen3-MoE causal LM in training mode."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**TRAIN_CONFIG))
    return model.to(device=device, dtype=dtype).train()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_mb(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "torch.cuda.max_memory_allocated"
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss_kb / (2**20 if sys.platform == "darwin" else 2**10), "process max RSS"


def run(
    steps: int = 8,
    batch: int = 1,
    seq: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress=print,
) -> dict:
    """Train ``steps`` AdamW steps on one fixed batch; returns the losses, tokens/s and memory figures."""
    from ..api import resolve_backend
    from ..integrations import hf

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(device, dtype, seed)
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device)
    with torch.no_grad():
        theirs = cfg._experts_implementation
        loss_theirs = float(model(input_ids=ids, labels=ids).loss)
    hf.register()
    model.set_experts_implementation(hf.EXPERTS_IMPLEMENTATION)
    manager = hf.attach_workspace(model)  # one manager for the model's experts, so its arena can be reported
    progress(
        f"model    random Qwen3-MoE: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} "
        f"experts, top-{cfg.num_experts_per_tok}, {dtype}, {device}; experts_implementation="
        f"{cfg._experts_implementation!r} (backend {resolve_backend('auto', device)})"
    )
    progress(f"data     one fixed batch of {batch} x {seq} random token ids, AdamW lr {lr}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, seconds = [], []
    for i in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        progress(f"step {i:3d}  loss {losses[-1]:.4f}  {batch * seq / seconds[-1]:9.1f} tokens/s")
    timed = seconds[1:] or seconds  # the first step compiles / warms up
    tokens_per_s = batch * seq / statistics.median(timed)
    peak_mb, peak_what = _peak_memory_mb(device)
    s = manager.stats
    verdict = "decreased" if losses[-1] < losses[0] else "DID NOT DECREASE"
    progress(f"loss     {losses[0]:.4f} -> {losses[-1]:.4f} ({verdict})")
    progress(f"check    step 0 loss {losses[0]:.4f}; with transformers' {theirs!r} experts {loss_theirs:.4f}")
    progress(f"speed    {tokens_per_s:.1f} tokens/s (median step after the first)")
    progress(
        f"memory   peak {peak_mb:.1f} MB ({peak_what}); workspace arena {s.reserved_bytes} B, "
        f"largest plan {s.peak_bytes} B"
    )
    return {
        "losses": losses,
        "loss_transformers": loss_theirs,
        "transformers_implementation": theirs,
        "tokens_per_s": tokens_per_s,
        "peak_mb": peak_mb,
        "peak_measure": peak_what,
        "arena_bytes": s.reserved_bytes,
        "plan_peak_bytes": s.peak_bytes,
        "device": device.type,
        "dtype": str(dtype),
    }


def main(args: argparse.Namespace) -> int:
    """Exit status 0 when the loss decreased over the steps, 1 otherwise."""
    result = run(steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr)
    return 0 if result["losses"][-1] < result["losses"][0] else 1


def add_arguments(demo: argparse.ArgumentParser) -> None:
    """``demo --train`` and its options (it also reads --batch, the sequences per step)."""
    demo.add_argument("--train", action="store_true", help="train a tiny Qwen3-MoE a few AdamW steps instead")
    demo.add_argument("--steps", type=int, default=8, help="train: optimizer steps")
    demo.add_argument("--seq", type=int, default=64, help="train: tokens per sequence")
    demo.add_argument("--lr", type=float, default=3e-3, help="train: AdamW learning rate")
