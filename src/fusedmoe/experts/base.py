"""The experts interface of the modular kernel: declare scratch buffers and the steps that use them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, fields

import torch

from ..problem import Layout, MoEProblem
from ..steps import Step
from ..workspace.plan import BufferSpec


@dataclass
class ExpertsInputs:
    """What prepare hands to the experts.

    Standard layout: ``hidden_states`` [M, H], ``topk_ids`` int32 [M, k], ``topk_weights`` float32 [M, k].
    Batched layout: ``hidden_states`` [E_local, max_tokens, H] and ``expert_num_tokens`` int32 [E_local] on the
    device (``topk_*`` then belong to finalize).
    ``expert_map``: int32 [global_E] or None. Scales as passed to ``fused_moe``.
    ``router_logits`` [M, E] / ``correction_bias`` [E]: only for a problem with ``routing`` (the kernel routes;
    ``topk_*`` are then None until its routing step fills them). Such a problem may pass the router's
    ``router_weight`` [E, H] and ``router_bias`` [E] or None instead of the logits: the routing step then computes
    ``F.linear(hidden_states, router_weight, router_bias)`` itself (on CUDA in its own launch).
    ``preact`` [M*k, 2I]: training's saved GEMM1 output; the Triton experts write their raw GEMM1 accumulators
    into it (by slot) when given. Such calls are not replayed from a trace.
    """

    hidden_states: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor | None
    topk_ids: torch.Tensor | None
    expert_map: torch.Tensor | None = None
    expert_num_tokens: torch.Tensor | None = None
    w1_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    a1_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None
    w1_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    router_logits: torch.Tensor | None = None
    correction_bias: torch.Tensor | None = None
    router_weight: torch.Tensor | None = None
    router_bias: torch.Tensor | None = None
    preact: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """Every field by name (the tensors a component hands to the next)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Experts(ABC):
    """One way of computing the experts. Never allocates scratch: it declares buffers and the steps that use
    them, and the kernel derives lifetimes from the steps (:mod:`fusedmoe.steps`).

    The steps write ``c.out``: for the standard layout the reduced layer output [M, H] (top-k already weighted
    and summed); for the batched layout the per-expert outputs [E_local, max_tokens, H] (finalize reduces).
    """

    #: short name used by ``backend=`` and the bench
    name: str = "experts"
    layout: Layout = Layout.STANDARD

    def supports(self, p: MoEProblem) -> str | None:
        """None if this implementation can run ``p``, else the reason it cannot."""
        return None

    def launch(self, p: MoEProblem) -> Hashable | None:
        """Everything besides ``p`` that sizes scratch or picks kernels (tile sizes, code path), as one
        hashable value. Plans are cached by ``(problem, launch)``, so nothing that sizes a buffer may be left
        out of it. None for implementations without launch choices."""
        return None

    @abstractmethod
    def buffers(self, p: MoEProblem, launch: Hashable | None) -> list[BufferSpec]:
        """The scratch buffers (no lifetimes) the steps of ``p`` name; a pure function of its arguments."""

    @abstractmethod
    def steps(self, p: MoEProblem, launch: Hashable | None) -> list[Step]:
        """The steps of one call of ``p`` in execution order."""
