"""Command line: ``fusedmoe info | bench | tune | demo``."""

from __future__ import annotations

import argparse
import sys

import torch


def _info(args: argparse.Namespace) -> int:
    from .. import __version__
    from ..api import resolve_backend, triton_available
    from .bench.report import environment

    env = environment()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"fusedmoe {__version__}")
    for key in ("python", "torch", "triton", "gpu", "cuda", "commit"):
        if env.get(key) is not None:
            print(f"  {key:<8} {env[key]}")
    print(f"  device   {device}")
    print("  backends torch (any device)" + (", triton" if triton_available() else ""))
    print(f"  auto ->  {resolve_backend('auto', device)}")
    return 0


def _parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens must be comma-separated integers, got {text!r}") from None
    if not tokens or any(t < 0 for t in tokens):
        raise argparse.ArgumentTypeError(f"--tokens must be non-negative integers, got {text!r}")
    return tokens


def _bench(args: argparse.Namespace) -> int:
    if args.mode == "decode":
        from .bench import decode

        return decode.main(args)
    if args.mode == "host":
        from .bench import host

        return host.main(args)
    if args.mode == "model":
        from .bench import model

        return model.main(args)
    if args.mode == "train" and args.ep:
        from .bench import ep_train

        return ep_train.main(args)
    if args.mode == "train":
        from .bench import train

        return train.main(args)
    if args.cpu or not torch.cuda.is_available():
        return _bench_strategies_cpu(args)
    if args.route:
        from .bench import report, route

        results = route.run(args.tokens or [1, 8, 64, 1024, 16384])
        if args.json:
            report.save_json(args.json, {"env": report.environment(), "route": results})
        return 0
    if args.align:
        from .bench import align, report

        results = align.run(args.tokens or [1, 4, 16, 64, 256, 1024])
        if args.json:
            report.save_json(args.json, {"env": report.environment(), "align": results})
        return 0
    from .bench import kernel

    return kernel.main(args)


def _bench_strategies_cpu(args: argparse.Namespace) -> int:
    from .bench import call_path, report, strategies
    from .presets import Preset

    shape = Preset("cpu-stack", args.e or 16, args.k or 4, args.h or 256, args.i or 128, args.layers or 8)
    tokens = args.tokens or [1, 4, 16, 64]
    print(
        f"CPU benchmark (no GPU): torch experts, E={shape.num_experts} k={shape.top_k} H={shape.hidden_size} "
        f"I={shape.intermediate_size}, {shape.num_layers} layers, tokens {tokens}, float32"
    )
    results = strategies.run(
        shape, tokens, steps=args.steps or 24, device=torch.device("cpu"), dtype=torch.float32, backend="torch"
    )
    report.print_table("workspace strategies (per layer call)", strategies.COLUMNS, strategies.table_rows(results))
    paths = call_path.measure("cpu")
    report.print_table(
        "call path host cost (M=1, E=8, k=2, H=64, I=32, float32)", call_path.COLUMNS, call_path.table_rows(paths)
    )
    if args.json:
        report.save_json(
            args.json,
            {
                "env": report.environment(),
                "shape": {f: getattr(shape, f) for f in strategies.SHAPE_FIELDS},
                "tokens": tokens,
                "strategies": results,
                "call_path": paths,
            },
        )
        print(f"wrote {args.json}")
    return 0


def _tune(argv: list[str]) -> int:
    from .tune import main as tune_main

    return tune_main(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusedmoe", description="fused Mixture-of-Experts layers")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backends, device and versions")

    bench = sub.add_parser("bench", help="benchmarks (GPU: kernel sweep; CPU: workspace strategies)")
    bench.add_argument(
        "mode",
        nargs="?",
        default="kernel",
        choices=("kernel", "decode", "host", "model", "train"),
        help="kernel: one layer call per backend over a token sweep; decode: an L-layer stack per strategy; "
        "host: host time per call and its stages; model: a transformers model per experts implementation; "
        "train: forward + backward of one layer per system (fusedmoe, transformers, Liger)",
    )
    bench.add_argument("--preset", default=None, help="model shape preset (see fusedmoe.tools.presets)")
    bench.add_argument("--e", type=int, help="number of experts")
    bench.add_argument("--k", type=int, help="top-k")
    bench.add_argument("--h", type=int, help="hidden size")
    bench.add_argument("--i", type=int, help="intermediate size per expert")
    bench.add_argument("--tokens", type=_parse_tokens, help="comma-separated token counts")
    bench.add_argument(
        "--dtype",
        "--quant",
        dest="dtype",
        default="bf16",
        help="bf16 or a quantized weight mode: fp8_tensor, fp8_token, fp8_block, mxfp4 (kernel: its rows sit beside "
        "triton_bf16, our bf16 call on the same shape)",
    )
    bench.add_argument("--backends", default=None, help="comma-separated backends to compare")
    bench.add_argument(
        "--peers",
        action="store_true",
        help="kernel: also run the other libraries' kernels that import here (vLLM, triton_kernels, grouped_mm), "
        "same process and run, each labelled with its version",
    )
    bench.add_argument("--layers", type=int, help="layers (decode, model; CPU strategy table)")
    bench.add_argument("--steps", type=int, help="timed steps (decode; CPU strategy table)")
    bench.add_argument("--cpu", action="store_true", help="run the CPU strategy benchmark even with a GPU")
    bench.add_argument("--eager", action="store_true", help="GPU: also time eager (host cost) per call")
    bench.add_argument(
        "--profile",
        action="store_true",
        help="GPU: per-kernel GPU time (torch profiler); model: one profiled prefill and generate per cell",
    )
    bench.add_argument("--route", action="store_true", help="GPU: time route() alone (torch vs kernel shapes)")
    bench.add_argument("--align", action="store_true", help="GPU: time the alignment op alone")
    bench.add_argument(
        "--configs-before",
        default=None,
        help="folder of config tables for the 'triton_before' backend (before/after a re-tune)",
    )
    bench.add_argument("--tiny", action="store_true", help="model: a 2-layer, small-dimension model (CPU checks)")
    bench.add_argument("--impls", default=None, help="model: comma-separated experts implementations")
    bench.add_argument("--modes", default=None, help="model: eager and/or compiled, comma-separated (default eager)")
    bench.add_argument("--batches", default=None, help="model: comma-separated batch sizes (default 1,8)")
    bench.add_argument("--prompt", type=int, default=128, help="model: prompt tokens (prefill)")
    bench.add_argument("--new", type=int, default=32, help="model: generated tokens")
    bench.add_argument("--repeats", type=int, default=None, help="model: interleaved timed repeats (default 5)")
    bench.add_argument("--isolate", action="store_true", help="model: each mode in a process of its own, rows merged")
    bench.add_argument("--json", default=None, help="write every figure to this JSON file")
    bench.add_argument("--plot", default=None, help="write a PNG plot (time vs tokens) to this path")

    sub.add_parser("tune", help="search kernel configs on this GPU and write a config file", add_help=False)

    demo = sub.add_parser("demo", help="patch a small Qwen3-MoE (or a local checkpoint), generate, compare")
    demo.add_argument("--model", default=None, help="local checkpoint path (default: random small Qwen3-MoE)")
    demo.add_argument("--tokens", type=int, default=32, help="tokens to generate")
    demo.add_argument("--prompt", type=int, default=16, help="prompt length (random token ids)")
    demo.add_argument("--batch", type=int, default=None, help="sequences per batch (default 1; with --train 32)")
    _add_train_arguments(bench, demo)
    return parser


def _add_train_arguments(bench: argparse.ArgumentParser, demo: argparse.ArgumentParser) -> None:
    from . import train_demo
    from .bench import train

    train.add_arguments(bench)
    train_demo.add_arguments(demo)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "tune":
        return _tune(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "info":
        return _info(args)
    if args.command == "demo":
        if args.train:
            from .train_demo import main as demo_main
        else:
            from .demo import main as demo_main

        return demo_main(args)
    return _bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
