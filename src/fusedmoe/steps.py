"""Steps and programs: the order in which a call touches its scratch decides every buffer's lifetime.

A *step* is a plain function ``fn(c, <buffer>, <buffer>, ...)``. Its first parameter receives the call
context (:class:`Call`: problem, launch, inputs, output, host-side state); every other parameter is the name of
a scratch buffer and receives that buffer's view. A step has no other way to reach the workspace, so the
buffers a step can touch are exactly the ones its signature names. A parameter with a default (``= None``) is
optional: it receives None when the plan holds no buffer of that name (e.g. fp8 scratch in a bf16 call). A
fixed group of buffers that several steps hand on together (the batched scatter's fourteen) is named once:
``@step(group=NAMES)`` on ``fn(c, <buffer>, ..., *views)`` gives the trailing ``*views`` the views of ``NAMES``,
in that order.

A :class:`Program` is the ordered steps of one call (prepare/finalize's and the experts') together with the
buffers they declare. Lifetimes are *derived*, never written by hand: a buffer lives from the first step that
names it to the last one (both inclusive), so reordering steps or adding one re-derives every lifetime, and a
buffer used outside its lifetime cannot be expressed. Buffers that reach the experts inside the prepared
inputs, or that the experts write as their output, cross a component boundary inside tensors rather than by
name: prepare/finalize lists them in ``exports`` and they live across every experts step as well. With
``check=True`` (the manager's poison mode) the kernel verifies that claim at run time: a tensor handed across
the boundary, or left in a context's ``state``, that lies in the arena must lie inside an exported buffer.

Building a program runs the plan invariant (:func:`fusedmoe.workspace.plan.check_layout`): no two buffers whose
lifetimes overlap share a byte.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .workspace.plan import BufferSpec, PlanError, WorkspacePlan


@dataclass(frozen=True)
class Step:
    """One stage of a call: ``fn(c, *views)`` with the views of ``needs`` (None for a missing optional)."""

    name: str
    fn: Callable[..., None]
    needs: tuple[str, ...]
    optional: frozenset[str]


def step(fn: Callable[..., None] | None = None, *, group: Sequence[str] = ()):
    """Make a :class:`Step` of ``fn``; its parameters after the first name the buffers it touches, and with
    ``group`` (as ``@step(group=NAMES)``) a trailing ``*views`` parameter takes the buffers ``NAMES`` in order."""
    if fn is None:
        return lambda f: step(f, group=group)
    params = list(inspect.signature(fn).parameters.values())[1:]
    if group and params and params[-1].kind == params[-1].VAR_POSITIONAL:
        params.pop()
    elif group:
        raise TypeError(f"step {fn.__name__}: group= needs a trailing *views parameter to receive its buffers")
    for prm in params:
        if prm.kind not in (prm.POSITIONAL_ONLY, prm.POSITIONAL_OR_KEYWORD):
            raise TypeError(f"step {fn.__name__}: buffer parameter {prm.name!r} must be positional")
        if prm.default is not prm.empty and prm.default is not None:
            raise TypeError(f"step {fn.__name__}: optional buffer {prm.name!r} must default to None")
    return Step(
        name=fn.__name__.lstrip("_"),
        fn=fn,
        needs=(*(prm.name for prm in params), *group),
        optional=frozenset(prm.name for prm in params if prm.default is None),
    )


class Call:
    """What a step may use besides its buffers.

    Attributes:
        p: the problem as this component sees it (the experts see prepare's inner problem).
        launch: the experts' launch value (None for prepare/finalize and for experts without one).
        x: the inputs (:class:`~fusedmoe.experts.base.ExpertsInputs`); for the experts, what prepare handed over.
        out: where this component writes its result: the layer output for prepare/finalize, the experts'
            output (the layer output, or an exported buffer) for the experts.
        component: the prepare/finalize or experts object whose steps run (its settings).
        prepared: set by prepare's steps when the experts should see other inputs than ``x``.
        state: host-side values passed between steps of one component (counts, split lists, offsets).
            Never an arena view: views reach a step only through its parameters.
    """

    __slots__ = ("p", "launch", "x", "out", "component", "prepared", "state")

    def __init__(self, p, launch, x, out, component=None):
        self.p = p
        self.launch = launch
        self.x = x
        self.out = out
        self.component = component
        self.prepared = x
        self.state: dict[str, Any] = {}


class Program:
    """The steps of one call in execution order, and the plan whose lifetimes they imply.

    Args:
        prepare, experts, finalize: the three segments' steps.
        buffers: every buffer any step names (no lifetimes); each must be named by some step.
        exports: buffers that cross the prepare/experts/finalize boundary inside tensors; they live across
            the whole experts segment in addition to the steps that name them.

    Raises:
        PlanError: a step needs a buffer nobody declared, a declared buffer is named by no step, an export is
            not a buffer, or the layout breaks the plan invariant.
    """

    __slots__ = ("steps", "plan", "segments", "exports", "_calls")

    def __init__(
        self,
        prepare: Sequence[Step],
        experts: Sequence[Step],
        finalize: Sequence[Step],
        buffers: Sequence[BufferSpec],
        exports: Collection[str] = (),
    ):
        self.steps = (*prepare, *experts, *finalize)
        a, b = len(prepare), len(prepare) + len(experts)
        self.segments = (range(0, a), range(a, b), range(b, len(self.steps)))
        declared = {spec.name for spec in buffers}
        touched: dict[str, list[int]] = {}
        for i, s in enumerate(self.steps):
            for name in s.needs:
                if name in declared:
                    touched.setdefault(name, []).append(i)
                elif name not in s.optional:
                    raise PlanError(f"step {s.name!r} needs buffer {name!r}, which no component declares")
        unknown = set(exports) - declared
        if unknown:
            raise PlanError(f"exports {sorted(unknown)} are not buffers of the plan")
        self.exports = frozenset(exports)
        specs = []
        for spec in buffers:
            at = touched.get(spec.name)
            if not at:
                raise PlanError(f"buffer {spec.name!r} is declared but no step names it")
            at = list(at)
            if spec.name in self.exports and a < b:
                at += [a, b - 1]
            if spec.zero is not None:  # the manager zeroes it before the first step
                at.append(0)
            specs.append(spec.live(min(at), max(at)))
        self.plan = WorkspacePlan(tuple(specs), tuple(s.name for s in self.steps))
        # per segment: (step, its function, the buffer names it takes), prebuilt for the hot path
        self._calls = tuple(
            tuple((self.steps[i], self.steps[i].fn, self.steps[i].needs) for i in seg) for seg in self.segments
        )

    def run(self, segment: int, c: Call, views: dict[str, torch.Tensor], arena: torch.Tensor | None = None) -> None:
        """Run one segment's steps (0 prepare, 1 experts, 2 finalize) with ``views`` of this program's plan.

        With an ``arena`` given, verify after every step that ``c.state`` holds no view of it.
        """
        get = views.get
        for s, fn, needs in self._calls[segment]:
            fn(c, *[get(n) for n in needs])
            if arena is not None:
                for key, value in c.state.items():
                    if isinstance(value, torch.Tensor) and _inside(value, arena):
                        raise PlanError(
                            f"step {s.name!r} left an arena view in state[{key!r}]: "
                            "pass views between steps as named buffers"
                        )

    def check_exported(
        self, tensors: dict[str, torch.Tensor | None], views: dict[str, torch.Tensor], arena: torch.Tensor
    ) -> None:
        """Every tensor of ``tensors`` that lies in ``arena`` lies inside one exported buffer's view."""
        spans = [_span(views[n]) for n in self.exports if views[n].numel()]
        for what, t in tensors.items():
            if not isinstance(t, torch.Tensor) or not t.numel() or not _inside(t, arena):
                continue
            lo, hi = _span(t)
            if not any(s0 <= lo and hi <= s1 for s0, s1 in spans):
                raise PlanError(
                    f"{what} crosses the prepare/experts/finalize boundary inside the arena but is "
                    "not in an exported buffer: add its buffer to exports"
                )


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return start, start + extent * t.element_size()


def _inside(t: torch.Tensor, arena: torch.Tensor) -> bool:
    if t.device != arena.device or not t.numel():
        return False
    lo, hi = _span(t)
    a0, a1 = _span(arena)
    return a0 <= lo < a1


__all__ = ["Call", "Program", "Step", "step"]
