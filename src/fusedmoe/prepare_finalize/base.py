"""The prepare/finalize interface of the modular kernel."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..experts.base import ExpertsInputs
from ..problem import Layout, MoEProblem
from ..workspace.manager import Workspace
from ..workspace.plan import BufferSpec


class PrepareFinalize(ABC):
    """Brings tokens to the experts and their results back.

    ``prepare`` returns the :class:`ExpertsInputs` the experts run on (possibly dispatched to other ranks or
    scattered into the batched layout); ``expert_output`` says where the experts write; ``finalize`` turns that
    into the layer output [M, H] (weight-and-reduce if the experts did not, combine across ranks).
    """

    layout: Layout = Layout.STANDARD

    def plan(self, p: MoEProblem) -> list[BufferSpec]:
        """Scratch buffers of prepare/finalize for problem ``p`` (none by default)."""
        return []

    def problem(self, p: MoEProblem) -> MoEProblem:
        """The problem the experts see after prepare (the same one unless tokens move between ranks)."""
        return p

    @abstractmethod
    def prepare(self, x: ExpertsInputs, p: MoEProblem, ws: Workspace) -> ExpertsInputs: ...

    @abstractmethod
    def expert_output(self, output: torch.Tensor, p: MoEProblem, ws: Workspace) -> torch.Tensor: ...

    @abstractmethod
    def finalize(
        self, output: torch.Tensor, expert_output: torch.Tensor, x: ExpertsInputs, p: MoEProblem, ws: Workspace
    ) -> None: ...
