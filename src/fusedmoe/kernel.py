"""MoEKernel: prepare -> experts -> finalize, with every byte of scratch from one planned workspace."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from .experts.base import Experts, ExpertsInputs
from .ops import launcher
from .ops.launcher import UNSEEN, Replays
from .prepare_finalize.base import PrepareFinalize
from .problem import MoEProblem
from .route_stage import ROUTED, route_buffers, route_step
from .steps import Call, Program
from .workspace.manager import Workspace, WorkspaceManager, caller_workspace, current_stream
from .workspace.plan import WorkspacePlan


def _roots(x: ExpertsInputs) -> tuple[torch.Tensor | None, ...]:
    """The per-call tensors a recorded trace addresses (the output follows them)."""
    return (
        x.hidden_states,
        x.w1,
        x.w2,
        x.topk_weights,
        x.topk_ids,
        x.expert_map,
        x.expert_num_tokens,
        x.w1_scale,
        x.w2_scale,
        x.a1_scale,
        x.a2_scale,
        x.w1_bias,
        x.w2_bias,
        x.router_logits,
        x.correction_bias,
        x.router_weight,
        x.router_bias,
    )


def _stream(t: torch.Tensor) -> int:
    return current_stream(t.device.index) if t.is_cuda else 0


#: Inputs a caller workspace must not overlap.
_PROTECTED = (
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


class MoEKernel:
    """The modular MoE kernel.

    ``program(p)`` assembles prepare's, the experts' and finalize's steps for problem ``p`` and the experts'
    launch for it (:meth:`Experts.launch`) into one :class:`~fusedmoe.steps.Program`, whose plan takes its
    lifetimes from the steps; programs are cached by ``(problem, launch)``. ``__call__`` takes the workspace from
    a manager (or the caller's tensors), runs the three segments and returns a fresh output tensor [M, H]
    (never a workspace view: it outlives the next call). In poison mode it also checks that arena views cross
    component boundaries only inside exported buffers.
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
        self._programs: dict[tuple[MoEProblem, Hashable], tuple[Program, MoEProblem]] = {}
        self._unsupported: dict[MoEProblem, str | None] = {}
        self.traces = Replays()  # by (program, layout key)

    def __repr__(self) -> str:
        return f"MoEKernel({type(self.prepare_finalize).__name__}, {type(self.experts).__name__})"

    def unsupported(self, p: MoEProblem) -> str | None:
        """Why the experts cannot run ``p`` (None if they can); cached per problem, it is on the hot path."""
        try:
            return self._unsupported[p]
        except KeyError:
            reason = self._unsupported[p] = self.experts.supports(self.prepare_finalize.problem(p))
            return reason

    def program(self, p: MoEProblem) -> tuple[Program, MoEProblem, Hashable]:
        """(program, the experts' problem, the experts' launch) of ``p``; cached by (problem, launch)."""
        pf, ex = self.prepare_finalize, self.experts
        inner = pf.problem(p)
        launch = ex.launch(inner)
        key = (p, launch)
        hit = self._programs.get(key)
        if hit is None:
            prepare, buffers, exports = (
                pf.prepare_steps(p),
                [*pf.buffers(p), *ex.buffers(inner, launch)],
                tuple(pf.exports(p)),
            )
            if p.routing is not None and p.M > 0:
                if prepare:
                    raise ValueError(f"{type(pf).__name__} routes outside the kernel: give it topk_weights/topk_ids")
                prepare, buffers, exports = [route_step], [*route_buffers(p), *buffers], (*ROUTED, *exports)
            prog = Program(prepare, ex.steps(inner, launch), pf.finalize_steps(p), buffers, exports)
            if len(self._programs) > 4096:  # bound the cache under adversarial shape churn
                self._programs.clear()
            hit = self._programs[key] = (prog, inner)
        return hit[0], hit[1], launch

    def plan(self, p: MoEProblem) -> WorkspacePlan:
        """The workspace plan of one call of ``p`` (under the launch configuration in effect now)."""
        return self.program(p)[0].plan

    def workspace(
        self,
        plan: WorkspacePlan,
        x: ExpertsInputs,
        manager: WorkspaceManager,
        owner: object = None,
        workspace13: torch.Tensor | None = None,
        workspace2: torch.Tensor | None = None,
    ) -> Workspace:
        if workspace13 is None and workspace2 is None:
            return manager.acquire(plan, owner)
        ws = caller_workspace(
            plan,
            workspace13,
            workspace2,
            dtype=x.hidden_states.dtype,
            device=x.hidden_states.device,
            protected={name: getattr(x, name) for name in _PROTECTED},
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
        layout_key: Hashable | None = None,
    ) -> torch.Tensor:
        """Run ``p`` on ``x`` and return a fresh output [M, H].

        ``layout_key`` (from :func:`fusedmoe.signature.input_signature` of ``x``'s tensors) lets the call be
        replayed: the first call of a (program, layout_key) runs the steps under a
        :class:`~fusedmoe.ops.launcher.Recorder`; later calls reissue the recorded launches with the new
        pointers when the recorder found the run replayable (only Triton launches on roots and arena views).
        Calls with caller workspaces, a poisoning manager, zero-requiring buffers or a ``preact`` output always run
        the steps.
        """
        hidden = x.hidden_states
        output = torch.empty((p.M, p.H), dtype=hidden.dtype, device=hidden.device)
        compiled = self.program(p)
        plan = compiled[0].plan
        if p.M == 0 and self.skip_empty:
            self.workspace(plan, x, manager, owner, workspace13, workspace2)  # validated and counted like any call
            return output
        if (
            layout_key is not None
            and x.preact is None
            and launcher.ENABLED
            and workspace13 is None
            and workspace2 is None
            and manager.replayable
            and not plan.zero_nbytes
        ):
            key = (compiled[0], layout_key)
            trace = self.traces.get(key)
            if trace is not UNSEEN and trace is not None and trace.ready():
                trace((*_roots(x), output), manager.arena_for(plan, owner), _stream(hidden))
                return output
            ws = manager.acquire(plan, owner)
            if trace is UNSEEN:
                self.traces.record(
                    key, lambda: self._run(compiled, x, p, ws, output, False), (*_roots(x), output), ws.arena
                )
            else:
                self._run(compiled, x, p, ws, output, False)
            return output
        ws = self.workspace(plan, x, manager, owner, workspace13, workspace2)
        self._run(compiled, x, p, ws, output, manager.poison)  # boundary checks ride along with poison runs
        return output

    def replay_reason(self, p: MoEProblem, layout_key: Hashable) -> str | None:
        """Why calls of ``p`` with ``layout_key`` are not replayed (None if they are)."""
        return self.traces.reason((self.program(p)[0], layout_key))

    def run(self, x: ExpertsInputs, p: MoEProblem, ws: Workspace, output: torch.Tensor, *, check: bool = False) -> None:
        """Run the three segments of ``p``'s program on the views of ``ws`` (a workspace for ``self.plan(p)``),
        writing ``output`` [M, H]. With ``check`` and an arena behind ``ws``, verify that arena views cross
        component boundaries only inside exported buffers and never sit in a step context's ``state``."""
        self._run(self.program(p), x, p, ws, output, check)

    def _run(self, compiled, x: ExpertsInputs, p: MoEProblem, ws: Workspace, output: torch.Tensor, check: bool) -> None:
        prog, inner, launch = compiled
        views = ws.views
        arena = ws.arena if check else None
        pf = Call(p, None, x, output, self.prepare_finalize)
        prog.run(0, pf, views, arena)
        expert_out = self.prepare_finalize.expert_output(output, inner, ws)
        if arena is not None:
            prog.check_exported({**pf.prepared.tensors(), "expert output": expert_out}, views, arena)
        prog.run(1, Call(inner, launch, pf.prepared, expert_out, self.experts), views, arena)
        prog.run(2, pf, views, arena)
