"""``fusedmoe tune``: search GEMM block configs for one model preset on this GPU and write a config file.

What is timed is what users run: the whole fused call (alignment, both GEMMs, quantization, reduce) captured
in a CUDA graph, 10 calls with their own routing per graph, median over replays — with one config pinned.
The search is a coordinate descent over a curated candidate list (Hopper-minded tiles, patterned on tuned
H200 tables): for each M and each plausible BLOCK_M, GEMM1's tile is chosen with GEMM2's held at the
heuristic, then GEMM2's with GEMM1's best; the fastest pair over the BLOCK_M options wins. A few dozen
compilations per preset instead of thousands, so a preset tunes in a couple of minutes.

The result is written as ``E=..,N=..,device_name=..[,dtype=fp8_w8a8][,block_shape=[128,128]].json`` with
``gemm1``/``gemm2`` entries per M (the lookup takes the nearest M).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

DEFAULT_M = (1, 4, 16, 64, 256, 1024, 4096, 16384)
DTYPES = ("bf16", "fp8_tensor", "fp8_token", "fp8_block")
CALLS = 10

# (block_n, block_k, group_m, num_warps, num_stages) per BLOCK_M; GEMM1 tiles cover gate and up (two
# accumulators), so they are half as wide as GEMM2's for the same registers.
_GEMM1 = {
    16: [(32, 128, 1, 4, 4), (64, 128, 1, 4, 3), (16, 128, 1, 4, 4), (64, 64, 1, 4, 5), (32, 256, 1, 4, 3),
         (16, 256, 1, 4, 3), (128, 128, 1, 8, 3)],
    32: [(64, 128, 8, 4, 3), (128, 128, 8, 8, 3), (64, 64, 8, 4, 4), (32, 128, 8, 4, 4)],
    64: [(64, 64, 8, 4, 4), (128, 64, 8, 8, 3), (64, 128, 8, 4, 3), (128, 128, 8, 8, 3)],
    128: [(128, 64, 16, 8, 4), (128, 64, 16, 8, 3), (64, 64, 16, 4, 4), (64, 128, 16, 8, 3), (128, 128, 16, 8, 3)],
}
_GEMM2 = {
    16: [(64, 128, 1, 4, 4), (128, 128, 1, 4, 3), (32, 128, 1, 4, 4), (64, 256, 1, 4, 3), (128, 64, 1, 4, 4),
         (32, 256, 1, 4, 3), (256, 128, 1, 8, 2)],
    32: [(128, 128, 8, 4, 3), (256, 128, 8, 8, 2), (128, 64, 8, 4, 4), (64, 128, 8, 4, 4)],
    64: [(128, 64, 8, 4, 4), (256, 64, 8, 8, 3), (128, 128, 8, 4, 3), (64, 64, 8, 4, 4)],
    128: [(256, 64, 16, 8, 4), (256, 64, 16, 8, 3), (128, 64, 16, 8, 4), (128, 128, 16, 8, 3), (256, 128, 16, 8, 3)],
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fusedmoe tune", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True, help="model preset (fusedmoe.presets)")
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    ap.add_argument("--out", default=None, help="output folder (default: the packaged fusedmoe/configs)")
    ap.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="comma-separated token counts")
    ap.add_argument("--quick", action="store_true", help="fewer candidates (first 3 per BLOCK_M)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def block_m_options(M: int, top_k: int, E: int) -> list[int]:
    """Plausible BLOCK_M values for M tokens: by the average rows per expert."""
    rows = M * top_k / max(E, 1)
    if rows <= 2:
        return [16]
    if rows <= 8:
        return [16, 32]
    if rows <= 32:
        return [32, 64]
    if rows <= 128:
        return [64, 128]
    return [128]


def candidates(table: dict, block_m: int, fp8: bool, n: int, k: int, bk_cap: int | None, quick: bool):
    """GemmConfigs for one GEMM: the curated tiles, fp8 with doubled BLOCK_K, clipped to the problem."""
    from .ops.configs import GemmConfig

    seen, out = set(), []
    for bn, bk, g, w, s in table[block_m][: 3 if quick else None]:
        if fp8:
            bk = min(2 * bk, 256)
        if bk_cap is not None:
            while bk > bk_cap or bk_cap % bk:
                bk //= 2
        bn = min(bn, max(16, 1 << (max(n, 1) - 1).bit_length()))
        bk = min(bk, max(16, 1 << (max(k, 1) - 1).bit_length()))
        cfg = GemmConfig(block_m, bn, bk, g, w, s)
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        import torch
    except Exception:  # pragma: no cover
        print("fusedmoe tune: torch is not importable", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("fusedmoe tune: needs a CUDA GPU (none is visible here); nothing was written", file=sys.stderr)
        return 2

    from .api import fused_moe
    from .bench.timing import graph_time_us
    from .ops.configs import (
        PACKAGED_DIR,
        MoEConfig,
        config_file_name,
        device_name,
        heuristic_config,
        pinned_config,
        table_to_json,
    )
    from .presets import get_preset
    from .quant import QuantConfig, quantize_weights
    from .workspace.manager import WorkspaceManager

    try:
        preset = get_preset(args.preset)
    except ValueError as e:
        print(f"fusedmoe tune: {e}", file=sys.stderr)
        return 2
    ms = sorted({int(m) for m in args.m.split(",") if m.strip()})
    dev = torch.device("cuda")
    E, k, H, I = preset.experts_on_gpu, preset.top_k, preset.hidden_size, preset.intermediate_size
    quant = None if args.dtype == "bf16" else QuantConfig.parse(args.dtype)
    mode = quant.mode if quant else None
    block_shape = quant.block_shape if mode == "fp8_block" else None
    bk_cap = block_shape[1] if block_shape else None
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    w1 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=gen) / I**0.5
    extra = {}
    if quant:
        w1, w2, s1, s2 = quantize_weights(w1, w2, quant)
        extra = dict(quant=quant, w1_scale=s1, w2_scale=s2)
    manager = WorkspaceManager(dev)

    table: dict[int, MoEConfig] = {}
    t_start = time.time()
    for M in ms:
        x = torch.randn(M, H, device=dev, dtype=torch.bfloat16, generator=gen)
        routings = []
        for _ in range(CALLS):
            ids = torch.rand(M, E, device=dev, generator=gen).argsort(dim=1)[:, :k].to(torch.int32)
            routings.append((torch.rand(M, k, device=dev, generator=gen), ids))
        calls = [
            (lambda w=w, ids=ids, x=x: fused_moe(x, w1, w2, w, ids, workspace=manager, backend="triton", **extra))
            for w, ids in routings
        ]

        def time_config(cfg: MoEConfig, calls=calls) -> float:
            try:
                with pinned_config(cfg):
                    return graph_time_us(calls, warmup_replays=2, replays=10)
            except Exception:  # out of shared memory / registers: not a candidate
                return float("inf")

        base = heuristic_config(M, E, H, I, k, mode, block_shape)
        best: tuple[float, MoEConfig] | None = None
        for bm in block_m_options(M, k, E):
            g2 = replace(base.gemm2, block_m=bm)
            scored = [(time_config(MoEConfig(g1, g2)), g1) for g1 in candidates(_GEMM1, bm, bool(quant), I, H,
                                                                                 bk_cap, args.quick)]
            t1, g1 = min(scored, key=lambda s: s[0])
            scored = [(time_config(MoEConfig(g1, c)), c) for c in candidates(_GEMM2, bm, bool(quant), H, I,
                                                                          bk_cap, args.quick)]
            t2, g2 = min(scored + [(t1, g2)], key=lambda s: s[0])
            if best is None or t2 < best[0]:
                best = (t2, MoEConfig(g1, g2))
        if best is None or best[0] == float("inf"):
            print(f"M={M}: no config ran", file=sys.stderr)
            continue
        table[M] = best[1]
        print(f"M={M:>6}: {best[0]:9.1f} us  {best[1].to_dict()}  ({time.time() - t_start:.0f}s)", flush=True)
    if not table:
        print("fusedmoe tune: nothing tuned", file=sys.stderr)
        return 1
    out_dir = Path(args.out) if args.out else PACKAGED_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / config_file_name(E, I, device_name(), mode, block_shape)
    source = (f"fusedmoe tune --preset {args.preset} --dtype {args.dtype} on {torch.cuda.get_device_name()} "
              "(whole fused call, CUDA graph)")
    path.write_text(table_to_json(table, source))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
