"""``fusedmoe demo --train``: fine-tune a tiny random Qwen3-MoE through fusedmoe beside transformers' own experts.

The model is a transformers ``Qwen3MoeForCausalLM`` built from a config (random init, no download). Two copies
start from the same weights: one with ``experts_implementation="fusedmoe"`` (:func:`fusedmoe.integrations.hf.register`,
then ``set_experts_implementation``; routing, attention and everything else stay transformers', the experts'
forward and backward are fusedmoe's), the other under transformers' default experts implementation (whatever
the config selects before the switch: ``"grouped_mm"`` on transformers 5). Each has its own AdamW; both take the
same batches, their steps interleaved (step i of one, then step i of the other, the order alternating) so that
timing noise hits both alike. A plain loop rather than transformers' ``Trainer``: the two runs must step in
lockstep on identical batches, each step timed alone.

The data: every step a fresh batch from a fixed random Markov chain over the vocabulary (seeded): each token has
``BRANCHING`` distinct successors, each next with equal probability. The model can only learn the chain's
transitions, not memorize a batch; the best loss it can reach is the chain's entropy, ``log(BRANCHING)`` nats per
predicted token (1.386 for 4), against ``log(vocab)`` (5.545 for 256) for a model that knows nothing.

It prints both losses every ``--log-every`` steps, then: each loss from start to end; the largest and the final
gap between the two curves; tokens/s of each (median step time after warm-up) and fusedmoe's speedup; peak memory
(per implementation on a GPU, ``torch.cuda.max_memory_allocated`` over its own steps with both models and their
optimizer states resident; on the CPU the process's max RSS, one figure for both); fusedmoe's workspace arena.
float32 with the torch backend on the CPU, bfloat16 with the Triton kernels on a GPU.

The verdict (the exit status of ``main``): fusedmoe's loss fell (the mean of its last tenth of the steps at most
``1 - FALL_MARGIN`` of its first loss) and the two curves agree: split into tenths, each tenth's mean loss within
``AGREE_RTOL`` (5 %) of transformers'. The two runs compute the same function from the same weights, so they
start equal; rounding differences between the two experts implementations can grow over hundreds of AdamW steps
(a token's top-k flips, Adam rescales tiny gradient differences), more so in bfloat16, so single steps are not
compared but means over windows, with a tolerance far above what a correct implementation shows and far below
what a wrong one does. Measured on this data with the defaults (CPU): float32 curves equal to ~1e-6 at every
step; bfloat16 single steps within 0.5 %, window means within 0.05 %; even two runs from *different* random
inits keep window means within 0.2 %; negated expert gradients put them 85 % apart. This data is learnt largely
by the embeddings and attention (frozen experts still reach within ~1.2 % of the curve), so the demo shows
training behaviour, not gradient exactness: the tests compare fusedmoe's gradients with transformers' directly.
"""

from __future__ import annotations

import argparse
import copy
import math
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field

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

#: Successors per token in the generated Markov chain: the loss floor is log(BRANCHING).
BRANCHING = 4
#: Defaults of ``demo --train``: about 15 s on 2 CPU cores for both runs together.
STEPS, BATCH, SEQ, LR, LOG_EVERY = 200, 32, 64, 3e-3, 20
#: Window means of the two loss curves agree when within this fraction of transformers' (see the module doc).
AGREE_RTOL = 0.05
#: fusedmoe's loss fell when its last window's mean is at most (1 - FALL_MARGIN) x its first loss.
FALL_MARGIN = 0.1


def build_model(device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-initialised tiny Qwen3-MoE causal LM in training mode (the same weights for the same seed)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**TRAIN_CONFIG))
    return model.to(device=device, dtype=dtype).train()


@dataclass(frozen=True)
class MarkovChain:
    """A Markov chain over token ids in which every token has ``successors.shape[1]`` distinct, equally likely
    successors (``successors[t]``)."""

    successors: torch.Tensor  # [vocab, branching] int64

    @classmethod
    def random(cls, vocab: int, branching: int, seed: int) -> MarkovChain:
        """A chain with ``branching`` distinct successors per token, drawn uniformly; the same for the same seed."""
        gen = torch.Generator().manual_seed(seed)
        return cls(torch.stack([torch.randperm(vocab, generator=gen)[:branching] for _ in range(vocab)]))

    @property
    def entropy(self) -> float:
        """Nats per transition: the least mean cross-entropy a model of the next token can reach."""
        return math.log(self.successors.shape[1])

    def sample(self, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
        """``[batch, seq]`` token ids: each row starts at a uniform token and walks the chain."""
        vocab, branching = self.successors.shape
        ids = torch.empty(batch, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        choice = torch.randint(0, branching, (batch, seq), generator=gen)
        for t in range(1, seq):
            ids[:, t] = self.successors[ids[:, t - 1], choice[:, t]]
        return ids


@dataclass
class _Run:
    """One model in training and what its steps measured."""

    implementation: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    peak_bytes: int = 0  # the CUDA allocator's peak over this run's steps (0 on the CPU)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(run: _Run, ids: torch.Tensor) -> None:
    """One AdamW step of ``run`` on ``ids`` (next-token loss); appends its loss, its wall time and, on a GPU,
    raises ``run.peak_bytes`` to the allocator's peak during the step."""
    device = ids.device
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    loss = run.model(input_ids=ids, labels=ids).loss
    loss.backward()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    _sync(device)
    run.seconds.append(time.perf_counter() - t0)
    run.losses.append(float(loss.detach()))
    if device.type == "cuda":
        run.peak_bytes = max(run.peak_bytes, torch.cuda.max_memory_allocated(device))


def window_size(steps: int) -> int:
    """Steps per window of the curve comparison and of the final loss: a tenth of the run, at least 1."""
    return max(1, steps // 10)


def window_means(losses: list[float], window: int) -> list[float]:
    """Means of consecutive ``window``-step slices of ``losses`` (the last one may be shorter)."""
    return [statistics.fmean(losses[i : i + window]) for i in range(0, len(losses), window)]


def _relative_gap(ours: float, theirs: float) -> float:
    """``|ours - theirs| / |theirs|`` (0 when both are 0, inf when only theirs is)."""
    gap = abs(ours - theirs)
    return gap / abs(theirs) if theirs else (0.0 if gap == 0 else math.inf)


def compare_curves(ours: list[float], theirs: list[float], window: int, rtol: float = AGREE_RTOL) -> dict:
    """How far the loss curve ``ours`` is from ``theirs`` (same length; gaps relative to ``theirs``).

    Returns the largest per-step gap (``max_gap``, ``max_gap_rel``, at ``max_gap_step``), the last step's
    (``final_gap``, ``final_gap_rel``), the largest relative gap between the ``window``-step means
    (``window_gap_rel``) and ``agree``: whether every window mean is within ``rtol`` of theirs."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"curves of {len(ours)} and {len(theirs)} steps: need the same, nonzero length")
    gaps = [abs(a - b) for a, b in zip(ours, theirs)]
    rel = [_relative_gap(a, b) for a, b in zip(ours, theirs)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    window_rel = [_relative_gap(a, b) for a, b in zip(window_means(ours, window), window_means(theirs, window))]
    finite = all(math.isfinite(v) for v in (*ours, *theirs))
    return {
        "max_gap": gaps[worst],
        "max_gap_rel": rel[worst],
        "max_gap_step": worst,
        "final_gap": gaps[-1],
        "final_gap_rel": rel[-1],
        "window_gap_rel": max(window_rel),
        "window": window,
        "rtol": rtol,
        "agree": finite and max(window_rel) <= rtol,
    }


def loss_fell(losses: list[float], window: int, margin: float = FALL_MARGIN) -> bool:
    """Whether the mean of the last ``window`` losses is finite and at most ``(1 - margin)`` x the first loss."""
    final = statistics.fmean(losses[-window:])
    return math.isfinite(final) and final <= (1 - margin) * losses[0]


def _tokens_per_s(seconds: list[float], tokens: int) -> float:
    """``tokens`` over the median step time, the first tenth of the steps (at most 10) excluded as warm-up."""
    warmup = min(10, len(seconds) // 10) or (1 if len(seconds) > 1 else 0)
    return tokens / statistics.median(seconds[warmup:])


def _max_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def _verdict(fell: bool, comparison: dict, ours: str, theirs: str) -> str | None:
    """None when the run passes, else why not."""
    if not fell:
        return f"{ours}'s loss did not fall by {FALL_MARGIN:.0%} (mean of its last {comparison['window']} steps)"
    if not comparison["agree"]:
        return (
            f"{ours}'s loss curve left {theirs}'s: window means differ by up to {comparison['window_gap_rel']:.2%} "
            f"(tolerance {comparison['rtol']:.0%})"
        )
    return None


def run(
    steps: int = STEPS,
    batch: int = BATCH,
    seq: int = SEQ,
    lr: float = LR,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    log_every: int = LOG_EVERY,
    progress=print,
) -> dict:
    """Train the fusedmoe copy and transformers' copy ``steps`` AdamW steps each on the same generated batches,
    in ``dtype`` (default: bfloat16 on a GPU, float32 on the CPU).

    Returns, per implementation (keys ``"fusedmoe"`` and ``"transformers"``): its ``implementation`` name,
    ``losses``, ``step_seconds``, ``tokens_per_s`` and ``peak_mb`` (GPU only, else None); and ``speedup``
    (fusedmoe's tokens/s over transformers'), ``comparison`` (:func:`compare_curves`), ``loss_fell``, ``ok`` and
    ``reason`` (None when ok), ``loss_floor`` (the data's entropy), ``peak_mb`` / ``peak_measure`` (the largest
    per-implementation peak on a GPU, the process's max RSS on the CPU), ``arena_bytes`` / ``plan_peak_bytes``
    (fusedmoe's workspace), and the settings."""
    from ..api import resolve_backend
    from ..integrations import hf

    if steps < 1 or batch < 1 or seq < 2:
        raise ValueError(f"need steps >= 1, batch >= 1 and seq >= 2, got {steps}, {batch}, {seq}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = build_model(device, dtype, seed)
    cfg = model.config
    theirs = cfg._experts_implementation
    reference = copy.deepcopy(model)  # before the switch: transformers' default experts, the same weights
    hf.register()
    model.set_experts_implementation(hf.EXPERTS_IMPLEMENTATION)
    manager = hf.attach_workspace(model)  # one manager for the model's experts, so its arena can be reported
    ours = cfg._experts_implementation
    runs = [_Run(impl, m, torch.optim.AdamW(m.parameters(), lr=lr)) for impl, m in ((ours, model), (theirs, reference))]
    chain = MarkovChain.random(cfg.vocab_size, BRANCHING, seed)
    gen = torch.Generator().manual_seed(seed)

    progress(
        f"model    random Qwen3-MoE: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} "
        f"experts, top-{cfg.num_experts_per_tok}, {dtype}, {device}; experts {ours!r} (backend "
        f"{resolve_backend('auto', device)}) beside transformers' {theirs!r}, same initial weights"
    )
    progress(
        f"data     a fresh batch of {batch} x {seq} tokens per step from a random Markov chain over {cfg.vocab_size} "
        f"tokens, {BRANCHING} successors each: loss floor {chain.entropy:.4f} (log {BRANCHING}), "
        f"{math.log(cfg.vocab_size):.4f} knowing nothing"
    )
    progress(f"train    {steps} AdamW steps each, lr {lr}, steps interleaved")
    for i in range(steps):
        ids = chain.sample(batch, seq, gen).to(device)
        for r in runs if i % 2 == 0 else runs[::-1]:  # alternate which goes first: no order bias in the timing
            _step(r, ids)
        if i % max(1, log_every) == 0 or i == steps - 1:
            a, b = runs[0].losses[-1], runs[1].losses[-1]
            progress(f"step {i:4d}  {ours} {a:.4f}  {theirs} {b:.4f}  gap {abs(a - b):.2e} ({_relative_gap(a, b):.3%})")

    window = window_size(steps)
    comparison = compare_curves(runs[0].losses, runs[1].losses, window)
    fell = loss_fell(runs[0].losses, window)
    reason = _verdict(fell, comparison, ours, theirs)
    per_run = {
        role: {
            "implementation": r.implementation,
            "losses": r.losses,
            "step_seconds": r.seconds,
            "tokens_per_s": _tokens_per_s(r.seconds, batch * seq),
            "peak_mb": r.peak_bytes / 2**20 if device.type == "cuda" else None,
        }
        for role, r in zip(("fusedmoe", "transformers"), runs)
    }
    speedup = per_run["fusedmoe"]["tokens_per_s"] / per_run["transformers"]["tokens_per_s"]
    if device.type == "cuda":
        peak_mb = max(p["peak_mb"] for p in per_run.values())
        peak_what = "torch.cuda.max_memory_allocated over each implementation's own steps"
    else:
        peak_mb, peak_what = _max_rss_mb(), "process max RSS, both runs together"
    s = manager.stats

    for r in runs:
        progress(
            f"loss     {r.implementation:>10}  {r.losses[0]:.4f} -> {r.losses[-1]:.4f} "
            f"(mean of the last {window} steps {statistics.fmean(r.losses[-window:]):.4f}; floor {chain.entropy:.4f})"
        )
    c = comparison
    progress(
        f"gap      largest {c['max_gap']:.2e} ({c['max_gap_rel']:.3%}) at step {c['max_gap_step']}, final "
        f"{c['final_gap']:.2e} ({c['final_gap_rel']:.3%}); means over {window}-step windows within "
        f"{c['window_gap_rel']:.3%} (tolerance {c['rtol']:.0%})"
    )
    progress(
        f"speed    {ours} {per_run['fusedmoe']['tokens_per_s']:.0f} tokens/s, {theirs} "
        f"{per_run['transformers']['tokens_per_s']:.0f} tokens/s: {speedup:.2f}x (median step after warm-up)"
    )
    if device.type == "cuda":
        progress(
            f"memory   peak {ours} {per_run['fusedmoe']['peak_mb']:.1f} MB, {theirs} "
            f"{per_run['transformers']['peak_mb']:.1f} MB ({peak_what})"
        )
    else:
        progress(f"memory   peak {peak_mb:.1f} MB ({peak_what})")
    progress(f"arena    fusedmoe workspace {s.reserved_bytes} B reserved, largest plan {s.peak_bytes} B")
    progress(f"result   {'OK' if reason is None else 'FAILED'}: " + (reason or f"{ours}'s loss fell as {theirs}'s did"))
    return {
        **per_run,
        "speedup": speedup,
        "comparison": comparison,
        "loss_fell": fell,
        "ok": reason is None,
        "reason": reason,
        "loss_floor": chain.entropy,
        "peak_mb": peak_mb,
        "peak_measure": peak_what,
        "arena_bytes": s.reserved_bytes,
        "plan_peak_bytes": s.peak_bytes,
        "steps": steps,
        "batch": batch,
        "seq": seq,
        "lr": lr,
        "device": device.type,
        "dtype": str(dtype),
    }


def main(args: argparse.Namespace) -> int:
    """Run the demo from the command line: exit status 0 when fusedmoe's loss fell and its curve agrees with
    transformers' (see the module doc), else 1 with the reason printed."""
    batch = BATCH if args.batch is None else args.batch
    result = run(steps=args.steps, batch=batch, seq=args.seq, lr=args.lr, log_every=args.log_every)
    return 0 if result["ok"] else 1


def add_arguments(demo: argparse.ArgumentParser) -> None:
    """``demo --train`` and its options; it also reads ``--batch`` (sequences per step, default BATCH with
    --train; generation keeps its default of 1)."""
    demo.add_argument(
        "--train",
        action="store_true",
        help=f"fine-tune a tiny Qwen3-MoE through fusedmoe beside transformers' experts instead "
        f"(--batch: sequences per step, default {BATCH})",
    )
    demo.add_argument("--steps", type=int, default=STEPS, help=f"train: AdamW steps of each run (default {STEPS})")
    demo.add_argument("--seq", type=int, default=SEQ, help=f"train: tokens per sequence (default {SEQ})")
    demo.add_argument("--lr", type=float, default=LR, help=f"train: AdamW learning rate (default {LR})")
    demo.add_argument(
        "--log-every", type=int, default=LOG_EVERY, help=f"train: steps between progress lines (default {LOG_EVERY})"
    )
