"""Kernel-level GPU benchmark: one MoE layer call (routing + fused call) per backend over a token sweep.

Method (docs/architecture.md, DESIGN.md): ceilings measured at the start of the run; every time is the
median over CUDA-graph replays of 10 captured calls, each with its own router logits, so small batches do not
find their experts' weights in L2; eager wall and host time are measured too. Each row reports the time, its
ratio to the floor (weights of the distinct experts touched over read bandwidth, or FLOPs over the measured
bf16 rate, whichever is larger; FLOPs over the measured fp8 rate for rows running fp8 weights and activations),
the achieved TB/s and TFLOP/s, and the speed-up over each baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import dataclass

import torch

from ...api import fused_moe
from ...op import fused_moe_op
from ...ops.configs import ENV_DIR, heuristic_config, pinned_config
from ...routing import route
from ...workspace.manager import WorkspaceManager
from . import floors, peers, report, timing
from .baselines import hf_experts

DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
CALLS_PER_GRAPH = 10
#: Our backends, which run the quantized weights of a quantized sweep (the others run the bf16 originals).
OUR_BACKENDS = ("triton", "triton_op", "triton_before", "triton_heuristic", "triton_mma")


@dataclass(frozen=True)
class Shape:
    name: str
    num_experts: int  # global experts (routing is over these)
    local_experts: int  # experts held on this GPU (an EP slice when smaller)
    top_k: int
    hidden: int
    inter: int
    routing: dict


def shape_from_args(args: argparse.Namespace) -> Shape:
    from ..presets import PRESETS

    if args.preset:
        if args.preset not in PRESETS:
            raise SystemExit(f"unknown --preset {args.preset!r}; choose from {sorted(PRESETS)}")
        p = PRESETS[args.preset]
        local = getattr(p, "local_experts", None) or p.num_experts
        routing = dict(getattr(p, "routing", {}) or {})
        return Shape(p.name, p.num_experts, local, p.top_k, p.hidden_size, p.intermediate_size, routing)
    if not (args.e and args.k and args.h and args.i):
        p = PRESETS["qwen3-30b-a3b"]
        return Shape(p.name, p.num_experts, p.num_experts, p.top_k, p.hidden_size, p.intermediate_size, {})
    return Shape(f"E{args.e}k{args.k}H{args.h}I{args.i}", args.e, args.e, args.k, args.h, args.i, {})


def _weights(shape: Shape, dtype: str, device):
    gen = torch.Generator(device=device).manual_seed(0)
    E, H, I = shape.local_experts, shape.hidden, shape.inter
    w1 = torch.randn(E, 2 * I, H, device=device, dtype=torch.bfloat16, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, device=device, dtype=torch.bfloat16, generator=gen) / I**0.5
    quantized = None
    if dtype != "bf16":
        from ...quant import QuantConfig, quantize_weights

        quant = QuantConfig.parse(dtype)
        w1q, w2q, s1, s2 = quantize_weights(w1, w2, quant)
        quantized = dict(w1=w1q, w2=w2q, quant=quant, w1_scale=s1, w2_scale=s2)
        if quant.static_activation_scale:
            quantized["a1_scale"] = torch.full((1,), 4.0 / 448, device=device)
            quantized["a2_scale"] = torch.full((1,), 4.0 / 448, device=device)
    return w1, w2, quantized


def mma_weights(quantized: dict) -> dict:
    """A checkpoint-layout MXFP4 sweep's weights in the mma layout (made once per sweep, kept in ``quantized``)."""
    if "mma" not in quantized:
        from ...mxfp4_layout import to_mma_layout
        from ...quant import QuantConfig

        v1, s1 = to_mma_layout(quantized["w1"], quantized["w1_scale"], gated=True)
        v2, s2 = to_mma_layout(quantized["w2"], quantized["w2_scale"], gated=False)
        quantized["mma"] = dict(w1=v1, w2=v2, quant=QuantConfig("mxfp4", layout="mma"), w1_scale=s1, w2_scale=s2)
    return quantized["mma"]


def _weight_bytes(quantized: dict | None) -> float:
    """Bytes per weight element as stored, scales included: bf16 2, fp8 1, MXFP4 1/2 + 1/32 (a byte per 32)."""
    if not quantized:
        return 2.0
    if quantized["quant"].mode == "mxfp4":
        from ...mxfp4 import GROUP

        return 0.5 + 1.0 / GROUP
    return 1.0


def _expert_map(shape: Shape, device):
    if shape.local_experts == shape.num_experts:
        return None
    m = torch.full((shape.num_experts,), -1, dtype=torch.int32, device=device)
    m[: shape.local_experts] = torch.arange(shape.local_experts, dtype=torch.int32, device=device)
    return m


def main(args: argparse.Namespace) -> int:
    device = torch.device("cuda")
    shape = shape_from_args(args)
    tokens = args.tokens or DEFAULT_TOKENS
    default_backends = "triton,triton_op,grouped_mm,hf_grouped_mm,hf_batched_mm,torch"
    if args.dtype != "bf16":  # a quantized sweep sits beside our own bf16 call on the same shape
        default_backends = "triton,triton_bf16,triton_op,grouped_mm,torch"
    backends = (args.backends or default_backends).split(",")
    env = report.environment()
    print(f"{env.get('gpu')} | torch {env['torch']} | triton {env.get('triton')} | commit {env.get('commit')}")
    if getattr(args, "peers", False):
        env["peers"] = {}
        # the bf16 peers, and the peers that run this sweep's quantized weights
        for name in (*peers.PEERS, *peers.quant_peers(args.dtype)):
            ok, label = peers.available(name)
            env["peers"][name] = label if ok else f"absent: {label}"
            print(f"peer {name}: {env['peers'][name]}")
            if ok and name not in backends:
                backends.append(name)
    ceil = floors.measure_ceilings(device)
    print(f"ceilings: {ceil.summary()}")
    w1, w2, quantized = _weights(shape, args.dtype, device)
    expert_map = _expert_map(shape, device)
    manager = WorkspaceManager(device, strategy="shared")
    weight_bytes = _weight_bytes(quantized)
    fp8 = bool(quantized) and quantized["quant"].fp8
    rows, results = [], []
    skipped: set[str] = set()  # peers that gave no call (said once)
    for M in tokens:
        # the graphs timed at the previous M are gone: drop the arenas they captured (kept until release())
        manager.release()
        gen = torch.Generator(device=device).manual_seed(M)
        x = torch.randn(M, shape.hidden, device=device, dtype=torch.bfloat16, generator=gen)
        logits = [
            torch.randn(M, shape.num_experts, device=device, dtype=torch.float32, generator=gen)
            for _ in range(CALLS_PER_GRAPH)
        ]
        routed = [route(lg, shape.top_k, **shape.routing) for lg in logits]
        distinct = sum(_distinct_local(ids, expert_map) for _, ids in routed) / len(routed)
        # the floor of each row counts the weights as that row's backend stores them: quantized for ours,
        # bf16 for triton_bf16 and the peers
        floors_of = {
            stored: floors.layer_floor_us(
                distinct, M, shape.top_k, shape.hidden, shape.inter, wb, ceil, fp8=fp8 and stored == "quantized"
            )
            for stored, wb in (("quantized", weight_bytes), ("bf16", 2.0))
        }
        flops = 2 * M * shape.top_k * 3 * shape.hidden * shape.inter
        times: dict[str, float] = {}
        if args.profile:
            from . import profile

            # every backend asked for (--backends; triton by default), e.g. ours beside a peer's kernels
            for backend in backends if args.backends or getattr(args, "peers", False) else ["triton"]:
                fn, error = _call_or_setup_error(
                    backend, shape, x, w1, w2, quantized, expert_map, manager, getattr(args, "configs_before", None)
                )
                if error:
                    print(f"peer {backend}: setup failed on {shape.name} M={M}: {error}")
                if fn is None:
                    continue
                breakdown = profile.kernel_breakdown(lambda fn=fn, lg=logits[0]: fn(lg))
                profile.print_breakdown(f"{shape.name} {args.dtype} M={M} ({backend}, eager)", breakdown)
                results.append(
                    {
                        "backend": backend,
                        "M": M,
                        "profile": breakdown,
                        "host_ops": profile.cpu_op_counts(lambda fn=fn, lg=logits[0]: fn(lg)),
                    }
                )
            continue
        ours = None  # our layer's output on logits[0], for the peers' check
        for backend in backends:
            fn, error = _call_or_setup_error(
                backend, shape, x, w1, w2, quantized, expert_map, manager, getattr(args, "configs_before", None)
            )
            if error:
                results.append({"backend": backend, "M": M, "error": error})
                print(f"peer {backend}: setup failed on {shape.name} M={M}: {error}")
                continue
            if fn is None:
                if peers.is_peer(backend) and backend not in skipped:
                    skipped.add(backend)  # said once: a peer asked for must not vanish from the table unexplained
                    print(
                        f"peer {backend}: not run on {shape.name} {args.dtype} (absent, or its routing "
                        f"{shape.routing or 'softmax'}, weights or expert map are not the peer's)"
                    )
                continue
            calls = [(lambda lg=lg, fn=fn: fn(lg)) for lg in logits]
            runs_quantized = backend in OUR_BACKENDS or backend in peers.QUANT_MAKERS
            stored = "quantized" if quantized and runs_quantized else "bf16"
            floor_us, bytes_moved, bound = floors_of[stored]
            row = {"backend": backend, "M": M, "floor_us": floor_us, "bound": bound}
            try:
                if backend == "torch":
                    row["us"], row["host_us"] = timing.eager_time_us(calls, repeats=2)
                    row["mode"] = "eager"
                else:
                    try:
                        row["us"], row["mode"] = timing.graph_time_us(calls), "graph"
                    except Exception as exc:  # not capturable (e.g. a host sync inside): time it eagerly
                        if backend == "triton":
                            raise
                        torch.cuda.synchronize()
                        row["graph_error"] = f"{type(exc).__name__}: {exc}"[:160]
                        row["us"], row["host_us"] = timing.eager_time_us(calls, repeats=3)
                        row["mode"] = "eager"
                    if args.eager and row["mode"] == "graph":
                        row["eager_us"], row["host_us"] = timing.eager_time_us(calls, repeats=3)
            except Exception as exc:  # a baseline that cannot run this shape is reported, not fatal
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                results.append(row)
                torch.cuda.synchronize()
                continue
            if (backend in peers.MAKERS and not quantized) or backend in peers.QUANT_MAKERS:
                # a peer's output against ours on the same logits and weights: the comparison is only fair if
                # they agree
                if ours is None:
                    ours = _make_call("triton", shape, x, w1, w2, quantized, expert_map, manager)(logits[0])
                row["rel_err_vs_triton"] = peers.check_close(fn(logits[0]), ours)
                print(f"{backend} M={M}: output vs ours, max relative difference {row['rel_err_vs_triton']:.2e}")
            row["pct_floor"] = 100.0 * floor_us / row["us"]
            row["tb_s"] = bytes_moved / (row["us"] * 1e-6) / 1e12
            row["tflops"] = flops / (row["us"] * 1e-6) / 1e12
            times[backend] = row["us"]
            results.append(row)
        for row in results:
            if row["M"] == M and "us" in row:
                for b, t in times.items():
                    if b != row["backend"]:
                        row[f"x_vs_{b}"] = t / row["us"]
                rows.append(
                    [
                        row["backend"],
                        M,
                        row["us"],
                        row.get("eager_us"),
                        row.get("host_us"),
                        row["floor_us"],
                        row["pct_floor"],
                        row["tb_s"],
                        row["tflops"],
                    ]
                    + [row.get(f"x_vs_{b}") for b in backends]
                )
        torch.cuda.empty_cache()
    title = (
        f"{shape.name} {args.dtype}: routing + fused call, us per call (CUDA graph of {CALLS_PER_GRAPH}; "
        "* = not capturable, timed eagerly)"
    )
    if not args.profile:  # a profile run times nothing: its per-kernel tables are printed above
        report.print_table(
            title,
            ["backend", "M", "us", "eager us", "host us", "floor us", "% floor", "TB/s", "TFLOP/s"]
            + [f"x vs {b}" for b in backends],
            rows,
        )
    payload = {
        "env": env,
        "ceilings": ceil.as_dict(),
        "shape": shape.__dict__,
        "dtype": args.dtype,
        "results": results,
        "workspace": manager.stats.as_dict(),
    }
    if args.json:
        report.save_json(args.json, payload)
        print(f"wrote {args.json}")
    if args.plot:
        plot(payload, args.plot)
    return 0


def _distinct_local(ids: torch.Tensor, expert_map) -> int:
    flat = ids.reshape(-1).long()
    if expert_map is not None:
        flat = expert_map.long()[flat]
        flat = flat[flat >= 0]
    return int(torch.unique(flat).numel())


@contextlib.contextmanager
def _config_dir(path: str):
    """Look tuned configs up in ``path`` first for the duration (launches are keyed by it)."""
    old = os.environ.get(ENV_DIR)
    os.environ[ENV_DIR] = path
    try:
        yield
    finally:
        if old is None:
            del os.environ[ENV_DIR]
        else:
            os.environ[ENV_DIR] = old


def _call_or_setup_error(backend, *make_args) -> tuple:
    """(:func:`_make_call`'s call, None), or for a peer whose setup raises (an API its installed version lacks, a
    layout it refuses) (None, the error's text): a peer's failure is a row of the table, not the end of the sweep.
    Our own backends raise."""
    try:
        return _make_call(backend, *make_args), None
    except Exception as exc:
        if not peers.is_peer(backend):
            raise
        return None, f"{type(exc).__name__}: {exc}"[:200]


def _make_call(backend, shape: Shape, x, w1, w2, quantized, expert_map, manager, configs_before=None):
    """A function of router logits that runs routing + one layer call on ``backend``; None if unavailable.

    ``triton_before``: the Triton backend with the config tables of the folder ``configs_before`` (e.g. the
    tables a re-tune replaced), to compare tables in one run."""
    routing = shape.routing
    k = shape.top_k
    if backend == "triton_before":
        if not configs_before:
            return None
        inner = _make_call("triton", shape, x, w1, w2, quantized, expert_map, manager)

        def call(lg):
            with _config_dir(configs_before):
                return inner(lg)

        return call
    if backend == "triton_heuristic":  # the launch heuristic alone (no table), per M as get_config would
        inner = _make_call("triton", shape, x, w1, w2, quantized, expert_map, manager)
        quant = quantized["quant"] if quantized else None
        cfg = heuristic_config(
            x.shape[0],
            shape.local_experts,
            shape.hidden,
            shape.inter,
            k,
            quant.kernel_mode if quant else None,
            quant.block_shape if quant else None,
        )

        def call(lg):
            with pinned_config(cfg):
                return inner(lg)

        return call
    if backend in peers.MAKERS:  # vllm, triton_kernels, grouped_mm: bf16 layers of the whole expert set
        if expert_map is not None or not peers.available(backend)[0]:
            return None
        return peers.MAKERS[backend](x, w1, w2, k, routing)
    if backend in peers.QUANT_MAKERS:  # our quantized weights, on a peer that takes their mode
        if not quantized or quantized["quant"].mode not in peers.QUANT_PEERS[backend] or expert_map is not None:
            return None
        if not peers.available(backend)[0]:
            return None
        return peers.QUANT_MAKERS[backend](x, quantized, k, routing)
    if backend == "triton_bf16":  # our bf16 call beside a quantized sweep (the weights it was quantized from)
        return _make_call("triton", shape, x, w1, w2, None, expert_map, manager) if quantized else None
    if backend == "triton_mma":  # an MXFP4 sweep's weights re-laid for the tensor cores (fusedmoe.mxfp4_layout)
        if not quantized or quantized["quant"].name != "mxfp4":
            return None
        return _make_call("triton", shape, x, w1, w2, mma_weights(quantized), expert_map, manager)
    if backend in ("triton", "triton_op", "torch"):
        if backend == "torch" and quantized:
            return None
        # triton_op: the same call through the registered op (what torch.compile sees), for its host cost
        run = fused_moe_op if backend == "triton_op" else fused_moe
        kw = dict(
            expert_map=expert_map,
            global_num_experts=shape.num_experts,
            workspace=manager,
            backend="triton" if backend == "triton_op" else backend,
        )
        if quantized and backend != "torch":
            kw.update({k_: v for k_, v in quantized.items() if k_ not in ("w1", "w2", "mma")})
            ww1, ww2 = quantized["w1"], quantized["w2"]
        else:
            ww1, ww2 = w1, w2

        def call(lg):
            w, ids = route(lg, k, **routing)
            return run(x, ww1, ww2, w, ids, **kw)

        return call
    if backend in ("hf_grouped_mm", "hf_batched_mm"):
        # batched_mm gathers one weight copy per slot: skip it where that would take more than 16 GB
        slots_bytes = x.shape[0] * k * 3 * shape.hidden * shape.inter * 2
        if expert_map is not None or (backend == "hf_batched_mm" and slots_bytes > 16e9):
            return None
        module = hf_experts(w1, w2, backend[3:])
        if module is None:
            return None

        def call(lg):
            w, ids = route(lg, k, **routing)
            return module(x, ids.long(), w.to(x.dtype))

        return call
    raise SystemExit(f"unknown backend {backend!r}")


def plot(payload: dict, path: str) -> None:
    """Time vs tokens per backend (log-log) with the floor line."""
    plt = report.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_backend: dict[str, list[tuple[int, float]]] = {}
    floor: dict[int, float] = {}
    for r in payload["results"]:
        if "us" in r:
            by_backend.setdefault(r["backend"], []).append((r["M"], r["us"]))
            floor[r["M"]] = min(r["floor_us"], floor.get(r["M"], float("inf")))  # the stored format's, if lower
    for b, pts in by_backend.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b)
    fl = sorted(floor.items())
    ax.plot([p[0] for p in fl], [p[1] for p in fl], "k--", label="floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens (M)")
    ax.set_ylabel("us per layer call")
    ax.set_title(f"{payload['shape']['name']} {payload['dtype']} on {payload['env'].get('gpu')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
