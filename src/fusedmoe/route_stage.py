"""Routing as the first step of a program: router logits in, top-k weights and ids in workspace buffers out.

A problem with ``routing`` (:class:`~fusedmoe.problem.Routing`) carries the router logits ``[M, E]`` in its
inputs instead of ``topk_weights`` / ``topk_ids``. :func:`route_step` runs before prepare's own steps: it writes
``topk_weights`` float32 and ``topk_ids`` int32 ``[M, k]`` into two planned buffers (exported, so they live
until the experts are done) and hands the experts inputs that point at them. The top-k then costs no
allocation, and the routing launch is part of the call's recorded trace (:mod:`fusedmoe.ops.launcher`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .problem import MoEProblem
from .routing import fused_routing_applies, route
from .steps import step
from .workspace.plan import BufferSpec

#: The buffers the routing step writes (exported across the prepare/experts boundary).
ROUTED = ("topk_weights", "topk_ids")


def route_buffers(p: MoEProblem) -> list[BufferSpec]:
    return [
        BufferSpec("topk_weights", (p.M, p.top_k), torch.float32),
        BufferSpec("topk_ids", (p.M, p.top_k), torch.int32),
    ]


@step
def route_step(c, topk_weights, topk_ids):
    x, r, k = c.x, c.p.routing, c.p.top_k
    logits = x.router_logits
    kw = r.kwargs()
    if logits.is_cuda and fused_routing_applies(logits.shape[1], k, r.num_expert_groups, r.topk_groups):
        from .ops.routing import route_fused

        route_fused(logits, k, correction_bias=x.correction_bias, weights=topk_weights, ids=topk_ids, **kw)
    else:
        w, i = route(logits, k, correction_bias=x.correction_bias, **kw)
        topk_weights.copy_(w)
        topk_ids.copy_(i)
    c.prepared = replace(c.prepared, topk_weights=topk_weights, topk_ids=topk_ids)


__all__ = ["ROUTED", "route_buffers", "route_step"]
