"""The training forward of a layer the compiler cannot trace, run outside the compiled graph.

Its own module because ``torch.compiler.disable`` imports ``torch._dynamo``: imported only from a compiling
forward (where dynamo is loaded already), never when fusedmoe is imported. An eager expert-parallel forward that
imported dynamo would keep its process group alive past ``destroy_process_group`` (tests/test_ep_gloo.py).
"""

from __future__ import annotations

import torch


@torch.compiler.disable
def forward_train_outside_graph(layer, hidden_states: torch.Tensor, router_logits: torch.Tensor | None) -> torch.Tensor:
    """``layer._forward_train(hidden_states, router_logits)`` (a :class:`~fusedmoe.FusedMoE`) as a graph break: the
    training forward of an expert-parallel or batched-layout layer, whose exchange sizes are host values."""
    return layer._forward_train(hidden_states, router_logits)
