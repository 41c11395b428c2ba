"""``fusedmoe bench model``: a transformers MoE model, generated with every experts implementation in one run.

The model is built at its full published size from its config (random weights, bf16 on the GPU), then for each
experts implementation (transformers' own that are present, ``fusedmoe`` through the experts interface, and
``fusedmoe-patch`` = :func:`fusedmoe.integrations.hf.patch_model`; on request ``fusedmoe-<mode>``, the experts
quantized by :func:`fusedmoe.integrations.hf_quant.quantize_experts`, e.g. ``fusedmoe-fp8_block``,
``fusedmoe-mxfp4``) and each batch size it generates
``--prompt`` tokens of prefill plus ``--new`` decode tokens, greedily:

- ``eager``: ``generate`` with the dynamic cache, no compilation (what most users run first);
- ``compiled``: ``generate`` with ``cache_implementation="static"``, which makes transformers compile the
  decoding forward (``torch.compile``); the first, compiling run is not timed.

Per cell: prefill ms (a ``max_new_tokens=1`` run), decode ms/token (``(full - prefill) / (new - 1)``), the
median of ``--repeats`` runs, and token agreement with the first implementation (random weights make
near-ties common, so agreement below 100% after a few tokens is expected and reported, not hidden).
``--tiny`` shrinks the model (2 layers, small dims) to exercise the bench on a CPU.
"""

from __future__ import annotations

import statistics
import time

import torch

from . import report

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

FUSED = ("fusedmoe", "fusedmoe-patch")
COLUMNS = ["impl", "mode", "batch", "prefill ms", "decode ms/token", "vs best transformers", "token agreement"]


def build(preset: str, *, tiny: bool = False, layers: int | None = None, device=None, dtype=torch.bfloat16):
    """A randomly initialised transformers model of ``preset`` (its published config)."""
    import transformers

    cls_name, kwargs = MODELS[preset]
    kwargs = dict(kwargs)
    if tiny:
        kwargs.update({k: v for k, v in TINY.items() if k in kwargs or k in ("head_dim",)})
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

    theirs = [n for n in ("grouped_mm", "batched_mm") if n in ExpertsInterface._global_mapping]
    return theirs + list(FUSED)


def _use(model, impl: str):
    """Switch ``model`` to ``impl``; returns the function that undoes it."""
    from ...integrations import hf

    if impl == "fusedmoe-patch":
        model.set_experts_implementation("grouped_mm")
        hf.patch_model(model)
        return lambda: hf.unpatch_model(model)
    if impl.startswith("fusedmoe-"):  # fusedmoe-<quant mode>: the experts quantized (quantize_experts)
        from ...integrations.hf_quant import dequantize_experts, quantize_experts

        quantize_experts(model, impl[len("fusedmoe-") :], keep_float_weights=True)
        return lambda: dequantize_experts(model)
    if impl == "fusedmoe":
        hf.register()
    model.set_experts_implementation(impl)
    return lambda: None


def _generate(model, ids, mask, new: int, compiled: bool):
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if compiled:
        kw["cache_implementation"] = "static"
    return model.generate(ids, attention_mask=mask, **kw)


def _timed(fn, device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, out


def run(model, impls, batches, modes, *, prompt: int, new: int, repeats: int, progress=print) -> list[dict]:
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    rows = []
    reference: dict[tuple, torch.Tensor] = {}
    cells = [(m, b, i) for m in modes for b in batches for i in impls]
    for n, (mode, batch, impl) in enumerate(cells, 1):
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(1, vocab, (batch, prompt), generator=g).to(device)
        mask = torch.ones_like(ids)
        undo = _use(model, impl)
        try:
            with torch.inference_mode():
                compiled = mode == "compiled"
                _generate(model, ids, mask, 2, compiled)  # warm-up (kernels, tables, compilation)
                if compiled:
                    _generate(model, ids, mask, new, compiled)
                pre, full, out = [], [], None
                prefill_only = lambda a=ids, m=mask, c=compiled: _generate(model, a, m, 1, c)  # noqa: E731
                whole = lambda a=ids, m=mask, c=compiled: _generate(model, a, m, new, c)  # noqa: E731
                for _ in range(repeats):
                    pre.append(_timed(prefill_only, device)[0])
                    ms, out = _timed(whole, device)
                    full.append(ms)
        except torch.OutOfMemoryError as exc:  # (batched_mm gathers a weight copy per slot) the cell, not the run
            rows.append(_failed_row(impl, mode, batch, f"out of memory: {str(exc).splitlines()[0][:120]}"))
            progress(f"[{n}/{len(cells)}] {impl} {mode} batch {batch}: {rows[-1]['error']}")
            torch.cuda.empty_cache()
            continue
        finally:
            undo()
        tokens = out[:, prompt:]
        ref = reference.setdefault((mode, batch), tokens)
        prefill = statistics.median(pre)
        decode = (statistics.median(full) - prefill) / max(1, new - 1)
        rows.append(
            {
                "impl": impl,
                "mode": mode,
                "batch": batch,
                "prefill_ms": prefill,
                "decode_ms": decode,
                "agreement": float((tokens == ref).float().mean()),
            }
        )
        progress(
            f"[{n}/{len(cells)}] {impl} {mode} batch {batch}: prefill {prefill:.1f} ms, decode {decode:.2f} ms/token"
        )
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
    return rows


def _failed_row(impl: str, mode: str, batch: int, error: str) -> dict:
    """The row of a cell that could not run (its times None, the reason under ``error``)."""
    return {"impl": impl, "mode": mode, "batch": batch, "prefill_ms": None, "decode_ms": None, "agreement": None,
            "error": error}  # fmt: skip


def table_rows(rows: list[dict]) -> list[list[object]]:
    return [
        [
            r["impl"],
            r["mode"],
            r["batch"],
            r["prefill_ms"],
            r["decode_ms"],
            r["vs_best_transformers"],
            f"{100 * r['agreement']:.0f}%" if r["agreement"] is not None else r.get("error", "-"),
        ]
        for r in rows
    ]


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["mode"], r["batch"]) for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        ys = [
            next((r["decode_ms"] or 0 for r in rows if r["impl"] == impl and (r["mode"], r["batch"]) == c), 0)
            for c in cells
        ]
        ax.bar([i + j * width for i in range(len(cells))], ys, width, label=impl)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))], [f"{m}\nbatch {b}" for m, b in cells])
    ax.set_ylabel("decode ms / token")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(args) -> int:
    preset = args.preset or "qwen3-30b-a3b"
    if preset not in MODELS:
        raise SystemExit(f"--preset must be one of {sorted(MODELS)} for bench model, got {preset!r}")
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
    modes = args.modes.split(",") if args.modes else ["eager", "compiled"]
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [1, 8]
    rows = run(model, impls, batches, modes, prompt=args.prompt, new=args.new, repeats=args.repeats or 3)
    size = "tiny" if tiny else "full size"
    title = f"{preset} ({size}, {model.config.num_hidden_layers} layers): generate {args.prompt} + {args.new} tokens"
    report.print_table(title, COLUMNS, table_rows(rows))
    if args.json:
        report.save_json(
            args.json,
            {
                "env": report.environment(),
                "preset": preset,
                "tiny": tiny,
                "layers": model.config.num_hidden_layers,
                "rows": rows,
            },
        )
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot, title)
    return 0
