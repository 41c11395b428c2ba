"""Workspace plans: what scratch a problem needs, when each buffer lives, and where it goes.

A plan is a pure function of the problem (M, H, I, E, top-k, dtype, quantization, layout): no tensors, no
device. Components (prepare/finalize, experts) each return a list of :class:`BufferSpec`; the kernel merges
them into one :class:`WorkspacePlan`, which lays the buffers out in a single byte arena so that buffers whose
lifetimes do not overlap share bytes (the seed PRs' "13" / "2" pairing is one instance of this rule).

Lifetimes are measured in *phases* (:class:`Phase`): a buffer is live from the phase in which it is first
written to the phase in which it is last read, both inclusive. Two buffers may alias only if their phase
intervals are disjoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

import torch

#: Every offset in an arena is a multiple of this many bytes.
ALIGNMENT = 256


class Phase(IntEnum):
    """The ordered stages of one MoE call; buffer lifetimes are intervals over these."""

    PREPARE = 0  # input quantization, dispatch
    ALIGN = 1  # sort tokens by expert, padding
    GATHER = 2  # gather token rows (torch experts)
    GEMM1 = 3  # gate/up projection (+ fused activation in Triton)
    ACTIVATION = 4  # activation and GEMM1-output quantization
    GEMM2 = 5  # down projection (+ routing weight)
    REDUCE = 6  # un-permute and reduce over top-k
    FINALIZE = 7  # combine (EP), write the layer output


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class BufferSpec:
    """One scratch buffer of a plan.

    Attributes:
        name: unique within a plan; the key under which the view is handed out.
        shape: tensor shape of the view (any dim may be 0).
        dtype: element type of the view.
        first: phase in which the buffer is first written.
        last: phase in which it is last read (``last >= first``).
        zero: ``None`` if the buffer may start with garbage (the normal case), otherwise the reason why the
            whole buffer must be zero before the call; the manager zeroes it and counts the bytes.
        region: ``"13"`` or ``"2"``: which caller-provided workspace (``workspace13`` / ``workspace2``) the
            buffer goes to when the caller supplies both, following the seed PRs' pairing.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    first: Phase
    last: Phase
    zero: str | None = None
    region: str = "13"

    def __post_init__(self) -> None:
        if int(self.last) < int(self.first):
            raise ValueError(f"buffer {self.name!r}: last phase {self.last!r} precedes first {self.first!r}")
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
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def overlaps_in_time(self, other: BufferSpec) -> bool:
        return int(self.first) <= int(other.last) and int(other.first) <= int(self.last)


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
    return {p.spec.name: p for p in placed}, total


@dataclass(frozen=True)
class WorkspacePlan:
    """The merged scratch needs of one MoE call: buffers plus their layout in one arena.

    ``nbytes`` is what the arena must hold; ``region_nbytes`` what each caller-provided workspace must hold
    when the caller passes both ``workspace13`` and ``workspace2``.
    """

    buffers: tuple[BufferSpec, ...]
    placements: dict[str, Placement] = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        names = [b.name for b in self.buffers]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"workspace plan has duplicate buffer names: {sorted(dup)}")
        placements, total = lay_out(self.buffers)
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "nbytes", total)

    @classmethod
    def merge(cls, *parts: list[BufferSpec] | tuple[BufferSpec, ...]) -> WorkspacePlan:
        return cls(tuple(b for part in parts for b in part))

    @property
    def sum_nbytes(self) -> int:
        """Bytes the buffers would take without aliasing (each aligned)."""
        return sum(align_up(b.nbytes) for b in self.buffers)

    @property
    def zero_nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers if b.zero is not None)

    def region(self, region: str) -> tuple[dict[str, Placement], int]:
        """Layout of the buffers of one caller region ("13" or "2") on their own."""
        return lay_out([b for b in self.buffers if b.region == region])

    @property
    def region_nbytes(self) -> dict[str, int]:
        return {r: self.region(r)[1] for r in ("13", "2")}

    def describe(self) -> str:
        rows = [f"plan: {self.nbytes} B arena ({self.sum_nbytes} B without aliasing)"]
        for b in self.buffers:
            p = self.placements[b.name]
            z = f" zero: {b.zero}" if b.zero else ""
            rows.append(
                f"  {b.name:<14} {str(tuple(b.shape)):<20} {str(b.dtype):<22} "
                f"[{b.first.name}..{b.last.name}] @ {p.offset} +{b.nbytes}{z}"
            )
        return "\n".join(rows)
