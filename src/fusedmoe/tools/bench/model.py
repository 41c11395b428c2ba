"""``fusedmoe bench model``: a transformers MoE model, generated with every experts implementation in one run.

The model is built from its published config (random weights; bf16 on the GPU, at full size unless ``--layers``
bounds its depth; ``--tiny`` shrinks it to 2 layers of small dimensions to exercise the bench on a CPU). For each
mode and batch size, each experts implementation generates ``--prompt`` tokens of prefill plus ``--new`` decode
tokens, greedily. The implementations: transformers' own that are present (``grouped_mm``, ``batched_mm``),
``fusedmoe`` through the experts interface, ``fusedmoe-patch`` (:func:`fusedmoe.integrations.hf.patch_model`)
and, on request, ``fusedmoe-<mode>``: the experts quantized by :func:`fusedmoe.integrations.hf_quant.quantize_experts`
(e.g. ``fusedmoe-fp8_block``, ``fusedmoe-mxfp4``). The modes:

- ``eager`` (the default): ``generate`` with the dynamic cache, no compilation (what most users run first);
- ``compiled``: ``generate`` with ``cache_implementation="static"``, for which transformers compiles the decoding
  forward (``torch.compile``, mode ``reduce-overhead``: CUDA graphs). transformers compiles on accelerators only;
  on a CPU this mode runs the static cache uncompiled.

Whole-model times move by tens of percent between runs, so the implementations are compared within one run and
interleaved: for each (mode, batch), each implementation is warmed up once (in compiled mode this compiles it), then
every repeat switches to each in turn (A B C D, A B C D, ...) and runs one untimed ``generate`` after the switch
(whatever a switch leaves to redo, such as re-recording a CUDA graph, is not timed), then a timed prefill-only run
(``max_new_tokens=1``) and the timed whole ``generate``. Per repeat: prefill ms, and decode ms/token =
``(whole - prefill) / (new - 1)``. Per cell: the median, min and max over the repeats, ``vs best transformers``
(this median over the fastest transformers implementation's median) and token agreement with the first
implementation (random weights make near-ties common, so agreement below 100% after a few tokens is expected and
reported, not hidden). To tell a near-tie from a wrong layer, each cell also compares the next-token logits of its
prompt (one untimed forward after the warm-up) with the first implementation's (``first_logits``): their relative
difference (norm of the difference over the norm of the first's), and the first implementation's median gap between
its top two logits in the same unit (over the norm of its logits row). A relative difference at bf16's rounding
level (~1e-2) with gaps below it makes greedy tokens part ways without any layer being wrong. Each row also gives
its warm-up's seconds (in compiled mode, mostly compilation), counts the graphs torch compiled after the warm-up
(0 unless a switch recompiles) and while timed, and, in compiled mode, says whether CUDA graphs covered the decode
step (``cudagraphs``). ``--profile`` adds, after the repeats, one prefill and one whole ``generate`` per cell under
the torch profiler (untimed): the sum of the step's kernel times beside its wall time says whether the device or the
host sets the pace, and the kernels (on a CPU, operators) that take the most time say where it goes.

One compiled forward keeps each implementation's graphs: transformers reads the experts implementation from the
config at call time and dynamo guards on it (the recompile limit is raised to hold every implementation's graphs),
and ``fusedmoe-patch`` gets the same patched layers back at each switch (a new ``patch_model`` builds new layers,
whose names dynamo's guards check, and would recompile at every switch). ``--isolate`` runs each mode in a process
of its own and merges the rows, so that one mode's compiled state or memory cannot affect the other.

Cost: per (mode, batch) and implementation, 1 + ``repeats`` untimed generates (``new`` tokens in compiled mode, 2 in
eager) and ``repeats`` x (prefill + whole) timed ones, plus, in compiled mode, the compilation of each
implementation at each batch shape. How long these take at full size on a GPU is not established here: the
defaults (eager, batches 1 and 8, 5 repeats) keep compilation out of a default run; measure compiled mode in a
run of its own (``--modes compiled``) or with ``--isolate``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field

import torch

from . import compile_watch, report
from .profile import step_profile

#: Published configs of the presets (Hugging Face config.json of each model), as transformers kwargs.
MODELS: dict[str, tuple[str, dict]] = {
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
    "mixtral-8x7b": (
        "MixtralConfig",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    "deepseek-v2-lite": (
        "DeepseekV2Config",
        dict(
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_shared_experts=2,
            n_routed_experts=64,
            num_experts_per_tok=6,
            first_k_dense_replace=1,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            topk_method="greedy",
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            n_group=1,
            topk_group=1,
        ),
    ),
    "olmoe": (
        "OlmoeConfig",
        dict(
            vocab_size=50304,
            hidden_size=2048,
            intermediate_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_experts=64,
            num_experts_per_tok=8,
        ),
    ),
    "gpt-oss-20b": (
        "GptOssConfig",
        dict(
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            # layer_types: GptOssConfig's default, sliding and full attention alternating from the first layer as
            # published, derived from num_hidden_layers (so that --layers keeps it consistent)
        ),
    ),
}

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)

TRANSFORMERS_IMPLS = ("grouped_mm", "batched_mm")
FUSED = ("fusedmoe", "fusedmoe-patch")
MODES = ("eager", "compiled")
DEFAULT_MODES = ("eager",)
DEFAULT_BATCHES = (1, 8)
DEFAULT_REPEATS = 5
COLUMNS = [
    "impl",
    "mode",
    "batch",
    "prefill ms (median)",
    "prefill min-max",
    "decode ms/token (median)",
    "decode min-max",
    "vs best transformers",
    "token agreement",
    "CUDA graphs",
]
#: Longest cudagraphs verdict in the table (the notes under it and the JSON hold the whole text).
_TABLE_VERDICT_CHARS = 48


def build(preset: str, *, tiny: bool = False, layers: int | None = None, device=None, dtype=torch.bfloat16):
    """A randomly initialised transformers model of ``preset`` (its published config), in eval mode."""
    import transformers

    cls_name, kwargs = MODELS[preset]
    kwargs = dict(kwargs)
    if tiny:
        multi_head = kwargs.get("num_key_value_heads") == kwargs.get("num_attention_heads")  # DeepSeek's MLA
        kwargs.update({k: v for k, v in TINY.items() if k in kwargs or k in ("head_dim",)})
        if multi_head:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        if "moe_intermediate_size" in kwargs:
            kwargs["intermediate_size"] = TINY["intermediate_size"]
        elif cls_name in ("MixtralConfig", "OlmoeConfig", "GptOssConfig"):
            kwargs["intermediate_size"] = TINY["moe_intermediate_size"]
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    config = getattr(transformers, cls_name)(**kwargs)
    with torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def available_impls() -> list[str]:
    """transformers' experts implementations that run here (the default loop "eager" is slow at E=128: opt in),
    then fusedmoe's two ways in."""
    from transformers.integrations.moe import ExpertsInterface

    theirs = [n for n in TRANSFORMERS_IMPLS if n in ExpertsInterface._global_mapping]
    return theirs + list(FUSED)


def _use(model, impl: str, kept: dict):
    """Switch ``model`` to ``impl``; returns the function that switches it back.

    ``kept`` holds what a run keeps from one switch to the next (``fusedmoe-patch``'s patches)."""
    from ...integrations import hf

    if impl == "fusedmoe-patch":
        return _use_patch(model, kept)
    if impl.startswith("fusedmoe-"):  # fusedmoe-<quant mode>: the experts quantized (quantize_experts)
        from ...integrations.hf_quant import dequantize_experts, quantize_experts

        quantize_experts(model, impl[len("fusedmoe-") :], keep_float_weights=True)
        return lambda: dequantize_experts(model)
    if impl == "fusedmoe":
        hf.register()
    model.set_experts_implementation(impl)
    return lambda: None


def _use_patch(model, kept: dict):
    """``patch_model`` the first time; at later switches the same patches (layers, workspace) go back on the same
    blocks. A new ``patch_model`` would build new FusedMoE layers, whose owner keys dynamo's guards compare, and so
    recompile a compiled forward at every switch. Returns the function that takes the patches off (and keeps them)."""
    from ...integrations import hf

    patches = kept.get("fusedmoe-patch")
    if patches is None:
        model.set_experts_implementation("grouped_mm")
        hf.patch_model(model)
    else:
        for block, patch in patches:
            block.__dict__["_fusedmoe"] = patch
            block.__class__ = hf._patched_class(patch.original_class)
        model.set_experts_implementation(hf.EXPERTS_IMPLEMENTATION)

    def undo():
        kept["fusedmoe-patch"] = [(block, block.__dict__["_fusedmoe"]) for block in hf.patched_blocks(model)]
        hf.unpatch_model(model)

    return undo


def _generate(model, ids, mask, new: int, compiled: bool):
    """Greedy ``generate`` of exactly ``new`` tokens (compiled: with the static cache, which transformers compiles)."""
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if compiled:
        kw["cache_implementation"] = "static"
    return model.generate(ids, attention_mask=mask, **kw)


def _timed(fn, device, clock) -> tuple[float, object]:
    """Milliseconds ``fn()`` takes on ``clock`` (seconds), the device synchronized before and after, and its result."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = clock()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (clock() - t0) * 1e3, out


@dataclass
class _Samples:
    """One implementation's timed repeats in one (mode, batch), its last tokens, or why it stopped."""

    warm_up_s: float | None = None
    prefill_ms: list[float] = field(default_factory=list)
    decode_ms: list[float] = field(default_factory=list)
    tokens: torch.Tensor | None = None
    first_logits: torch.Tensor | None = None
    error: str | None = None
    profile: dict | None = None


def run(
    model,
    impls,
    batches,
    modes,
    *,
    prompt: int,
    new: int,
    repeats: int,
    progress=print,
    clock=time.perf_counter,
    profile: bool = False,
) -> list[dict]:
    """One row per (mode, batch, impl) cell, in that order (see the module's docstring for the method).

    Within each (mode, batch) the implementations are switched in (:func:`_use`) in this order: each once for its
    warm-up, then each once per repeat. ``clock`` (seconds) times the runs. A cell whose implementation runs out of
    GPU memory gets a row with the reason under ``error`` and no figures, and the others go on. ``profile``: after
    the repeats, each implementation runs one more prefill and one more whole ``generate`` under the torch
    profiler (:func:`~fusedmoe.tools.bench.profile.step_profile`, in the row's ``profile``), untimed."""
    kept: dict = {}
    rows = []
    # per implementation and batch size: a graph, and a dynamic-shape one where dynamo makes one
    room = 2 * len(impls) * len(batches) if "compiled" in modes else 0
    with compile_watch.room_for_compiled_graphs(room):
        for mode in modes:
            for batch in batches:
                rows += _run_cells(model, impls, mode, batch, prompt, new, repeats, kept, progress, clock, profile)
    _add_vs_best_transformers(rows)
    return rows


def _run_cells(model, impls, mode, batch, prompt, new, repeats, kept, progress, clock, profile=False) -> list[dict]:
    """The rows of one (mode, batch): every implementation warmed up, then ``repeats`` interleaved repeats, then
    (``profile``) one profiled prefill and whole ``generate`` each."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    compiled = mode == "compiled"
    untimed_new = new if compiled else 2  # compiled: every decode step, so CUDA graphs are recorded and replayed
    samples = {impl: _Samples() for impl in impls}
    where = f"{mode} batch {batch}"

    def untimed(impl, watch, phase):
        with watch.during(impl, phase, decode_steps=untimed_new - 1):
            _generate(model, ids, mask, untimed_new, compiled)

    def warm_up(impl, watch):
        start = clock()
        untimed(impl, watch, "warm-up")
        samples[impl].warm_up_s = clock() - start
        samples[impl].first_logits = _next_token_logits(model, ids, mask)
        progress(f"{where}: {impl} warmed up in {samples[impl].warm_up_s:.1f} s")

    def timed(impl, watch):
        # the untimed run takes what a switch leaves to redo; in compiled mode, transformers also makes a new
        # StaticCache at each generate, and where its tensors land at new addresses cudagraph trees re-record
        # (counted while timed: cudagraphs_recorded_while_timed)
        untimed(impl, watch, "untimed")
        with watch.during(impl, "timed"):
            prefill, _ = _timed(lambda: _generate(model, ids, mask, 1, compiled), device, clock)
            whole, out = _timed(lambda: _generate(model, ids, mask, new, compiled), device, clock)
        samples[impl].prefill_ms.append(prefill)
        samples[impl].decode_ms.append((whole - prefill) / max(1, new - 1))
        samples[impl].tokens = out[:, prompt:]

    def profiled(impl, watch):
        # where the time of a step goes (host- or device-bound, which kernels); the profiler's cost is not timed
        # a failure here (out of memory under the profiler) is the profile's, never the timed figures'
        try:
            untimed(impl, watch, "untimed")
            with watch.during(impl, "profiled"):
                samples[impl].profile = {
                    "prefill": step_profile(lambda: _generate(model, ids, mask, 1, compiled), device),
                    "whole": step_profile(lambda: _generate(model, ids, mask, new, compiled), device),
                }
        except torch.OutOfMemoryError as exc:
            samples[impl].profile = {"error": f"out of memory: {str(exc).splitlines()[0][:120]}"}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    with compile_watch.CompileWatch(compiled=compiled, on_cuda=device.type == "cuda") as watch:
        for impl in impls:
            _switched(model, impl, kept, samples[impl], lambda i=impl: warm_up(i, watch), where, progress)
        for r in range(repeats):
            for impl in [i for i in impls if samples[i].error is None]:
                _switched(model, impl, kept, samples[impl], lambda i=impl: timed(i, watch), where, progress)
            done = [f"{i} {s.decode_ms[-1]:.2f}" for i, s in samples.items() if s.error is None and s.decode_ms]
            progress(f"{where} repeat {r + 1}/{repeats}: decode ms/token {', '.join(done)}")
        if profile:
            for impl in [i for i in impls if samples[i].error is None]:
                _switched(model, impl, kept, samples[impl], lambda i=impl: profiled(i, watch), where, progress)
    first = next((s for s in samples.values() if s.tokens is not None), _Samples())
    return [
        _row(impl, mode, batch, samples[impl], first, watch.tallies.get(impl, compile_watch.Tally()), device)
        for impl in impls
    ]


def _next_token_logits(model, ids, mask) -> torch.Tensor:
    """float32 logits (batch, vocab) the model gives the token after ``ids``: one uncompiled forward, untimed."""
    return model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1].float()


def compare_logits(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """How far ``logits`` (batch, vocab) are from ``reference``'s and how close ``reference``'s top two are:
    ``rel_diff`` = ||logits - reference|| / ||reference||; ``top2_gap`` = the median over rows of (top-1 minus
    top-2 logit of ``reference``) / ||that reference row||, in the same unit per row as ``rel_diff``'s;
    ``argmax_differs`` = rows whose greedy token differs."""
    rel_diff = float((logits - reference).norm() / reference.norm().clamp_min(1e-30))
    top2 = reference.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]) / reference.norm(dim=-1).clamp_min(1e-30)
    differs = int((logits.argmax(-1) != reference.argmax(-1)).sum())
    return {"rel_diff": rel_diff, "top2_gap": float(gaps.median()), "argmax_differs": differs, "rows": len(gaps)}


def _switched(model, impl, kept, samples: _Samples, body, where: str, progress) -> None:
    """``body()`` with ``model`` switched to ``impl`` and back; if the GPU runs out of memory (the switch or the
    body), ``samples.error`` says so and the implementation is left out of the rest of its cells."""
    try:
        undo = _use(model, impl, kept)
        try:
            with torch.inference_mode():
                body()
        finally:
            undo()
    except torch.OutOfMemoryError as exc:  # (batched_mm gathers a weight copy per slot) the cell, not the run
        samples.error = f"out of memory: {str(exc).splitlines()[0][:120]}"
        progress(f"{where}: {impl}: {samples.error}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _row(impl, mode, batch, samples: _Samples, first: _Samples, tally: compile_watch.Tally, device) -> dict:
    """The JSON row of one cell: medians (``prefill_ms``, ``decode_ms``) with their min and max, token agreement and
    next-token logits (:func:`compare_logits`, ``first_logits``) against ``first`` (the first implementation that
    ran), every repeat's figures, and what torch compiled and whether CUDA graphs ran (compiled mode)."""
    if samples.error is not None or not samples.decode_ms:
        row = _failed_row(impl, mode, batch, samples.error or "no timed repeat")
    else:
        row = {"impl": impl, "mode": mode, "batch": batch}
        for key, values in (("prefill_ms", samples.prefill_ms), ("decode_ms", samples.decode_ms)):
            row[key], row[f"{key}_min"], row[f"{key}_max"] = statistics.median(values), min(values), max(values)
        row["agreement"] = float((samples.tokens == first.tokens).float().mean())
        if samples.first_logits is not None and first.first_logits is not None:
            row["first_logits"] = compare_logits(samples.first_logits, first.first_logits)
    compiled = mode == "compiled"
    row.update(
        warm_up_s=samples.warm_up_s,
        repeats=len(samples.decode_ms),
        prefill_ms_runs=samples.prefill_ms,
        decode_ms_runs=samples.decode_ms,
        cudagraphs=compile_watch.cudagraph_verdict(device, tally) if compiled else None,
        cudagraph_skip_reasons=tally.reasons if compiled else [],
        cudagraph_replays_per_step=tally.replays_per_step if compiled else None,
        recompiled_after_warm_up=tally.compiled_after_warm_up,
        compiled_while_timed=tally.compiled_while_timed,
        cudagraphs_recorded_while_timed=tally.recorded_while_timed,
    )
    if samples.profile is not None:
        row["profile"] = samples.profile
    return row


def _failed_row(impl: str, mode: str, batch: int, error: str) -> dict:
    """The figures of a cell that could not run (None), with the reason under ``error``."""
    return {"impl": impl, "mode": mode, "batch": batch, "prefill_ms": None, "prefill_ms_min": None,
            "prefill_ms_max": None, "decode_ms": None, "decode_ms_min": None, "decode_ms_max": None,
            "agreement": None, "error": error}  # fmt: skip


def _add_vs_best_transformers(rows: list[dict]) -> None:
    """Set each row's ``vs_best_transformers``: its median decode over the fastest transformers implementation's
    median in the same (mode, batch), None where either is missing."""
    for row in rows:
        best = min(
            (
                r["decode_ms"]
                for r in rows
                if not r["impl"].startswith("fusedmoe")
                and r["mode"] == row["mode"]
                and r["batch"] == row["batch"]
                and r["decode_ms"] is not None
            ),
            default=None,
        )
        row["vs_best_transformers"] = row["decode_ms"] / best if best and row["decode_ms"] is not None else None


def _span(lo, hi) -> str:
    """``lo-hi`` as the table prints numbers, ``-`` without figures."""
    return "-" if lo is None or hi is None else f"{report._fmt(lo)}-{report._fmt(hi)}"


def _short(text: str | None, chars: int = _TABLE_VERDICT_CHARS) -> str | None:
    """``text`` cut to at most ``chars`` characters (ending in "..." where cut); None stays None."""
    return text if text is None or len(text) <= chars else text[: chars - 3] + "..."


def table_rows(rows: list[dict]) -> list[list[object]]:
    """The table's rows (:data:`COLUMNS`) of ``rows``."""
    return [
        [
            r["impl"],
            r["mode"],
            r["batch"],
            r["prefill_ms"],
            _span(r.get("prefill_ms_min"), r.get("prefill_ms_max")),
            r["decode_ms"],
            _span(r.get("decode_ms_min"), r.get("decode_ms_max")),
            r["vs_best_transformers"],
            f"{100 * r['agreement']:.0f}%" if r["agreement"] is not None else r.get("error", "-"),
            _short(r.get("cudagraphs")),
        ]
        for r in rows
    ]


def notes(rows: list[dict]) -> list[str]:
    """Lines to print under the table: each compiled row's whole CUDA graph verdict where the table cuts it, and
    each row for which torch compiled graphs after the warm-up or recorded CUDA graphs while timing."""
    lines = []
    for r in rows:
        cell = f"{r['impl']} {r['mode']} batch {r['batch']}"
        if r.get("cudagraphs") and len(r["cudagraphs"]) > _TABLE_VERDICT_CHARS:
            lines.append(f"{cell}: CUDA graphs {r['cudagraphs']}")
        if r.get("recompiled_after_warm_up"):
            lines.append(
                f"{cell}: {r['recompiled_after_warm_up']} graph(s) compiled after the warm-up "
                f"({r.get('compiled_while_timed', 0)} while timed)"
            )
        if r.get("cudagraphs_recorded_while_timed"):
            lines.append(f"{cell}: {r['cudagraphs_recorded_while_timed']} CUDA graph(s) recorded while timed")
        if r.get("first_logits", {}).get("argmax_differs"):
            d = r["first_logits"]
            lines.append(
                f"{cell}: next token differs in {d['argmax_differs']} of {d['rows']} rows; logits {d['rel_diff']:.1e} "
                f"apart (relative), the first implementation's top two {d['top2_gap']:.1e} apart (median)"
            )
        if (r.get("profile") or {}).get("error"):
            lines.append(f"{cell} profile: {r['profile']['error']}")
        for phase, p in (r.get("profile") or {}).items():
            if phase == "error":
                continue
            busy = "" if p["device_ms"] is None else f", kernels {p['device_ms']:.1f} ms ({p['kernels']} launches)"
            top = "; ".join(f"{t['name'][:40]} {t['ms']:.2f} ms x{t['calls']}" for t in p["top"][:3])
            lines.append(f"{cell} profiled {phase}: {p['wall_ms']:.1f} ms{busy}; most: {top}")
    return lines


def plot(rows: list[dict], path: str, title: str) -> None:
    """Bars of median decode ms/token per (mode, batch), one per implementation, with min-max error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["mode"], r["batch"]) for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        found = [next((r for r in rows if r["impl"] == impl and (r["mode"], r["batch"]) == c), None) for c in cells]
        ys = [(r or {}).get("decode_ms") or 0 for r in found]
        lows = [y - ((r or {}).get("decode_ms_min") or y) for y, r in zip(ys, found)]
        highs = [((r or {}).get("decode_ms_max") or y) - y for y, r in zip(ys, found)]
        ax.bar([i + j * width for i in range(len(cells))], ys, width, label=impl, yerr=[lows, highs], capsize=2)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))], [f"{m}\nbatch {b}" for m, b in cells])
    ax.set_ylabel("decode ms / token (median, min-max)")
    ax.set_title(textwrap.fill(title, 90), fontsize="medium")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def _child_argv(args, preset: str, mode: str, repeats: int, json_path: str) -> list[str]:
    """The command line of ``bench model`` for one ``mode`` in a process of its own, writing ``json_path``."""
    argv = [sys.executable, "-m", "fusedmoe", "bench", "model", "--preset", preset, "--modes", mode]
    argv += ["--prompt", str(args.prompt), "--new", str(args.new), "--repeats", str(repeats), "--json", json_path]
    for flag in ("tiny", "cpu", "profile"):
        if getattr(args, flag, False):
            argv.append(f"--{flag}")
    for option in ("layers", "impls", "batches"):
        if getattr(args, option, None) is not None:
            argv += [f"--{option}", str(getattr(args, option))]
    return argv


def _run_child(argv: list[str], mode: str) -> None:
    """Run ``argv`` (its stdout shown as it goes, its stderr after it); if it fails, SystemExit with its exit
    status and the tail of its stderr."""
    proc = subprocess.run(argv, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-20:])
        raise SystemExit(f"bench model --modes {mode} (a process of its own) exited with {proc.returncode}:\n{tail}")
    sys.stderr.write(proc.stderr)


def _run_isolated(args, preset: str, modes: list[str], repeats: int) -> dict:
    """Each mode in a fresh ``python -m fusedmoe bench model`` process; the first one's result, with the rows of
    all in ``modes`` order."""
    results = []
    with tempfile.TemporaryDirectory(prefix="fusedmoe-bench-model-") as folder:
        for mode in modes:
            path = os.path.join(folder, f"{mode}.json")
            _run_child(_child_argv(args, preset, mode, repeats, path), mode)
            with open(path) as f:
                results.append(json.load(f))
    merged = {key: value for key, value in results[0].items() if key != "env"}
    merged["rows"] = [row for result in results for row in result["rows"]]
    merged["isolated"] = True
    return merged


def _run_here(args, preset: str, modes: list[str], repeats: int) -> dict:
    """Build the model and run every mode in this process."""
    on_gpu = torch.cuda.is_available() and not args.cpu
    tiny = args.tiny or not on_gpu
    model = build(
        preset,
        tiny=tiny,
        layers=args.layers,
        device="cuda" if on_gpu else "cpu",
        dtype=torch.bfloat16 if on_gpu else torch.float32,
    )
    impls = args.impls.split(",") if args.impls else available_impls()
    batches = [int(b) for b in args.batches.split(",")] if args.batches else list(DEFAULT_BATCHES)
    rows = run(model, impls, batches, modes, prompt=args.prompt, new=args.new, repeats=repeats, profile=args.profile)
    return {"preset": preset, "tiny": tiny, "layers": model.config.num_hidden_layers, "isolated": False, "rows": rows}


def main(args) -> int:
    """``fusedmoe bench model``: run (here, or one process per mode with ``--isolate``), print the table and its
    notes, write the JSON and the plot asked for."""
    preset = args.preset or "qwen3-30b-a3b"
    if preset not in MODELS:
        raise SystemExit(f"--preset must be one of {sorted(MODELS)} for bench model, got {preset!r}")
    modes = args.modes.split(",") if args.modes else list(DEFAULT_MODES)
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes must be a comma-separated subset of {','.join(MODES)}, got {args.modes!r}")
    repeats = args.repeats or DEFAULT_REPEATS
    runner = _run_isolated if getattr(args, "isolate", False) else _run_here
    result = runner(args, preset, modes, repeats)
    rows = result["rows"]
    size = "tiny" if result["tiny"] else "full size"
    title = (
        f"{preset} ({size}, {result['layers']} layers): generate {args.prompt} + {args.new} tokens, "
        f"{repeats} interleaved repeats" + (", one process per mode" if result["isolated"] else "")
    )
    report.print_table(title, COLUMNS, table_rows(rows))
    for line in notes(rows):
        print(line)
    if args.json:
        payload = {"env": report.environment(), **result, "prompt": args.prompt, "new": args.new, "repeats": repeats}
        report.save_json(args.json, payload)
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot, title)
    return 0
