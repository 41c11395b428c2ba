"""Host cost of the two call paths of one fused call: :func:`fusedmoe.fused_moe` (direct, what eager mode uses)
and :func:`fusedmoe.op.fused_moe_op` (the registered ``torch.ops.fusedmoe.fused_moe``, what ``torch.compile``
sees). Same problem, backend and workspace manager; the paths alternate within each repeat so drift hits both.

On the CPU every microsecond is host time (the tiny problem's compute is identical in both paths, so the
difference is the op's dispatch). On a GPU the kernel sweep's ``triton_op`` backend with ``--eager`` gives the
same comparison at real shapes.
"""

from __future__ import annotations

import statistics
import time

import torch

from ...api import fused_moe
from ...op import fused_moe_op
from ...routing import route
from ...workspace.manager import WorkspaceManager
from .timing import sync


def measure(
    device: torch.device | str = "cpu",
    *,
    backend: str = "torch",
    M: int = 1,
    E: int = 8,
    top_k: int = 2,
    H: int = 64,
    I: int = 32,
    dtype: torch.dtype = torch.float32,
    calls: int = 200,
    repeats: int = 7,
) -> dict[str, object]:
    """Median microseconds per call of each path (``direct_us``, ``op_us``), their difference (``op_extra_us``),
    and whether both paths gave bit-identical outputs (``identical``)."""
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(M, H, generator=g).to(device, dtype)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(device, dtype)
    weights, ids = route(torch.randn(M, E, generator=g).to(device), top_k)
    manager = WorkspaceManager(device, strategy="shared")
    paths = {
        "direct": lambda: fused_moe(x, w1, w2, weights, ids, workspace=manager, backend=backend),
        "op": lambda: fused_moe_op(x, w1, w2, weights, ids, workspace=manager, backend=backend),
    }
    outputs = {name: fn() for name, fn in paths.items()}  # warm-up (kernel caches, plan cache, arena)
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync(device)
            samples[name].append((time.perf_counter() - t0) * 1e6 / calls)
    direct, op = statistics.median(samples["direct"]), statistics.median(samples["op"])
    return {
        "backend": backend,
        "shape": dict(M=M, E=E, top_k=top_k, H=H, I=I, dtype=str(dtype)),
        "direct_us": direct,
        "op_us": op,
        "op_extra_us": op - direct,
        "identical": bool(torch.equal(outputs["direct"], outputs["op"])),
    }


COLUMNS = ["backend", "direct us/call", "registered op us/call", "op extra us", "identical"]


def table_rows(r: dict[str, object]) -> list[list[object]]:
    return [[r["backend"], r["direct_us"], r["op_us"], r["op_extra_us"], "yes" if r["identical"] else "NO"]]
