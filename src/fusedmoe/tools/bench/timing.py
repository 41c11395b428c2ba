"""GPU timing as the serving engines do it: calls captured in one CUDA graph, median over replays.

Each of the ``calls_per_graph`` captured calls gets its own inputs (e.g. its own router logits), so expert
weights are not served from L2 across calls. Eager timing (host + device, synchronized) exposes host cost.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

_STREAM: list[torch.cuda.Stream] = []


def _side_stream() -> torch.cuda.Stream:
    """One side stream for every warm-up and capture, so the workspace slot (keyed by stream) is reused."""
    if not _STREAM:
        _STREAM.append(torch.cuda.Stream())
    return _STREAM[0]


def sync(device: torch.device) -> None:
    """Wait until ``device`` has run everything queued on it (nothing to wait for off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_time_us(calls: list[Callable[[], object]], *, warmup_replays: int = 5, replays: int = 30) -> float:
    """Capture every function in ``calls`` once, in order, in one CUDA graph; return median us per call."""
    stream = _side_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # warm-up outside the graph (compilation, workspace growth)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for fn in calls:
            fn()
    for _ in range(warmup_replays):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def eager_time_us(calls: list[Callable[[], object]], *, repeats: int = 10) -> tuple[float, float]:
    """(median wall us per call with a sync after each call, median host-only us per call).

    Host-only time is measured by timing the Python side of the calls without waiting for the device
    (the device is synchronized before each batch so queues start empty)."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    wall, host = [], []
    for _ in range(repeats):
        for fn in calls:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            host.append((t1 - t0) * 1e6)
            wall.append((t2 - t0) * 1e6)
    return statistics.median(wall), statistics.median(host)
