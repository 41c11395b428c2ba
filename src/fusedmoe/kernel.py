"""MoEKernel: prepare -> experts -> finalize, with every byte of scratch from one planned workspace."""

from __future__ import annotations

import torch

from .experts.base import Experts, ExpertsInputs
from .prepare_finalize.base import PrepareFinalize
from .problem import MoEProblem
from .workspace.manager import Workspace, WorkspaceManager, caller_workspace
from .workspace.plan import WorkspacePlan


class MoEKernel:
    """The modular MoE kernel.

    ``plan(p)`` merges the scratch needs of prepare/finalize and the experts into one :class:`WorkspacePlan`
    (cached per problem). ``__call__`` takes the workspace from a manager (or the caller's tensors), runs the
    three stages and returns a fresh output tensor [M, H] (never a workspace view: it outlives the next call).
    """

    #: With no tokens there is nothing to compute; an expert-parallel rank must still run its collectives.
    skip_empty = True

    def __init__(self, prepare_finalize: PrepareFinalize, experts: Experts):
        if prepare_finalize.layout != experts.layout:
            raise ValueError(
                f"prepare/finalize layout {prepare_finalize.layout.value} does not match "
                f"experts layout {experts.layout.value}"
            )
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self._plans: dict[MoEProblem, WorkspacePlan] = {}
        self._unsupported: dict[MoEProblem, str | None] = {}

    def __repr__(self) -> str:
        return f"MoEKernel({type(self.prepare_finalize).__name__}, {type(self.experts).__name__})"

    def unsupported(self, p: MoEProblem) -> str | None:
        """Why the experts cannot run ``p`` (None if they can); cached per problem, it is on the hot path."""
        try:
            return self._unsupported[p]
        except KeyError:
            reason = self._unsupported[p] = self.experts.supports(p)
            return reason

    def plan(self, p: MoEProblem) -> WorkspacePlan:
        plan = self._plans.get(p)
        if plan is None:
            inner = self.prepare_finalize.problem(p)
            plan = WorkspacePlan.merge(self.prepare_finalize.plan(p), self.experts.plan(inner))
            if len(self._plans) > 4096:  # bound the cache under adversarial shape churn
                self._plans.clear()
            self._plans[p] = plan
        return plan

    def workspace(
        self,
        p: MoEProblem,
        x: ExpertsInputs,
        manager: WorkspaceManager,
        owner: object = None,
        workspace13: torch.Tensor | None = None,
        workspace2: torch.Tensor | None = None,
    ) -> Workspace:
        plan = self.plan(p)
        if workspace13 is None and workspace2 is None:
            return manager.acquire(plan, owner)
        ws = caller_workspace(
            plan,
            workspace13,
            workspace2,
            dtype=x.hidden_states.dtype,
            device=x.hidden_states.device,
            protected={
                name: getattr(x, name)
                for name in (
                    "hidden_states",
                    "w1",
                    "w2",
                    "topk_weights",
                    "topk_ids",
                    "expert_map",
                    "w1_scale",
                    "w2_scale",
                    "a1_scale",
                    "a2_scale",
                    "w1_bias",
                    "w2_bias",
                )
            },
        )
        for spec in plan.buffers:  # declared zero regions hold for caller memory too
            if spec.zero is not None and spec.nbytes:
                ws.views[spec.name].zero_()
        return ws

    def __call__(
        self,
        x: ExpertsInputs,
        p: MoEProblem,
        *,
        manager: WorkspaceManager,
        owner: object = None,
        workspace13: torch.Tensor | None = None,
        workspace2: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = x.hidden_states
        output = torch.empty((p.M, p.H), dtype=hidden.dtype, device=hidden.device)
        ws = self.workspace(p, x, manager, owner, workspace13, workspace2)
        if p.M == 0 and self.skip_empty:
            return output
        prepared = self.prepare_finalize.prepare(x, p, ws)
        inner = self.prepare_finalize.problem(p)
        expert_out = self.prepare_finalize.expert_output(output, inner, ws)
        self.experts.apply(expert_out, prepared, inner, ws)
        self.prepare_finalize.finalize(output, expert_out, x, p, ws)
        return output
