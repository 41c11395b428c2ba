"""The prepare/finalize interface of the modular kernel."""

from __future__ import annotations

import torch

from ..problem import Layout, MoEProblem
from ..steps import Step
from ..workspace.manager import Workspace
from ..workspace.plan import BufferSpec


class PrepareFinalize:
    """Brings tokens to the experts and their results back.

    Prepare's steps may set ``c.prepared`` (the inputs the experts run on: dispatched to other ranks or
    scattered into the batched layout; default: the caller's inputs); :meth:`expert_output` says where the
    experts write; finalize's steps turn that into the layer output [M, H] (weight-and-reduce if the experts
    did not, combine across ranks). Buffers that reach the experts inside ``c.prepared`` or as the expert
    output are listed by :meth:`exports`.
    """

    layout: Layout = Layout.STANDARD

    def buffers(self, p: MoEProblem) -> list[BufferSpec]:
        """Scratch buffers (no lifetimes) of prepare/finalize for problem ``p`` (none by default)."""
        return []

    def problem(self, p: MoEProblem) -> MoEProblem:
        """The problem the experts see after prepare (the same one unless tokens move between ranks)."""
        return p

    def prepare_steps(self, p: MoEProblem) -> list[Step]:
        return []

    def finalize_steps(self, p: MoEProblem) -> list[Step]:
        return []

    def exports(self, p: MoEProblem) -> tuple[str, ...]:
        """Buffers handed to the experts inside ``c.prepared`` or as the expert output."""
        return ()

    def expert_output(self, output: torch.Tensor, inner: MoEProblem, ws: Workspace) -> torch.Tensor:
        """Where the experts write (an exported buffer's view, or the layer output itself)."""
        return output
