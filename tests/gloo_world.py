"""Multi-process tests on the CPU: ``run_ranks(fn, world, *args)`` starts ``world`` processes
(``torch.multiprocessing`` spawn) in one gloo group, runs ``fn(rank, world, *args)`` on each and returns every
rank's result. ``fn`` must be a module-level function (the processes import it by name)."""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank, world, init_file, fn, args, queue):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        queue.put((rank, None, fn(rank, world, *args)))
    except Exception as exc:  # pragma: no cover - reported by the parent
        queue.put((rank, repr(exc), None))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args) -> dict[int, object]:
    """{rank: ``fn(rank, world, *args)``} from ``world`` processes of one gloo group; fails naming the rank whose
    function raised."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank_main, args=(world, os.path.join(d, "init"), fn, args, queue), nprocs=world, join=True)
    out = {}
    for _ in range(world):
        rank, error, result = queue.get(timeout=60)
        assert error is None, f"rank {rank} failed: {error}"
        out[rank] = result
    return out
