"""Per-kernel GPU time of one layer call (routing + fused call), from the torch profiler.

Answers "where do the microseconds go" without hardware counters: each kernel's average GPU time per call,
and the count of kernels, allocations and fill/zero kernels per call.
"""

from __future__ import annotations

import time

import torch

from . import report

FILL_NAMES = ("fill", "zero", "memset")


def kernel_breakdown(fn, iters: int = 20) -> list[dict[str, object]]:
    """Run ``fn`` ``iters`` times under the profiler; return kernels sorted by total GPU time."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        dev_us = getattr(evt, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(evt, "cuda_time_total", 0)
        if evt.device_type == torch.autograd.DeviceType.CUDA or (dev_us and evt.key.startswith(("_", "void"))):
            rows.append({"kernel": evt.key[:70], "calls_per_iter": evt.count / iters, "us_per_iter": dev_us / iters})
    rows.sort(key=lambda r: -r["us_per_iter"])
    return rows


def cpu_op_counts(fn, iters: int = 10) -> dict[str, float]:
    """Allocations (aten::empty*) and fill/zero ops per call, counted on the host side."""
    for _ in range(2):
        fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
    counts = {"allocs": 0.0, "fills": 0.0}
    for evt in prof.key_averages():
        if evt.key in ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::zeros", "aten::zeros_like"):
            counts["allocs"] += evt.count / iters
        if evt.key in ("aten::fill_", "aten::zero_", "aten::zeros", "aten::zeros_like"):
            counts["fills"] += evt.count / iters
    return counts


def step_profile(fn, device: torch.device, top: int = 6) -> dict[str, object]:
    """One call of ``fn`` under the profiler: is it bound by the host or the device, and what takes the device.

    Returns ``wall_ms`` (the call under the profiler, the device synchronized before and after: the profiler's own
    cost inflates it), ``device_ms`` (the sum of its kernels' GPU times; None on a CPU), ``kernels`` (how many ran)
    and ``top``: the ``top`` names with the most time (``{"name", "ms", "calls"}``), kernels by GPU time on CUDA,
    operators by their own CPU time on a CPU."""
    on_cuda = device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    if on_cuda:
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=acts) as prof:
        start = time.perf_counter()
        fn()
        if on_cuda:
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    timed = []  # (name, ms, calls)
    for evt in prof.key_averages():
        if on_cuda:
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(evt, "device_time_total", None)
            if us is None:
                us = getattr(evt, "cuda_time_total", 0)
        else:
            us = evt.self_cpu_time_total
        timed.append((evt.key, us / 1e3, evt.count))
    timed.sort(key=lambda t: -t[1])
    return {
        "wall_ms": wall_ms,
        "device_ms": sum(ms for _, ms, _ in timed) if on_cuda else None,
        "kernels": sum(calls for _, _, calls in timed) if on_cuda else None,
        "top": [{"name": name[:90], "ms": ms, "calls": calls} for name, ms, calls in timed[:top]],
    }


def print_breakdown(title: str, rows: list[dict[str, object]]) -> None:
    total = sum(r["us_per_iter"] for r in rows)
    report.print_table(
        f"{title}: {total:.1f} us of kernels per call",
        ["kernel", "calls/call", "us/call"],
        [[r["kernel"], r["calls_per_iter"], r["us_per_iter"]] for r in rows[:14]],
    )
