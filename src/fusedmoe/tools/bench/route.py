"""route() alone inside a CUDA graph: the torch definition against the one-launch kernel's launch shapes."""

from __future__ import annotations

import torch

from . import report, timing

CALLS = 10


def run(tokens: list[int], num_experts: int = 128, top_k: int = 8) -> list[dict[str, object]]:
    from ...ops import routing as kernel
    from ...routing import route

    device = torch.device("cuda")
    variants = [
        ("torch", None, None),
        ("kernel", 1, 4),
        ("kernel", 4, 4),
        ("kernel", 16, 4),
        ("kernel", 4, 2),
        ("kernel", 8, 8),
    ]
    results = []
    for M in tokens:
        logits = [torch.randn(M, num_experts, device=device) for _ in range(CALLS)]
        for name, rows, warps in variants:
            kernel.ROUTE_ROWS, kernel.ROUTE_WARPS = rows, warps
            if name == "torch":
                calls = [(lambda lg=lg: _torch_route(lg, top_k)) for lg in logits]
            else:
                calls = [(lambda lg=lg: route(lg, top_k)) for lg in logits]
            us = timing.graph_time_us(calls, replays=30)
            results.append({"M": M, "variant": name, "rows": rows, "warps": warps, "us": us})
        kernel.ROUTE_ROWS = kernel.ROUTE_WARPS = None
    report.print_table(
        f"route() alone (E={num_experts}, k={top_k}, softmax + renormalize), us per call in a CUDA graph",
        ["M", "variant", "rows", "warps", "us"],
        [[r["M"], r["variant"], r["rows"], r["warps"], r["us"]] for r in results],
    )
    return results


def _torch_route(logits: torch.Tensor, top_k: int):
    """The torch definition of route() on the GPU (what route() ran before the kernel)."""
    w, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20), ids.to(torch.int32)
