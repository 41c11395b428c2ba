"""Time GEMM1 and GEMM2 of one large-M problem alone, under a list of tile configs, on the GPU (#17).

For each preset and M: one routing and alignment (random logits, as the bench), then every config variant of
each GEMM captured 10 times in a CUDA graph and replayed; prints µs per call and TFLOP/s. ``a_sorted`` variants
of GEMM2 read its input rows in aligned order (contiguous blocks) instead of gathered by slot: they time what
the gather costs (their output is not the layer's). Variants that fail to compile or launch print the error.
Usage: python scripts/prefill_sweep.py [--presets qwen3-30b-a3b:16384,mixtral-8x7b:4096] [--json OUT.json]
(dry run of the calls on the CPU interpreter: TRITON_INTERPRET=1 ... --presets "E=4;H=64;I=32;k=2:40" --device cpu)"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402

from fusedmoe.ops.align import moe_align  # noqa: E402
from fusedmoe.ops.configs import GemmConfig, get_config  # noqa: E402
from fusedmoe.ops.grouped_gemm import grid_blocks, moe_gemm1, moe_gemm2  # noqa: E402
from fusedmoe.tools.presets import get_preset  # noqa: E402


def graph_time_us(fn, reps: int = 10, runs: int = 5) -> float:
    """Median over ``runs`` of one CUDA-graph replay of ``reps`` calls, per call."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return sorted(times)[len(times) // 2]


def variants_diag(base: GemmConfig, gated: bool) -> list[tuple[str, GemmConfig, dict]]:
    """The first diagnosis (eaa1dd1): (label, config, extra keywords) around the shipped config."""
    out = [("shipped", base, {}), ("no-tma", replace(base, tma=False), {})]
    for s in (2, 3, 4):
        if s != base.num_stages:
            out.append((f"stages{s}", replace(base, num_stages=s), {}))
    out.append(("group32", replace(base, group_m=32), {}))
    for mode, stages in ((1, 3), (1, 4), (2, 2), (2, 3), (3, 2), (3, 3)):
        out.append((f"persistent{mode}-s{stages}", replace(base, persistent=mode, num_stages=stages), {}))
    out.append(("bk128-s2", replace(base, block_k=128, num_stages=2), {}))
    out.append(("bn/2-w4-s4", replace(base, block_n=base.block_n // 2, num_warps=4, num_stages=4), {}))
    if not gated:
        out.append(("a_sorted", base, {"a_sorted": True}))
    return out


def variants_rules(base: GemmConfig, gated: bool) -> list[tuple[str, GemmConfig, dict]]:
    """The candidates for the tables' rules: GEMM1's interleaved gate-up dot, grouping and persistence."""
    out = [("shipped", base, {}), ("group32", replace(base, group_m=32), {})]
    if gated:
        il = replace(base, interleave=True)
        out += [("interleave", il, {}), ("interleave-no-tma", replace(il, tma=False), {})]
        out += [("interleave-s4", replace(il, num_stages=4), {}), ("interleave-group32", replace(il, group_m=32), {})]
        out += [("interleave-p1-s3", replace(il, persistent=1, num_stages=3), {})]
        out += [("interleave-p2-s3", replace(il, persistent=2, num_stages=3), {})]
        out += [("persistent1-s3", replace(base, persistent=1, num_stages=3), {})]
    else:
        p2 = replace(base, persistent=2, num_stages=3)
        out += [("persistent2-s3", p2, {}), ("persistent2-s3-group32", replace(p2, group_m=32), {})]
        out += [("persistent2-s4", replace(p2, num_stages=4), {}), ("persistent3-s3", replace(p2, persistent=3), {})]
        out += [("persistent1-s3", replace(base, persistent=1, num_stages=3), {}), ("a_sorted", base, {"a_sorted": 1})]
    return out


VARIANTS = {"diag": variants_diag, "rules": variants_rules}


def _run(label, fn, row, dev, eager, flop):
    """Time ``fn`` into ``row`` (printed); a variant that fails to compile or launch is recorded with its error."""
    try:
        us = graph_time_us(fn) if dev == "cuda" and not eager else (fn(), fn(), 1.0)[2]
        row["us"] = us
        rate = f"{flop / us / 1e6:6.1f} TFLOP/s"
        print(f"  {row['gemm']} {label:>22}: {us:9.1f} us  {rate}   {row.get('config', '')}", flush=True)
    except Exception as exc:  # noqa: BLE001 - a variant that does not compile or launch is a result too
        row["error"] = str(exc)[:200]
        print(f"  {row['gemm']} {label:>22}: FAILED {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        if dev == "cuda":
            torch.cuda.synchronize()


def sweep(preset: str, M: int, results: list, dev="cuda", only=None, eager=False, which="diag"):
    if preset.startswith("E="):  # E=..,H=..,I=..,k=.. (a dry run on the CPU interpreter: --device cpu)
        E, H, I, k = (int(v.split("=")[1]) for v in preset.split(";"))
    else:
        spec = get_preset(preset)
        E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    x = torch.randn(M, H, device=dev, dtype=dtype)
    w1 = torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * 0.02
    w2 = torch.randn(E, H, I, device=dev, dtype=dtype) * 0.02
    topk_w, topk_ids = torch.randn(M, E, device=dev).softmax(-1).topk(k, dim=-1)
    topk_ids = topk_ids.to(torch.int32)
    cfg = get_config(M, E, H, I, k)
    sorted_ids, block_expert, _ = moe_align(topk_ids, E, cfg.block_m)
    nb = grid_blocks(M * k, block_expert.numel())
    act = torch.empty(max(M * k, sorted_ids.numel()), I, device=dev, dtype=dtype).normal_()
    y = torch.empty(M * k, H, device=dev, dtype=dtype)
    flop1, flop2 = 2 * M * k * H * 2 * I, 2 * M * k * I * H
    print(f"== {preset} M={M}: E={E} H={H} I={I} k={k}; shipped gemm1 {cfg.gemm1}, gemm2 {cfg.gemm2}", flush=True)
    for gemm, base, flop in (("gemm1", cfg.gemm1, flop1), ("gemm2", cfg.gemm2, flop2)):
        for label, g, extra in VARIANTS[which](base, gemm == "gemm1"):
            if only and label not in only:
                continue
            if gemm == "gemm1":

                def fn(g=g):
                    moe_gemm1(x, w1, act[: M * k], sorted_ids, block_expert, top_k=k, num_blocks=nb, config=g)
            else:

                def fn(g=g, extra=extra):
                    a = act if extra.get("a_sorted") else act[: M * k]
                    moe_gemm2(a, w2, y, sorted_ids, block_expert, num_blocks=nb, config=g, topk_weights=topk_w, **extra)

            row = {"preset": preset, "M": M, "gemm": gemm, "label": label, "config": g.to_dict()}
            _run(label, fn, row, dev, eager, flop=flop)
            results.append(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="qwen3-30b-a3b:16384,mixtral-8x7b:4096")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default=None, help="comma-separated variant labels (default: all)")
    ap.add_argument("--eager", action="store_true", help="two plain calls per variant, untimed (for ncu)")
    ap.add_argument("--set", default="diag", choices=sorted(VARIANTS), help="which variants to time")
    args = ap.parse_args()
    results: list = []
    for item in args.presets.split(","):
        preset, M = item.split(":")
        only = set(args.only.split(",")) if args.only else None
        sweep(preset, int(M), results, args.device, only, args.eager, args.set)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": os.environ.get("FUSEDMOE_COMMIT", "unknown"), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
