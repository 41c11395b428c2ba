"""Routing as the first step of a program: router logits in, top-k weights and ids in workspace buffers out.

A problem with ``routing`` (:class:`~fusedmoe.problem.Routing`) carries the router logits ``[M, E]`` in its
inputs instead of ``topk_weights`` / ``topk_ids``, or the router's weight and bias, whose logits the step then
computes (on CUDA inside the routing launch, :func:`fusedmoe.ops.routing.route_fused`). :func:`route_step` runs
before prepare's own steps: it writes ``topk_weights`` float32 and ``topk_ids`` int32 ``[M, k]`` into two planned
buffers (exported, so they live until the experts are done) and hands the experts inputs that point at them. The
top-k then costs no allocation, and the routing launch is part of the call's recorded trace
(:mod:`fusedmoe.ops.launcher`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

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


def gate_in_launch(hidden: torch.Tensor, gate: torch.Tensor, r) -> bool:
    """Whether the routing launch can compute ``hidden``'s logits with ``gate`` itself (``r``: the problem's
    :class:`~fusedmoe.problem.Routing`): what a layer checks before handing its kernel the router's weight, and
    the routing step again before it relies on that."""
    from .ops.routing import router_gemm_applies

    return (
        router_gemm_applies(hidden.shape[0], *gate.shape, r.num_expert_groups, hidden.dtype)
        and gate.dtype == hidden.dtype
        and hidden.stride(1) == 1
        and gate.is_contiguous()
    )


@step
def route_step(c, topk_weights, topk_ids):
    x, r, k = c.x, c.p.routing, c.p.top_k
    logits, kw, hidden = x.router_logits, r.kwargs(), x.hidden_states
    E = logits.shape[1] if logits is not None else x.router_weight.shape[0]
    fused = hidden.is_cuda and fused_routing_applies(E, k, r.num_expert_groups, r.topk_groups)
    if logits is None and not (fused and gate_in_launch(hidden, x.router_weight, r)):
        logits = F.linear(hidden, x.router_weight, x.router_bias)
    if fused:
        from .ops.routing import route_fused

        gemm = {} if logits is not None else {"hidden": hidden, "gate": x.router_weight, "gate_bias": x.router_bias}
        route_fused(logits, k, correction_bias=x.correction_bias, weights=topk_weights, ids=topk_ids, **gemm, **kw)
    else:
        w, i = route(logits, k, correction_bias=x.correction_bias, **kw)
        topk_weights.copy_(w)
        topk_ids.copy_(i)
    c.prepared = replace(c.prepared, topk_weights=topk_weights, topk_ids=topk_ids)


__all__ = ["ROUTED", "gate_in_launch", "route_buffers", "route_step"]
