"""Standard layout on one rank: tokens stay where they are, the experts reduce over top-k themselves."""

from __future__ import annotations

import torch

from ..experts.base import ExpertsInputs
from ..problem import Layout, MoEProblem
from ..workspace.manager import Workspace
from .base import PrepareFinalize


class LocalPrepareFinalize(PrepareFinalize):
    """No expert parallelism, standard layout: prepare passes the inputs through, the experts write the output."""

    layout = Layout.STANDARD

    def prepare(self, x: ExpertsInputs, p: MoEProblem, ws: Workspace) -> ExpertsInputs:
        return x

    def expert_output(self, output: torch.Tensor, p: MoEProblem, ws: Workspace) -> torch.Tensor:
        return output

    def finalize(self, output, expert_output, x, p, ws) -> None:
        return None
