"""Workspace strategies side by side: the same stack of layers, the same inputs, one strategy at a time.

Reports per strategy: time per layer call, device allocations and bytes zeroed per call (from the manager's
stats), arena bytes held, growths, and whether the outputs are bit-identical to the first strategy's.
"""

from __future__ import annotations

import statistics
import time

import torch

from ...api import fused_moe
from ...layer import FusedMoE
from ...workspace.manager import STRATEGIES, WorkspaceManager
from ..presets import Preset
from .timing import sync

CALLER = "caller"
#: The stack's shape as the JSON result describes it (fields of the preset).
SHAPE_FIELDS = ("num_experts", "top_k", "hidden_size", "intermediate_size", "num_layers")


def build_stack(shape: Preset, device, dtype, backend: str) -> list[FusedMoE]:
    torch.manual_seed(0)
    return [shape.routed_layer(dtype=dtype, device=device, backend=backend) for _ in range(shape.num_layers)]


def _caller_buffers(layers: list[FusedMoE], max_tokens: int, dtype, device):
    """One workspace13/workspace2 pair sized for the largest layer plan, reused by every layer."""
    need13 = max(layer.plan(max_tokens, dtype).region_nbytes["13"] for layer in layers)
    need2 = max(layer.plan(max_tokens, dtype).region_nbytes["2"] for layer in layers)
    return (
        torch.empty(need13 + 16, dtype=torch.uint8, device=device),
        torch.empty(need2 + 16, dtype=torch.uint8, device=device),
    )


def run(
    shape: Preset,
    tokens: list[int],
    *,
    steps: int,
    device: torch.device,
    dtype: torch.dtype,
    backend: str,
    strategies: tuple[str, ...] = (*STRATEGIES, CALLER),
) -> list[dict[str, object]]:
    layers = build_stack(shape, device, dtype, backend)
    gen = torch.Generator(device="cpu").manual_seed(1)
    inputs = [torch.randn(M, shape.hidden_size, generator=gen).to(device=device, dtype=dtype) for M in tokens]
    results: list[dict[str, object]] = []
    reference_outputs = None
    for strategy in strategies:
        manager = None if strategy == CALLER else WorkspaceManager(device, strategy=strategy)
        ws13 = ws2 = None
        if strategy == CALLER:
            ws13, ws2 = _caller_buffers(layers, max(tokens), dtype, device)
        for layer in layers:
            layer.workspace = manager

        def forward(x: torch.Tensor, strategy=strategy, ws13=ws13, ws2=ws2) -> torch.Tensor:
            for layer in layers:
                if strategy == CALLER:
                    w, ids = layer.route(x)
                    x = fused_moe(
                        x, layer.w1, layer.w2, w, ids, workspace13=ws13, workspace2=ws2, backend=layer.backend
                    )
                else:
                    x = layer(x)
            return x

        outputs = [forward(x) for x in inputs]  # warm-up; also the outputs we compare
        sync(device)
        before = manager.stats.as_dict() if manager else None
        times = []
        calls = 0
        for step in range(steps):
            x = inputs[step % len(inputs)]
            sync(device)
            t0 = time.perf_counter()
            forward(x)
            sync(device)
            times.append((time.perf_counter() - t0) / len(layers))
            calls += len(layers)
        after = manager.stats.as_dict() if manager else None
        identical = None
        if reference_outputs is None:
            reference_outputs = outputs
        else:
            identical = all(torch.equal(a, b) for a, b in zip(outputs, reference_outputs))
        row: dict[str, object] = {
            "strategy": strategy,
            "us_per_layer": statistics.median(times) * 1e6,
            "allocs_per_call": (after["device_allocations"] - before["device_allocations"]) / calls if manager else 0.0,
            "zeroed_bytes_per_call": (after["bytes_zeroed"] - before["bytes_zeroed"]) / calls if manager else 0.0,
            "arena_bytes": (
                after["reserved_bytes"]
                if manager and strategy in ("shared", "per_layer")
                else (ws13.numel() + ws2.numel() if strategy == CALLER else 0)
            ),
            "peak_plan_bytes": after["peak_bytes"] if manager else None,
            "growths": after["growths"] if manager else 0,
            "bit_identical": identical,
        }
        results.append(row)
    return results


COLUMNS = [
    "strategy",
    "us/layer",
    "allocs/call",
    "zeroed B/call",
    "arena B",
    "peak plan B",
    "growths",
    "same output",
]


def table_rows(results: list[dict[str, object]]) -> list[list[object]]:
    return [
        [
            r["strategy"],
            r["us_per_layer"],
            r["allocs_per_call"],
            r["zeroed_bytes_per_call"],
            r["arena_bytes"],
            r["peak_plan_bytes"],
            r["growths"],
            {None: "(baseline)", True: "bitwise", False: "DIFFERS"}[r["bit_identical"]],
        ]
        for r in results
    ]
