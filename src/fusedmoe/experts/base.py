"""The experts interface of the modular kernel: plan the scratch, then compute."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..problem import Layout, MoEProblem
from ..workspace.manager import Workspace
from ..workspace.plan import BufferSpec


@dataclass
class ExpertsInputs:
    """What prepare hands to the experts.

    Standard layout: ``hidden_states`` [M, H], ``topk_ids`` int32 [M, k], ``topk_weights`` float32 [M, k].
    Batched layout: ``hidden_states`` [E_local, max_tokens, H] and ``expert_num_tokens`` int32 [E_local] on the
    device (``topk_*`` then belong to finalize).
    ``expert_map``: int32 [global_E] or None. Scales as passed to ``fused_moe``.
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


class Experts(ABC):
    """One way of computing the experts. Never allocates scratch: everything comes from ``plan``.

    ``apply`` writes ``output``: for the standard layout the reduced layer output [M, H] (top-k already weighted
    and summed); for the batched layout the per-expert outputs [E_local, max_tokens, H] (finalize reduces).
    """

    #: short name used by ``backend=`` and the bench
    name: str = "experts"
    layout: Layout = Layout.STANDARD

    def supports(self, p: MoEProblem) -> str | None:
        """None if this implementation can run ``p``, else the reason it cannot."""
        return None

    @abstractmethod
    def plan(self, p: MoEProblem) -> list[BufferSpec]:
        """The scratch buffers ``apply`` will use for problem ``p`` (a pure function of ``p``)."""

    @abstractmethod
    def apply(self, output: torch.Tensor, x: ExpertsInputs, p: MoEProblem, ws: Workspace) -> None:
        """Compute the experts for ``x`` into ``output`` using only ``ws``'s views as scratch."""
