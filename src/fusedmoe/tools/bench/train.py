"""``fusedmoe bench train``: forward + backward of one MoE layer, per system, side by side in one run.

For each shape (a preset's E, k, H, I) and token count M, every system computes the layer on the same inputs
(bf16 on the GPU) and the gradients of a fixed random output gradient with respect to the hidden states x,
both weights w1 [E, 2I, H] and w2 [E, H, I], and the routing weights (``torch.autograd.grad``; nothing
accumulates between repeats):

- ``fusedmoe``: :func:`fusedmoe.fused_moe` on leaves that require grad (the Triton forward and backward on a
  GPU, the torch backend on the CPU), its scratch from the device's shared workspace manager;
- ``grouped_mm`` / ``eager``: transformers' experts module of the preset's model class (e.g.
  ``Qwen3MoeExperts``, taken from the model built on the meta device from its published config, holding our
  weight tensors as its parameters) under that experts implementation;
- ``liger``: Liger-Kernel's Triton fused MoE (``liger_kernel.ops.LigerFusedMoEFunction``), when
  ``liger_kernel`` is importable (and a GPU, or the Triton interpreter, runs its kernels);
- ``floor``: 3x the forward FLOPs (``2·M·k·H·3I`` per forward) at the bf16 matmul rate measured at the start of
  the run.

Per row: ms per forward + backward (median of CUDA-event-timed repeats after warm-up; eager timing, since
several systems synchronize with the host inside a step), % of peak (floor / time), peak memory above what was
allocated before the step (torch.cuda.max_memory_allocated after a reset: intermediates plus the gradients
themselves, ``grads MB``; for fusedmoe plus its workspace arena, which the shared manager holds across calls:
``arena MB`` is the arena reserved, ``plan MB`` the largest plan it served; ``w/o arena`` is the peak without
it, what the step allocates beyond the arena), and the relative error of each
gradient against grouped_mm's and eager's (``||a - b|| / ||b||``).

Without a GPU (or with ``--tiny``) every shape keeps its E and k with H=64, I=32 (transformers' tiny model
dims of ``bench model``) at M=64, float32 on the CPU (bf16 with ``--tiny`` on a GPU).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...reference import relative_error
from ...routing import route
from ...workspace.manager import default_manager
from ..presets import get_preset
from . import report
from .floors import _median_ms, measure_ceilings

SHAPES = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite")
IMPLS = ("fusedmoe", "grouped_mm", "eager", "liger")
#: Gradient references, computed first so every system is compared with them.
REFERENCES = ("grouped_mm", "eager")
TOKENS = (1024, 4096, 16384)
TINY_TOKENS = (64,)
#: Hidden and expert intermediate size of the tiny shapes (bench model's TINY: hidden_size, moe_intermediate_size).
TINY_H, TINY_I = 64, 32
GRADS = ("x", "w1", "w2", "topk_weights")
MB = 1 << 20
COLUMNS = [
    "shape",
    "M",
    "system",
    "ms fwd+bwd",
    "% of peak",
    "peak MB",
    "w/o arena",
    "grads MB",
    "arena MB",
    "max grad err (vs)",
    "note",
]


@dataclass(frozen=True)
class Shape:
    name: str
    num_experts: int
    top_k: int
    hidden: int
    inter: int
    routing: dict
    tiny: bool

    def forward_flops(self, tokens: int) -> int:
        return 2 * tokens * self.top_k * self.hidden * 3 * self.inter


def shape_of(name: str, tiny: bool) -> Shape:
    p = get_preset(name)
    H, inter = (TINY_H, TINY_I) if tiny else (p.hidden_size, p.intermediate_size)
    return Shape(name, p.num_experts, p.top_k, H, inter, dict(p.routing), tiny)


# ---- inputs --------------------------------------------------------------------------------------------------
@dataclass
class Inputs:
    x: torch.Tensor  # [M, H] leaf, requires grad
    w1: torch.nn.Parameter  # [E, 2I, H]
    w2: torch.nn.Parameter  # [E, H, I]
    topk_weights: torch.Tensor  # [M, k] leaf in the activation dtype, requires grad
    topk_ids: torch.Tensor  # [M, k] int64
    grad_out: torch.Tensor  # [M, H]

    @property
    def leaves(self) -> tuple[torch.Tensor, ...]:
        return (self.x, self.w1, self.w2, self.topk_weights)


def make_weights(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Unit-scale random weights (outputs of order 1) as Parameters, shared by every system."""
    g = torch.Generator(device=device).manual_seed(seed)
    E, H, inter = shape.num_experts, shape.hidden, shape.inter
    w1 = torch.randn(E, 2 * inter, H, device=device, dtype=dtype, generator=g).mul_(H**-0.5)
    w2 = torch.randn(E, H, inter, device=device, dtype=dtype, generator=g).mul_(inter**-0.5)
    return torch.nn.Parameter(w1), torch.nn.Parameter(w2)


def make_inputs(shape: Shape, tokens: int, w1, w2, seed: int = 0) -> Inputs:
    device, dtype = w1.device, w1.dtype
    g = torch.Generator(device=device).manual_seed(seed + tokens)
    x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype, generator=g)
    logits = torch.randn(tokens, shape.num_experts, device=device, dtype=torch.float32, generator=g)
    weights, ids = route(logits, shape.top_k, **shape.routing)
    grad_out = torch.randn(tokens, shape.hidden, device=device, dtype=dtype, generator=g)
    return Inputs(
        x.requires_grad_(True),
        w1,
        w2,
        weights.to(dtype).requires_grad_(True),
        ids.long(),
        grad_out,
    )


# ---- systems -------------------------------------------------------------------------------------------------
def transformers_experts(shape: Shape, w1: torch.nn.Parameter, w2: torch.nn.Parameter):
    """The preset model's own transformers experts module (built on the meta device from its published config,
    as ``bench model`` builds the model) holding ``w1`` / ``w2`` as its parameters; None without transformers.

    Select an implementation with ``module.config._experts_implementation = "grouped_mm"`` (or "eager")."""
    try:
        from .model import build
    except ImportError:  # pragma: no cover
        return None
    try:
        model = build(shape.name, tiny=shape.tiny, layers=2, device="meta", dtype=w1.dtype)
    except ImportError:
        return None
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj"))
    want = (tuple(w1.shape), tuple(w2.shape))
    have = (tuple(experts.gate_up_proj.shape), tuple(experts.down_proj.shape))
    if have != want:
        raise ValueError(f"{type(experts).__name__} of {shape.name} holds {have}, the bench's weights are {want}")
    experts.gate_up_proj = w1
    experts.down_proj = w2
    return experts


def liger_function():
    """Liger-Kernel's fused MoE autograd Function, or (None, why not)."""
    try:
        from liger_kernel.ops import LigerFusedMoEFunction
    except ImportError as err:
        return None, f"liger_kernel not installed (docs/training.md) [{err}]"
    return LigerFusedMoEFunction, None


def forward_fn(impl: str, inp: Inputs, shape: Shape, experts, backend: str) -> tuple[Callable | None, str | None]:
    """(the system's forward on ``inp`` returning [M, H], None) or (None, why it cannot run here)."""
    if impl == "fusedmoe":
        from ...api import fused_moe

        return lambda: fused_moe(inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids, backend=backend), None
    if impl in ("grouped_mm", "eager"):
        if experts is None:
            return None, "transformers not installed"
        if impl == "grouped_mm":
            from transformers.integrations.moe import ExpertsInterface

            if "grouped_mm" not in ExpertsInterface._global_mapping:
                return None, "this transformers has no grouped_mm experts implementation"

        def run() -> torch.Tensor:
            experts.config._experts_implementation = impl
            return experts(inp.x, inp.topk_ids, inp.topk_weights)

        return run, None
    if impl == "liger":
        fn, why = liger_function()
        if fn is None:
            return None, why
        if inp.x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return None, "needs a CUDA GPU (or TRITON_INTERPRET=1)"
        ids32 = inp.topk_ids.to(torch.int32)
        return lambda: fn.apply(inp.x, inp.w1, inp.w2, ids32, inp.topk_weights), None
    raise ValueError(f"unknown system {impl!r}; choose from {IMPLS}")


def step_fn(forward: Callable[[], torch.Tensor], inp: Inputs) -> Callable[[], tuple[torch.Tensor, ...]]:
    """One forward + backward: the gradients of ``<out, grad_out>`` for x, w1, w2 and the routing weights."""

    def step():
        out = forward()
        return torch.autograd.grad(out, inp.leaves, inp.grad_out)

    return step


# ---- measuring -----------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(step: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median ms of one step: CUDA events on a GPU (after floors' 3 warm-up calls), wall time on the CPU."""
    if device.type == "cuda":
        return _median_ms(step, iters=repeats)
    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_mb(step: Callable[[], tuple[torch.Tensor, ...]], device: torch.device) -> tuple[float | None, float]:
    """(MB allocated at the peak of one step above what was allocated before it, gradients included; MB of
    the gradients). The peak is None on the CPU (no allocator statistics there)."""
    if device.type != "cuda":
        grads = step()
        return None, sum(g.numel() * g.element_size() for g in grads) / MB
    gc.collect()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    grads = step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    del grads
    return peak / MB, grad_bytes / MB


def _errors(grads, out, ref) -> dict[str, float]:
    errs = {"out": relative_error(out, ref["out"])}
    errs.update({n: relative_error(g, r) for n, g, r in zip(GRADS, grads, ref["grads"])})
    return errs


def measure(
    impl: str,
    shape: Shape,
    inp: Inputs,
    experts,
    *,
    backend: str,
    repeats: int,
    floor_ms: float,
    references: dict,
) -> dict:
    """One row: time, memory and gradient errors of ``impl``; a row with a note when it cannot run."""
    device = inp.x.device
    M = inp.x.shape[0]
    row: dict = {
        "shape": shape.name,
        "E": shape.num_experts,
        "k": shape.top_k,
        "H": shape.hidden,
        "I": shape.inter,
        "tokens": M,
        "impl": impl,
        "ms": None,
        "pct_of_peak": None,
        "floor_ms": floor_ms,
        "peak_mb": None,
        "peak_mb_without_arena": None,
        "grads_mb": None,
        "arena_mb": None,
        "plan_mb": None,
        "rel_err": {},
        "note": None,
    }
    forward, why = forward_fn(impl, inp, shape, experts, backend)
    if forward is None:
        row["note"] = why
        return row
    manager = default_manager(device) if impl == "fusedmoe" else None
    if manager is not None:  # this shape's arena alone, not one grown by an earlier, larger shape
        manager.release()
        manager.stats.peak_bytes = 0
    step = step_fn(forward, inp)
    try:
        with torch.enable_grad():
            out = forward()
            grads = torch.autograd.grad(out, inp.leaves, inp.grad_out)
            out = out.detach()
            for ref_impl, ref in references.items():
                if ref_impl != impl:
                    row["rel_err"][ref_impl] = _errors(grads, out, ref)
            if impl in REFERENCES:
                references[impl] = {"out": out, "grads": grads}
            del out, grads
            row["ms"] = time_ms(step, device, repeats)
            reserved = manager.stats.reserved_bytes if manager is not None else 0
            row["peak_mb"], row["grads_mb"] = peak_mb(step, device)
            row["peak_mb_without_arena"] = row["peak_mb"]
            if manager is not None:
                grown = manager.stats.reserved_bytes - reserved
                row["arena_mb"] = manager.stats.reserved_bytes / MB
                row["plan_mb"] = manager.stats.peak_bytes / MB
                if row["peak_mb"] is not None:  # the arena, held before the step, is the step's scratch
                    row["peak_mb_without_arena"] = row["peak_mb"]
                    row["peak_mb"] += reserved / MB
                if grown:
                    row["note"] = f"arena grew by {grown} B during the measured step"
    except Exception as err:  # one system failing (out of memory, unsupported) leaves the others' rows
        row["ms"] = None
        row["note"] = f"failed: {type(err).__name__}: {err}"[:300]
    finally:
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
    if row["ms"]:
        row["pct_of_peak"] = 100.0 * floor_ms / row["ms"]
    return row


def cpu_matmul_tflops(dtype: torch.dtype = torch.float32, n: int = 512, repeats: int = 5) -> float:
    """The CPU's matmul rate on an n^3 product (the CPU run's compute floor)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times) / 1e12


def run(
    shapes: list[str],
    tokens: list[int],
    impls: list[str],
    *,
    device: torch.device,
    dtype: torch.dtype,
    tiny: bool,
    repeats: int,
    peak_tflops: float,
    backend: str | None = None,
    progress: Callable[[str], None] = print,
    checkpoint: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Every (shape, M, system) row, systems in the order asked, then the floor row. ``backend`` is fusedmoe's
    (default: "auto" on a GPU, "torch" on the CPU; "triton" there runs its kernels under TRITON_INTERPRET=1).
    ``checkpoint`` gets the rows so far after each (shape, M), so a run cut short keeps what it measured."""
    backend = backend or ("auto" if device.type == "cuda" else "torch")
    order = [i for i in REFERENCES if i in impls] + [i for i in impls if i not in REFERENCES]
    rows = []
    started = time.perf_counter()
    for name in shapes:
        shape = shape_of(name, tiny)
        w1, w2 = make_weights(shape, device, dtype)
        experts = transformers_experts(shape, w1, w2) if {"grouped_mm", "eager"} & set(impls) else None
        for M in tokens:
            inp = make_inputs(shape, M, w1, w2)
            floor_ms = 3 * shape.forward_flops(M) / (peak_tflops * 1e12) * 1e3
            references: dict = {}
            measured = {}
            for impl in order:
                row = measure(
                    impl,
                    shape,
                    inp,
                    experts,
                    backend=backend,
                    repeats=repeats,
                    floor_ms=floor_ms,
                    references=references,
                )
                measured[impl] = row
                ms = f"{row['ms']:.3f} ms" if row["ms"] else row["note"]
                peak = f", peak {row['peak_mb']:.0f} MB" if row.get("peak_mb") else ""
                progress(f"{name} M={M} {impl}: {ms}{peak} ({time.perf_counter() - started:.0f} s into the run)")
            if len(references) == 2:  # the first reference against the second, too
                first, second = (references[r] for r in REFERENCES)
                measured[REFERENCES[0]]["rel_err"][REFERENCES[1]] = _errors(first["grads"], first["out"], second)
            rows.extend(measured[i] for i in impls)
            rows.append(
                {
                    "shape": name,
                    "E": shape.num_experts,
                    "k": shape.top_k,
                    "H": shape.hidden,
                    "I": shape.inter,
                    "tokens": M,
                    "impl": "floor",
                    "ms": floor_ms,
                    "pct_of_peak": 100.0,
                    "floor_ms": floor_ms,
                    "note": f"3 x 2*M*k*H*3I FLOPs at {peak_tflops:.3g} TFLOP/s",
                }
            )
            del references, inp
            if checkpoint is not None:
                checkpoint(rows)
        del experts, w1, w2
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def _max_err(row: dict) -> str | None:
    """The largest gradient error of ``row`` against grouped_mm (else eager), with the reference's name."""
    errs = row.get("rel_err") or {}
    ref = next((r for r in REFERENCES if r in errs), None)
    if ref is None:
        return None
    return f"{max(errs[ref][g] for g in GRADS):.1e} ({ref})"


def table_rows(rows: list[dict]) -> list[list[object]]:
    return [
        [
            r["shape"],
            r["tokens"],
            r["impl"],
            r["ms"],
            None if r["pct_of_peak"] is None else f"{r['pct_of_peak']:.0f}%",
            r.get("peak_mb"),
            r.get("peak_mb_without_arena"),
            r.get("grads_mb"),
            r.get("arena_mb"),
            _max_err(r),
            r.get("note") or "",
        ]
        for r in rows
    ]


def print_cross_check(rows: list[dict]) -> None:
    """fusedmoe's gradients against each reference, one line per (shape, M)."""
    print("correctness: relative error ||a - b|| / ||b|| of fusedmoe vs each reference (output, then gradients)")
    for r in rows:
        if r["impl"] != "fusedmoe":
            continue
        for ref, errs in r.get("rel_err", {}).items():
            parts = "  ".join(f"{n} {errs[n]:.2e}" for n in ("out", *GRADS))
            print(f"  {r['shape']} M={r['tokens']} fusedmoe vs {ref}: {parts}")


def _list(text: str | None, default, allowed=None) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()] if text else list(default)
    if allowed is not None:
        bad = [t for t in items if t not in allowed]
        if bad:
            raise SystemExit(f"unknown {bad}; choose from {sorted(allowed)}")
    return items


def main(args: argparse.Namespace) -> int:
    on_gpu = torch.cuda.is_available() and not args.cpu
    tiny = args.tiny or not on_gpu
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    from ..presets import PRESETS

    shapes = _list(getattr(args, "shapes", None), SHAPES, PRESETS)
    impls = _list(args.impls, IMPLS, IMPLS)
    tokens = args.tokens or list(TINY_TOKENS if tiny else TOKENS)
    repeats = args.repeats or (3 if not on_gpu else 20)
    env = report.environment()
    print(f"{env.get('gpu') or 'CPU'} | torch {env['torch']} | triton {env.get('triton')} | commit {env.get('commit')}")
    ceilings = None
    if on_gpu:
        ceilings = measure_ceilings(device)
        peak = ceilings.bf16_tflops
        print(f"bf16 matmul peak (8192^3, measured now): {peak:.0f} TFLOP/s")
    else:
        peak = cpu_matmul_tflops(dtype)
        print(f"CPU run ({dtype}): matmul rate {peak * 1e3:.1f} GFLOP/s")
    backend = args.backends or ("auto" if on_gpu else "torch")
    sizes = "tiny: H=64, I=32" if tiny else "published sizes"
    print(f"shapes {shapes} ({sizes}), tokens {tokens}, {dtype}, fusedmoe backend {backend}")

    def save(rows: list[dict]) -> None:
        if not args.json:
            return
        payload = {"env": env, "device": device.type, "dtype": str(dtype), "tiny": tiny, "repeats": repeats}
        payload |= {"peak_tflops": peak, "ceilings": ceilings.as_dict() if ceilings is not None else None}
        payload |= {"backend": backend, "shapes": shapes, "tokens": tokens, "impls": impls, "rows": rows}
        report.save_json(args.json, payload)

    rows = run(
        shapes,
        tokens,
        impls,
        device=device,
        dtype=dtype,
        tiny=tiny,
        repeats=repeats,
        peak_tflops=peak,
        backend=backend,
        checkpoint=save,
    )
    where = f"{dtype}, {device.type}{', tiny' if tiny else ''}"
    title = f"MoE layer forward + backward ({where}), gradients of x, w1, w2 and the routing weights"
    report.print_table(title, COLUMNS, table_rows(rows))
    print_cross_check(rows)
    if args.json:
        save(rows)
        print(f"wrote {args.json}")
    return 0


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """The ``bench train`` options that the other modes do not have (it also reads --tokens, --impls,
    --repeats, --tiny, --cpu, --json and --backends, fusedmoe's backend)."""
    bench.add_argument(
        "--shapes",
        default=None,
        help=f"train: comma-separated presets (default {','.join(SHAPES)}); train --impls from {','.join(IMPLS)}",
    )
    bench.add_argument(
        "--ep",
        default=None,
        help="train: comma-separated world sizes: time an expert-parallel training step (gloo, CPU, the tiny "
        "shapes, --tokens rows per rank) beside one process on the same rows, instead of the systems table",
    )
