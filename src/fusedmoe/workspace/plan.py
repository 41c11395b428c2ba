"""Workspace plans: what scratch a problem needs, when each buffer lives, and where it goes.

A plan is a pure function of the problem and its launch (M, H, I, E, top-k, dtype, quantization, layout,
tile sizes): no tensors, no device. Components (prepare/finalize, experts) each declare their buffers as
:class:`BufferSpec` without a lifetime; :class:`fusedmoe.steps.Program` assigns every lifetime from the steps
that actually name the buffer (a step can touch only the buffers its signature names), and lays the buffers
out in a single byte arena so that buffers whose lifetimes do not overlap share bytes (the seed PRs' "13" / "2"
pairing is one instance of this rule).

Lifetimes are closed intervals of *step indices* in execution order: a buffer is live from the first step that
names it to the last. Two buffers may alias only if their intervals are disjoint. Every plan checks this
invariant on its own layout (and on each caller region's layout) when it is built: no two buffers whose
lifetimes overlap share a byte.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import torch

#: Every offset in an arena is a multiple of this many bytes.
ALIGNMENT = 256


class PlanError(ValueError):
    """A plan that breaks its own rules (a buffer without a lifetime, two live buffers sharing bytes, ...)."""


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class BufferSpec:
    """One scratch buffer of a plan.

    Attributes:
        name: unique within a plan; the key under which the view is handed out and the parameter name by
            which a step asks for it.
        shape: tensor shape of the view (any dim may be 0).
        dtype: element type of the view.
        first, last: the lifetime, a closed interval of step indices (``last >= first``). Components leave
            them None; :class:`fusedmoe.steps.Program` sets them from the steps that name the buffer.
        zero: ``None`` if the buffer may start with garbage (the normal case), otherwise the reason why the
            whole buffer must be zero before the call; the manager zeroes it and counts the bytes.
        region: ``"13"`` or ``"2"``: which caller-provided workspace (``workspace13`` / ``workspace2``) the
            buffer goes to when the caller supplies both, following the seed PRs' pairing.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    first: int | None = None
    last: int | None = None
    zero: str | None = None
    region: str = "13"

    def __post_init__(self) -> None:
        if (self.first is None) != (self.last is None):
            raise ValueError(f"buffer {self.name!r}: give both first and last, or neither")
        if self.first is not None:
            object.__setattr__(self, "first", int(self.first))
            object.__setattr__(self, "last", int(self.last))
            if self.last < self.first:
                raise ValueError(f"buffer {self.name!r}: last step {self.last} precedes first {self.first}")
        if any(int(d) < 0 for d in self.shape):
            raise ValueError(f"buffer {self.name!r}: negative dimension in shape {self.shape}")
        if self.region not in ("13", "2"):
            raise ValueError(f"buffer {self.name!r}: region must be '13' or '2', got {self.region!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def live(self, first: int, last: int) -> BufferSpec:
        """This buffer with the lifetime [first, last]."""
        return replace(self, first=first, last=last)

    def overlaps_in_time(self, other: BufferSpec) -> bool:
        return self.first <= other.last and other.first <= self.last


@dataclass(frozen=True)
class Placement:
    """Where one buffer of a plan lives: byte offset (multiple of ALIGNMENT) in its region's arena."""

    spec: BufferSpec
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.spec.nbytes


def lay_out(specs: list[BufferSpec] | tuple[BufferSpec, ...]) -> tuple[dict[str, Placement], int]:
    """Place buffers in one arena so that buffers live at the same time never share a byte.

    Greedy interval colouring: buffers are placed largest first, each at the lowest aligned offset that does
    not collide with an already placed buffer whose lifetime overlaps. Deterministic for a given list.

    Returns:
        (placements by name, total bytes of the arena, a multiple of ALIGNMENT).
    """
    for spec in specs:
        if spec.first is None:
            raise PlanError(f"buffer {spec.name!r} has no lifetime: plans are built by fusedmoe.steps.Program")
    order = sorted(range(len(specs)), key=lambda i: (-specs[i].nbytes, int(specs[i].first), i))
    placed: list[Placement] = []
    for i in order:
        spec = specs[i]
        size = align_up(spec.nbytes)
        busy = sorted((p.offset, align_up(p.end)) for p in placed if p.spec.overlaps_in_time(spec) and p.spec.nbytes)
        offset = 0
        for start, stop in busy:
            if offset + size <= start:
                break
            offset = max(offset, stop)
        placed.append(Placement(spec, offset))
    total = max((align_up(p.end) for p in placed), default=0)
    placements = {p.spec.name: p for p in placed}
    check_layout(placements, total)
    return placements, total


def check_layout(placements: dict[str, Placement], total: int) -> None:
    """The plan invariant: every offset aligned, every buffer inside the arena, and no two buffers whose
    lifetimes overlap share a byte. Raises PlanError naming the pair."""
    for p in placements.values():
        if p.offset % ALIGNMENT or p.offset < 0 or align_up(p.end) > total:
            raise PlanError(f"buffer {p.spec.name!r} at {p.offset} +{p.spec.nbytes} is misplaced in {total} B")
    for a, b in itertools.combinations(placements.values(), 2):
        if (
            a.spec.nbytes
            and b.spec.nbytes
            and a.spec.overlaps_in_time(b.spec)
            and a.offset < b.end
            and b.offset < a.end
        ):
            raise PlanError(
                f"buffers {a.spec.name!r} (steps {a.spec.first}..{a.spec.last}) and {b.spec.name!r} (steps "
                f"{b.spec.first}..{b.spec.last}) are live together but share bytes"
            )


@dataclass(frozen=True)
class WorkspacePlan:
    """The merged scratch needs of one MoE call: buffers plus their layout in one arena.

    ``nbytes`` is what the arena must hold; ``region_nbytes`` what each caller-provided workspace must hold
    when the caller passes both ``workspace13`` and ``workspace2``. ``steps`` names the steps the lifetimes
    index (for :meth:`describe`).
    """

    buffers: tuple[BufferSpec, ...]
    steps: tuple[str, ...] = ()
    placements: dict[str, Placement] = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False)
    zero_nbytes: int = field(init=False, repr=False, compare=False)  # bytes the manager zeroes per call

    def __post_init__(self) -> None:
        names = [b.name for b in self.buffers]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"workspace plan has duplicate buffer names: {sorted(dup)}")
        placements, total = lay_out(self.buffers)
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "nbytes", total)
        object.__setattr__(self, "zero_nbytes", sum(b.nbytes for b in self.buffers if b.zero is not None))

    @property
    def sum_nbytes(self) -> int:
        """Bytes the buffers would take without aliasing (each aligned)."""
        return sum(align_up(b.nbytes) for b in self.buffers)

    def region(self, region: str) -> tuple[dict[str, Placement], int]:
        """Layout of the buffers of one caller region ("13" or "2") on their own."""
        return lay_out([b for b in self.buffers if b.region == region])

    @property
    def region_nbytes(self) -> dict[str, int]:
        return {r: self.region(r)[1] for r in ("13", "2")}

    def describe(self) -> str:
        rows = [f"plan: {self.nbytes} B arena ({self.sum_nbytes} B without aliasing)"]
        if self.steps:
            rows.append("  steps: " + " -> ".join(f"{i}:{n}" for i, n in enumerate(self.steps)))
        for b in self.buffers:
            p = self.placements[b.name]
            z = f" zero: {b.zero}" if b.zero else ""
            live = (
                f"{self.steps[b.first]}..{self.steps[b.last]}" if len(self.steps) > b.last else f"{b.first}..{b.last}"
            )
            rows.append(
                f"  {b.name:<14} {str(tuple(b.shape)):<20} {str(b.dtype):<22} [{live}] @ {p.offset} +{b.nbytes}{z}"
            )
        return "\n".join(rows)
