"""``fusedmoe tune``: search GEMM block configs for one model preset on this GPU and write a config file.

For each M, and each BLOCK_M candidate, GEMM1 and GEMM2 are timed separately over their own candidate
tiles (they share only BLOCK_M, which sets the alignment), with ``triton.testing.do_bench`` on pre-aligned
random routing; the BLOCK_M with the smallest GEMM1 + GEMM2 time wins. The result is written as
``E=..,N=..,device_name=..[,dtype=fp8_w8a8][,block_shape=[128,128]].json`` with ``gemm1``/``gemm2`` entries.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from pathlib import Path

DEFAULT_M = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
DTYPES = ("bf16", "fp8_tensor", "fp8_token", "fp8_block")
SMEM_LIMIT = 220 * 1024


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fusedmoe tune", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True, help="model preset (fusedmoe.presets)")
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    ap.add_argument("--out", default=None, help="output folder (default: the packaged fusedmoe/configs)")
    ap.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="comma-separated token counts")
    ap.add_argument("--quick", action="store_true", help="a smaller search space")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def _candidates(block_m: int, n: int, k: int, fp8: bool, block_k_cap: int | None, quick: bool, gemm1: bool):
    from .ops.configs import GemmConfig

    bns = (32, 64, 128, 256) if not quick else (64, 128)
    bks = (64, 128, 256) if not quick else (64, 128)
    warps = (4, 8)
    stages = (2, 3, 4, 5) if not quick else (3, 4)
    groups = (1, 16) if block_m >= 64 else (1,)
    elt = 1 if fp8 else 2
    for bn, bk, w, s, g in itertools.product(bns, bks, warps, stages, groups):
        if bn > max(16, 2 * n) or bk > max(16, 2 * k):
            continue
        if block_k_cap is not None and (bk > block_k_cap or block_k_cap % bk):
            continue
        b_tiles = 2 if gemm1 else 1
        if (block_m * bk + b_tiles * bk * bn) * elt * s > SMEM_LIMIT:
            continue
        if block_m * bn * b_tiles > 128 * 256 and w < 8:
            continue
        yield GemmConfig(block_m, bn, bk, g, w, s)


def _block_m_candidates(M: int, top_k: int, E: int) -> list[int]:
    rows = M * top_k / E
    out = [16]
    for bm in (32, 64, 128):
        if rows >= bm / 4:
            out.append(bm)
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
    import triton
    import triton.testing

    from .ops.align import align_params, moe_align
    from .ops.configs import PACKAGED_DIR, MoEConfig, config_file_name, device_name, table_to_json
    from .ops.grouped_gemm import grid_blocks, moe_gemm1, moe_gemm2
    from .presets import get_preset
    from .quant import FP8_DTYPE, QuantConfig, activation_scales, quantize_weights

    try:
        preset = get_preset(args.preset)
    except ValueError as e:
        print(f"fusedmoe tune: {e}", file=sys.stderr)
        return 2
    ms = [int(m) for m in args.m.split(",") if m.strip()]
    dev = torch.device("cuda")
    E, k, H, I = preset.experts_on_gpu, preset.top_k, preset.hidden_size, preset.intermediate_size
    quant = None if args.dtype == "bf16" else QuantConfig.parse(args.dtype)
    mode = quant.mode if quant else None
    fp8 = quant is not None
    block_shape = quant.block_shape if quant else (128, 128)
    bk_cap = block_shape[1] if mode == "fp8_block" else None
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    w1 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=gen) / I**0.5
    w1s = w2s = None
    if quant:
        w1, w2, w1s, w2s = quantize_weights(w1, w2, quant)
        w1s = w1s.reshape(E) if mode == "fp8_tensor" else (w1s.reshape(E, -1) if mode == "fp8_token" else w1s)
        w2s = w2s.reshape(E) if mode == "fp8_tensor" else (w2s.reshape(E, -1) if mode == "fp8_token" else w2s)

    table: dict[int, MoEConfig] = {}
    t_start = time.time()
    for M in ms:
        x = torch.randn(M, H, device=dev, dtype=torch.bfloat16, generator=gen)
        ids = torch.rand(M, E, device=dev, generator=gen).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
        wts = torch.rand(M, k, device=dev, generator=gen)
        act = torch.randn(M * k, I, device=dev, dtype=torch.bfloat16, generator=gen)
        a1 = a1s = a2 = a2s = None
        if quant:
            a1s, a2s = activation_scales(x, quant), activation_scales(act, quant)
            a1 = (x.float() / (a1s if mode != "fp8_block" else a1s.repeat_interleave(128, 1)[:, :H])).clamp(
                -448, 448).to(FP8_DTYPE)
            a2 = (act.float() / (a2s if mode != "fp8_block" else a2s.repeat_interleave(128, 1)[:, :I])).clamp(
                -448, 448).to(FP8_DTYPE)
        y = torch.empty(M * k, H, device=dev, dtype=torch.bfloat16)
        best: tuple[float, MoEConfig] | None = None
        for bm in _block_m_candidates(M, k, E):
            sorted_ids, block_expert, _ = moe_align(ids, E, bm)
            nb = grid_blocks(M * k, align_params(M * k, E, bm).max_blocks)
            times = []
            for gemm1 in (True, False):
                n, kk = (I, H) if gemm1 else (H, I)
                best_g = None
                for cfg in _candidates(bm, n, kk, fp8, bk_cap, args.quick, gemm1):
                    if gemm1:
                        fn = functools.partial(
                            moe_gemm1, a1 if fp8 else x, w1, act, sorted_ids, block_expert, top_k=k, num_blocks=nb,
                            config=cfg, quant_mode=mode, a_scale=a1s, w_scale=w1s, block_shape=block_shape)
                    else:
                        fn = functools.partial(
                            moe_gemm2, a2 if fp8 else act, w2, y, sorted_ids, block_expert, num_blocks=nb,
                            config=cfg, topk_weights=wts, quant_mode=mode, a_scale=a2s, w_scale=w2s,
                            block_shape=block_shape)
                    try:
                        t = triton.testing.do_bench(fn, warmup=5, rep=20)
                    except Exception:  # out of resources, unsupported tile
                        continue
                    if best_g is None or t < best_g[0]:
                        best_g = (t, cfg)
                if best_g is None:
                    break
                times.append(best_g)
            if len(times) == 2:
                total = times[0][0] + times[1][0]
                if best is None or total < best[0]:
                    best = (total, MoEConfig(times[0][1], times[1][1]))
        if best is None:
            print(f"M={M}: no config ran", file=sys.stderr)
            continue
        table[M] = best[1]
        print(f"M={M:>6}: {best[0] * 1000:9.1f} us  {best[1].to_dict()}  ({time.time() - t_start:.0f}s)", flush=True)
    if not table:
        print("fusedmoe tune: nothing tuned", file=sys.stderr)
        return 1
    out_dir = Path(args.out) if args.out else PACKAGED_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / config_file_name(E, I, device_name(), mode, block_shape if mode == "fp8_block" else None)
    source = f"fusedmoe tune --preset {args.preset} --dtype {args.dtype} on {torch.cuda.get_device_name()}"
    path.write_text(table_to_json(table, source))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
