"""``fusedmoe bench train --ep 2,4``: one expert-parallel training step beside the single-process step.

For each world size W, W processes (``torch.multiprocessing`` spawn, a gloo group on the CPU) each hold an
expert-parallel ``FusedMoE(..., ep_group=<the group>)`` (E / W experts, float32, the torch experts) and run one
training step per repeat on ``tokens`` rows of their own: forward, then the backward of ``(out * probe).sum()``
(gradients of the input, both expert weights and the router). One process with the whole layer runs the same step
on all ``W * tokens`` rows. Every process uses one thread, so a rank computes like the single process does, on
its share.

Per row: ms per step (the median over repeats; for EP the slowest rank's median: the step ends when every rank
is done), the part of it spent inside the exchange (the transport's collectives: counts, rows and ids in the
forward, the reversed row exchanges in the backward, measured around each call on the host), and the rest
(routing, gathers, the local experts, the weighted sum). On the CPU everything is host time: there is no
separate device. The NCCL path is the same code on GPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from ...transport import TorchDistributedTransport
from . import report, train

COLUMNS = ["shape", "world", "tokens/rank", "ms/step", "exchange ms", "compute ms", "vs 1 process"]


class TimedTransport:
    """A transport that adds the host seconds of every collective it forwards to ``seconds``."""

    def __init__(self, inner):
        self.inner, self.rank, self.world_size, self.seconds = inner, inner.rank, inner.world_size, 0.0

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0

    def exchange_counts(self, send_counts):
        return self._timed(self.inner.exchange_counts, send_counts)

    def all_to_all(self, output, input, send_splits, recv_splits):
        return self._timed(self.inner.all_to_all, output, input, send_splits, recv_splits)

    def max_int(self, value, device):
        return self._timed(self.inner.max_int, value, device)


def _layer(shape, ep_group=None):
    from ...layer import FusedMoE

    torch.manual_seed(0)
    s = shape
    layer = FusedMoE(s.num_experts, s.top_k, s.hidden, s.inter, backend="torch", ep_group=ep_group, **s.routing)
    return layer.requires_grad_(True)


def _step_ms(layer, x, probe, repeats, barrier=None, transport=None) -> tuple[list[float], list[float]]:
    """Per repeat: ms of one forward + backward, and ms of it inside ``transport``'s collectives."""
    steps, exchange = [], []
    for i in range(repeats + 2):  # two warm-up steps
        layer.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        if barrier is not None:
            barrier()
        before = transport.seconds if transport is not None else 0.0
        t0 = time.perf_counter()
        (layer(xi) * probe).sum().backward()
        elapsed = time.perf_counter() - t0
        if i >= 2:
            steps.append(elapsed * 1e3)
            exchange.append(((transport.seconds if transport is not None else 0.0) - before) * 1e3)
    return steps, exchange


def _worker(rank, world, init_file, shape, tokens, repeats, queue):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        transport = TimedTransport(TorchDistributedTransport(dist.group.WORLD))
        layer = _layer(shape, transport)
        g = torch.Generator().manual_seed(rank + 1)
        x = torch.randn(tokens, shape.hidden, generator=g)
        probe = torch.randn(tokens, shape.hidden, generator=g)
        steps, exchange = _step_ms(layer, x, probe, repeats, dist.barrier, transport)
        queue.put((rank, statistics.median(steps), statistics.median(exchange)))
    finally:
        dist.destroy_process_group()


def _single_process_ms(shape, tokens: int, repeats: int) -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer = _layer(shape)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(tokens, shape.hidden, generator=g)
        probe = torch.randn(tokens, shape.hidden, generator=g)
        return statistics.median(_step_ms(layer, x, probe, repeats)[0])
    finally:
        torch.set_num_threads(threads)


def run(worlds: list[int], shapes: list[str], tokens: int, repeats: int) -> list[dict]:
    """One row per (shape, world): the EP step at ``tokens`` rows per rank, after the one-process step on
    ``world * tokens`` rows (world 1)."""
    import torch.multiprocessing as mp

    rows = []
    ctx = mp.get_context("spawn")
    for name in shapes:
        shape = train.shape_of(name, tiny=True)
        for world in worlds:
            if shape.num_experts % world:
                raise SystemExit(f"--ep {world}: {name} has {shape.num_experts} experts, not a multiple of {world}")
            single = _single_process_ms(shape, world * tokens, repeats)
            rows.append(dict(shape=name, world=1, tokens=world * tokens, ms=single, exchange_ms=0.0, single_ms=single))
            queue = ctx.Queue()
            with tempfile.TemporaryDirectory() as d:
                args = (world, os.path.join(d, "init"), shape, tokens, repeats, queue)
                mp.spawn(_worker, args=args, nprocs=world, join=True)
            per_rank = [queue.get(timeout=120) for _ in range(world)]
            slowest = max(per_rank, key=lambda r: r[1])
            rows.append(
                dict(shape=name, world=world, tokens=tokens, ms=slowest[1], exchange_ms=slowest[2], single_ms=single)
            )
    return rows


def table_rows(rows: list[dict]) -> list[list[object]]:
    out = []
    for r in rows:
        ratio = r["ms"] / r["single_ms"] if r["world"] > 1 else None
        compute = r["ms"] - r["exchange_ms"]
        out.append([r["shape"], r["world"], r["tokens"], r["ms"], r["exchange_ms"], compute, ratio])
    return out


def main(args: argparse.Namespace) -> int:
    """``bench train --ep W,...``: the table of :func:`run` (and its JSON with --json)."""
    try:
        worlds = [int(w) for w in args.ep.split(",") if w.strip()]
    except ValueError:
        raise SystemExit(f"--ep must be comma-separated world sizes, got {args.ep!r}") from None
    if not worlds or any(w < 2 for w in worlds):
        raise SystemExit(f"--ep world sizes must be >= 2, got {args.ep!r}")
    from ..presets import PRESETS

    shapes = train._list(getattr(args, "shapes", None), train.SHAPES, PRESETS)
    tokens = (args.tokens or [64])[0]
    repeats = args.repeats or 10
    env = report.environment()
    print(f"CPU, gloo | torch {env['torch']} | commit {env.get('commit')} | one thread per process")
    rows = run(worlds, shapes, tokens, repeats)
    sizes = f"H={train.TINY_H}, I={train.TINY_I}"
    title = f"expert-parallel training step (forward + backward, float32, torch experts, {sizes}; median of {repeats})"
    report.print_table(title, COLUMNS, table_rows(rows))
    if args.json:
        report.save_json(args.json, {"env": env, "tokens_per_rank": tokens, "repeats": repeats, "ep": rows})
        print(f"wrote {args.json}")
    return 0
