"""Alignment op alone, timed inside a CUDA graph (10 calls per graph, each with its own topk_ids)."""

from __future__ import annotations

import torch

from . import report, timing

CALLS = 10


def run(tokens: list[int], num_experts: int = 128, top_k: int = 8, block_m: int = 16) -> list[dict[str, object]]:
    from ...ops.align import align_params, moe_align

    device = torch.device("cuda")
    results = []
    for M in tokens:
        gen = torch.Generator(device=device).manual_seed(M)
        ids = [
            torch.rand(M, num_experts, device=device, generator=gen).argsort(dim=1)[:, :top_k].to(torch.int32)
            for _ in range(CALLS)
        ]
        p = align_params(M * top_k, num_experts, block_m)
        bufs = [
            dict(
                sorted_ids=torch.empty(p.max_padded, dtype=torch.int32, device=device),
                block_expert=torch.empty(p.max_blocks, dtype=torch.int32, device=device),
                num_padded=torch.empty(1, dtype=torch.int32, device=device),
                partial=torch.empty(p.partial_shape, dtype=torch.int32, device=device),
            )
            for _ in range(CALLS)
        ]
        calls = [(lambda i=i, b=b: moe_align(i, num_experts, block_m, **b)) for i, b in zip(ids, bufs, strict=True)]
        us = timing.graph_time_us(calls, replays=50)
        results.append(
            {"M": M, "E": num_experts, "top_k": top_k, "block_m": block_m, "us": us, "launches": 1 if p.fused else 2}
        )
    report.print_table(
        f"alignment alone (E={num_experts}, k={top_k}, BLOCK_M={block_m}), us per call in a CUDA graph",
        ["M", "us", "launches"],
        [[r["M"], r["us"], r["launches"]] for r in results],
    )
    return results
