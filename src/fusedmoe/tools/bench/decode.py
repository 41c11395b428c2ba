"""``fusedmoe bench decode``: a model-shaped stack of MoE layers driven as decode steps, once per strategy.

The seeds' question — does it matter where MoE scratch memory comes from? — answered at the level of a
whole decode step: the same L layers (real-size random weights when they fit on the device), the same
sequence of batch sizes (random M in [1, 256] with occasional prefill chunks of 2048-8192 tokens), run with
each workspace strategy: ``alloc_zeros``, ``alloc_empty``, ``per_layer``, ``shared``, and ``shared`` + a frozen
arena + CUDA graphs (decode steps padded to graph buckets, prefill chunks eager on the same arena).

Per strategy: decode and prefill step time, host microseconds per layer (time to issue a step without waiting
for the device, divided by L), workspace-manager and caching-allocator allocations per step, fill/zero
kernels per step (torch profiler), arena bytes, peak device memory above the weights, and growth events.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace

import torch

from ...layer import FusedMoE
from ...workspace.manager import WorkspaceManager
from ..presets import PRESETS, Preset
from . import report
from .timing import sync

GRAPHS = "shared+graphs"
STRATEGIES = ("alloc_zeros", "alloc_empty", "per_layer", "shared", GRAPHS)
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FILL_KERNEL_NAMES = ("fill", "zero", "memset")
#: The stack as the JSON result describes it: these fields of the preset, then its router keywords.
STACK_FIELDS = ("name", "num_experts", "top_k", "hidden_size", "intermediate_size", "num_layers")


def step_sizes(steps: int, seed: int = 0, max_decode: int = 256, prefill=(2048, 4096, 8192)) -> list[int]:
    """Batch sizes of a decode run: mostly random M in [1, max_decode], one prefill chunk in ~12 steps."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, max_decode) for _ in range(steps)]
    for i in range(steps // 3, steps, 12):
        sizes[i] = rng.choice(prefill)
    return sizes


def build_stack(cfg: Preset, device: torch.device, dtype: torch.dtype, backend: str) -> tuple[list[FusedMoE], int]:
    """``cfg.num_layers`` layers of ``cfg`` (routed experts); distinct random weights for as many as fit in 70% of
    free device memory, shared beyond."""
    torch.manual_seed(0)
    per_layer = 3 * cfg.num_experts * cfg.hidden_size * cfg.intermediate_size * torch.empty((), dtype=dtype).itemsize
    distinct = cfg.num_layers
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        distinct = max(1, min(cfg.num_layers, int(free * 0.7 // per_layer)))
    layers = []
    for i in range(cfg.num_layers):
        layer = cfg.routed_layer(dtype=dtype, device="meta" if i >= distinct else device, backend=backend)
        if i >= distinct:  # share the weights of an earlier layer (memory), keep the layer object distinct
            src = layers[i % distinct]
            layer.w1, layer.w2, layer.gate = src.w1, src.w2, src.gate
        layers.append(layer)
    return layers, distinct


def _allocator_allocs(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_stats(device).get("allocation.all.allocated", 0)


def _count_fill_kernels(fn, device: torch.device) -> float | None:
    """Fill/zero/memset kernels launched by one call of ``fn`` (torch profiler); None on CPU."""
    if device.type != "cuda":
        return None
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize(device)
    count = 0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and any(n in evt.name.lower() for n in FILL_KERNEL_NAMES):
            count += 1
    return float(count)


class _GraphRunner:
    """One CUDA graph of the whole stack per decode bucket; prefill chunks run eagerly on the same arena."""

    def __init__(self, layers, manager: WorkspaceManager, hidden: int, dtype, device, max_tokens: int):
        self.layers, self.manager, self.device = layers, manager, device
        with manager.slot("graph"):
            for layer in layers:
                layer.reserve_workspace(max_tokens)
        manager.freeze()
        self.static_in, self.static_out, self.graphs = {}, {}, {}
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), manager.slot("graph"):
            for b in GRAPH_BUCKETS:
                x = torch.randn(b, hidden, device=device, dtype=dtype)
                self._stack(x)  # warm-up: compilation, configs
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    out = self._stack(x)
                self.static_in[b], self.static_out[b], self.graphs[b] = x, out, graph
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)

    def _stack(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        M = x.shape[0]
        bucket = next((b for b in GRAPH_BUCKETS if b >= M), None)
        if bucket is None:
            with self.manager.slot("graph"):
                return self._stack(x)
        self.static_in[bucket][:M].copy_(x)
        self.graphs[bucket].replay()
        return self.static_out[bucket][:M]


def run(
    cfg: Preset,
    *,
    steps: int,
    device: torch.device,
    dtype,
    backend: str,
    strategies=STRATEGIES,
    progress: bool = True,
) -> dict:
    layers, distinct = build_stack(cfg, device, dtype, backend)
    sizes = step_sizes(steps)
    gen = torch.Generator(device="cpu").manual_seed(1)
    inputs = {M: torch.randn(M, cfg.hidden_size, generator=gen).to(device=device, dtype=dtype) for M in set(sizes)}
    weights_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    rows, outputs = [], {}
    probe_M = min(m for m in sizes)
    for strategy in strategies:
        if strategy == GRAPHS and device.type != "cuda":
            continue
        manager = WorkspaceManager(device, strategy="shared" if strategy == GRAPHS else strategy)
        for layer in layers:
            layer.workspace = manager
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        if strategy == GRAPHS:
            forward = _GraphRunner(layers, manager, cfg.hidden_size, dtype, device, max(sizes))
        else:
            if strategy in ("shared", "per_layer"):
                for layer in layers:  # sized ahead for the largest batch of the run
                    layer.reserve_workspace(max(sizes))

            def forward(x, layers=layers):
                for layer in layers:
                    x = layer(x)
                return x

        for M in sorted(set(sizes)):  # warm-up: every batch size once (compilation, configs)
            forward(inputs[M])
        sync(device)
        s0, a0 = manager.stats.as_dict(), _allocator_allocs(device)
        decode_t, prefill_t, host = [], [], []
        it = _progress(sizes, f"{strategy:<14}") if progress else sizes
        for M in it:
            x = inputs[M]
            sync(device)
            t0 = time.perf_counter()
            forward(x)
            t1 = time.perf_counter()
            sync(device)
            t2 = time.perf_counter()
            (prefill_t if M > GRAPH_BUCKETS[-1] else decode_t).append((t2 - t0) * 1e6)
            if M <= 64:
                host.append((t1 - t0) * 1e6 / cfg.num_layers)
        s1, a1 = manager.stats.as_dict(), _allocator_allocs(device)
        outputs[strategy] = forward(inputs[probe_M]).clone()
        fills = _count_fill_kernels(lambda f=forward: f(inputs[probe_M]), device)
        arena = s1["reserved_bytes"] if strategy in ("shared", "per_layer", GRAPHS) else 0
        row = {
            "strategy": strategy,
            "decode_step_us": statistics.median(decode_t) if decode_t else None,
            "prefill_step_us": statistics.median(prefill_t) if prefill_t else None,
            "host_us_per_layer_m_le_64": statistics.median(host) if host else None,
            "manager_allocs_per_step": (s1["device_allocations"] - s0["device_allocations"]) / len(sizes),
            "allocator_allocs_per_step": (a1 - a0) / len(sizes),
            "fill_kernels_per_step": fills,
            "arena_bytes": arena,
            "largest_plan_bytes": s1["peak_bytes"],
            "peak_bytes_above_weights": (torch.cuda.max_memory_allocated(device) - weights_bytes)
            if device.type == "cuda"
            else None,
            "growths": s1["growths"],
            "bytes_zeroed_per_step": (s1["bytes_zeroed"] - s0["bytes_zeroed"]) / len(sizes),
        }
        rows.append(row)
        manager.unfreeze()
        del forward
    eager = [s for s in outputs if s != GRAPHS]
    identical = all(torch.equal(outputs[s], outputs[eager[0]]) for s in eager)
    return {
        "stack": {**{f: getattr(cfg, f) for f in STACK_FIELDS}, "routing": cfg.routing},
        "distinct_weight_layers": distinct,
        "steps": sizes,
        "strategies": rows,
        "eager_outputs_bit_identical": identical,
    }


def _progress(items, label):
    try:
        from rich.progress import track

        return track(items, description=label, transient=True)
    except ImportError:
        return items


COLUMNS = [
    "strategy",
    "decode step us",
    "prefill step us",
    "host us/layer (M<=64)",
    "mgr allocs/step",
    "allocator allocs/step",
    "fill kernels/step",
    "arena MB",
    "peak MB",
    "growths",
]


def table_rows(result: dict) -> list[list[object]]:
    mb = 1 / (1 << 20)
    return [
        [
            r["strategy"],
            r["decode_step_us"],
            r["prefill_step_us"],
            r["host_us_per_layer_m_le_64"],
            r["manager_allocs_per_step"],
            r["allocator_allocs_per_step"],
            r["fill_kernels_per_step"],
            r["arena_bytes"] * mb,
            None if r["peak_bytes_above_weights"] is None else r["peak_bytes_above_weights"] * mb,
            r["growths"],
        ]
        for r in result["strategies"]
    ]


def plot(result: dict, path: str) -> None:
    """Bars per strategy: arena and peak memory (MB), host us per layer, decode step time."""
    plt = report.pyplot()
    if plt is None:
        return
    rows = result["strategies"]
    names = [r["strategy"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    mb = 1 / (1 << 20)
    axes[0].bar(names, [r["arena_bytes"] * mb for r in rows], label="arena")
    axes[0].bar(names, [(r["peak_bytes_above_weights"] or 0) * mb for r in rows], alpha=0.4, label="peak above weights")
    axes[0].set_ylabel("MB")
    axes[0].legend()
    axes[1].bar(names, [r["host_us_per_layer_m_le_64"] or 0 for r in rows])
    axes[1].set_ylabel("host us per layer (eager issue, M <= 64)")
    axes[2].bar(names, [r["decode_step_us"] or 0 for r in rows])
    axes[2].set_ylabel("decode step us (median)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    st = result["stack"]
    fig.suptitle(f"{st['name']}: {st['num_layers']} MoE layers, {len(result['steps'])} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(args) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    name = args.preset or ("qwen3-30b-a3b" if device.type == "cuda" else None)
    if name is not None:
        p = PRESETS[name]
        cfg = replace(p, num_layers=args.layers or p.num_layers)
    else:  # CPU default: a small stack through the torch experts
        cfg = Preset("small-cpu", args.e or 16, args.k or 4, args.h or 256, args.i or 128, args.layers or 4)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = "auto"
    result = run(
        cfg, steps=args.steps or (48 if device.type == "cuda" else 8), device=device, dtype=dtype, backend=backend
    )
    env = report.environment()
    print(
        f"{env.get('gpu') or 'CPU'} | torch {env['torch']} | commit {env.get('commit')} | "
        f"{cfg.name}: {cfg.num_layers} layers ({result['distinct_weight_layers']} with distinct weights)"
    )
    report.print_table(
        f"decode steps over {len(result['steps'])} batch sizes, per workspace strategy", COLUMNS, table_rows(result)
    )
    print(f"eager strategies bit-identical: {result['eager_outputs_bit_identical']}")
    if args.json:
        report.save_json(args.json, {"env": env, **result})
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
    return 0
