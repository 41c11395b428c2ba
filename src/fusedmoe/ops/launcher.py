"""Kernel launches that are recorded once per input signature and replayed without Triton's generic launcher.

Every Triton launch of fusedmoe goes through :func:`launch`, which is ``kernel[grid](*args, **kwargs)``.
``kernel[grid]`` binds and specializes every argument and computes a cache key on every call (~10 µs of host
time per launch); the compiled kernel's own launcher only packs the arguments (~2-4 µs).

A :class:`Recorder` active on the calling thread keeps, for each launch, the compiled kernel, the grid and the
full argument list, with every tensor argument described by *where it points*: a byte offset into one of the
caller's root tensors (the call's inputs and output) or into the workspace arena. :meth:`Recorder.trace` then
yields a :class:`Trace` that reissues the same launches for new roots and a new arena base: the integer
pointers are substituted, everything else (grid, scalars, constexprs, compiled binary) is reused.

A trace is only valid for calls whose every launch argument is the same function of the roots and the arena:
the caller keys traces by the problem, the launch configuration and the roots' shapes, strides, dtypes and
16-byte alignment (what Triton specializes on). The recorder refuses (``trace()`` returns None) when the run did
anything a replay would not redo: a tensor argument outside the roots and the arena (a temporary), a tensor
argument inside two roots, a torch operation that is not a view (a copy, a fill, a host sync), a grid computed
by a function. A trace does not replay while a Triton launch hook (a profiler's) is installed
(:meth:`Trace.ready`). Under the CPU interpreter a trace replays through ``kernel[grid]`` with tensor views
rebuilt at the recorded offsets, so the substitution logic is tested there too.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["ENABLED", "UNSEEN", "Recorder", "Replays", "Trace", "launch", "set_replay"]


#: Replay recorded traces (env ``FUSEDMOE_REPLAY=0`` turns it off: every call runs through ``kernel[grid]``).
ENABLED = os.environ.get("FUSEDMOE_REPLAY", "1") != "0"


def set_replay(enabled: bool) -> None:
    """Switch trace replay on or off for this process (recorded traces are kept)."""
    global ENABLED
    ENABLED = bool(enabled)


class _State(threading.local):
    recorder: Recorder | None = None


_state = _State()


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``; also recorded when a :class:`Recorder` is active on this thread."""
    rec = _state.recorder
    if rec is None:
        return kernel[grid](*args, **kwargs)
    with _disable_current_modes():  # the interpreter copies tensors with torch ops: not the call's own work
        compiled = kernel[grid](*args, **kwargs)
    rec.add(kernel, compiled, grid, args, kwargs)
    return compiled


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) if t.numel() else 0
    return start, start + extent * t.element_size()


class _PureViews(TorchDispatchMode):
    """Flags any torch operation that is not a view while the recorded run executes."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Otherwise torch wraps __torch_dispatch__ in torch._disable_dynamo, whose first call imports torch._dynamo:
        # ~0.7 s in a layer's first forward, and, after init_process_group, torch.distributed.nn's default
        # arguments then pin the default process group for the process's life (gloo aborts at exit). Nothing
        # compiles inside this mode.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.recorder.refuse(f"torch op {func} ran inside the call")
        return func(*args, **(kwargs or {}))


_PARAMS: dict[object, tuple[tuple[str, object], ...]] = {}


def _params(kernel) -> tuple[tuple[str, object], ...]:
    """(name, default) of the kernel's parameters in order."""
    hit = _PARAMS.get(kernel)
    if hit is None:
        sig = inspect.signature(kernel.fn)
        hit = _PARAMS[kernel] = tuple((n, p.default) for n, p in sig.parameters.items())
    return hit


class Recorder:
    """Records the launches of one run of a call (a context manager; one recorder per thread at a time).

    Args:
        roots: the call's per-call tensors (inputs and output), in the order a replay passes their pointers;
            None entries are allowed (absent optional inputs).
        arena: the workspace arena the run's scratch views lie in (None: no arena).
    """

    def __init__(self, roots: Sequence[torch.Tensor | None], arena: torch.Tensor | None):
        self._roots = [(_span(t) if t is not None and t.numel() else None) for t in roots]
        self._arena = _span(arena) if arena is not None and arena.numel() else None
        self._launches: list[tuple] = []
        self.reason: str | None = None
        self._mode = _PureViews(self)

    def refuse(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def __enter__(self) -> Recorder:
        if _state.recorder is not None:
            raise RuntimeError("a Recorder is already active on this thread")
        _state.recorder = self
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        _state.recorder = None
        self._mode.__exit__(*exc)

    def _where(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(source, byte offset): source i >= 0 is root i, -1 the arena; None if nowhere or ambiguous."""
        if not t.numel():
            return None
        lo, hi = _span(t)
        found = None
        for i, span in enumerate(self._roots):
            if span is not None and span[0] <= lo and hi <= span[1]:
                if found is not None:
                    return None
                found = (i, lo - span[0])
        if found is None and self._arena is not None and self._arena[0] <= lo and hi <= self._arena[1]:
            found = (-1, lo - self._arena[0])
        return found

    def add(self, kernel, compiled, grid, args: tuple, kwargs: dict) -> None:
        if self.reason is not None:
            return
        if callable(grid):
            return self.refuse("a grid computed by a function")
        if not callable(getattr(kernel, "fn", None)):
            return self.refuse(f"{kernel!r} is not a Triton kernel")
        params = _params(kernel)
        values = list(args) + [kwargs.get(name, default) for name, default in params[len(args) :]]
        slots = []
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                where = self._where(v)
                if where is None:
                    return self.refuse(
                        f"argument {params[i][0]!r} of {kernel.fn.__name__} is not inside one root or the arena"
                    )
                slots.append((i, where[0], where[1], tuple(v.shape), tuple(v.stride()), v.dtype))
            elif isinstance(getattr(v, "base", None), torch.Tensor):
                # a TMA descriptor: its pointer is packed at launch, so a replay could not substitute it
                return self.refuse(f"argument {params[i][0]!r} of {kernel.fn.__name__} is a tensor descriptor")
        grid = tuple(grid) + (1,) * (3 - len(grid))
        options = {k: v for k, v in kwargs.items() if k not in {name for name, _ in params}}
        # Only where each tensor points is kept: a trace holding the recorded call's tensors would keep its
        # inputs, output and arena alive for as long as the trace is cached (one set per recorded signature).
        values = [None if isinstance(v, torch.Tensor) else v for v in values]
        self._launches.append((kernel, compiled, grid, values, tuple(slots), options))

    def trace(self) -> Trace | None:
        """The replayable trace of the recorded run, or None (``reason`` says why)."""
        if self.reason is not None:
            return None
        if not self._launches:
            self.refuse("no kernel launches")
            return None
        compiled = [c for _, c, *_ in self._launches]
        if all(c is None for c in compiled):
            return _InterpretedTrace(self._launches)
        if any(c is None or not hasattr(c, "packed_metadata") for c in compiled):
            self.refuse("a launch returned no compiled kernel")
            return None
        return _CompiledTrace(self._launches)


class Trace:
    """Launches to reissue with new root tensors and a new arena (see the module docstring)."""

    launches: int

    def parts(self) -> list[tuple[str, Trace]]:
        """(kernel name, a trace of that launch alone) per launch, in order (for per-launch timing). The name is
        the compiled kernel's where there is one (what profilers show), else the Python function's."""
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether the trace may replay now (not while a Triton launch hook, e.g. a profiler's, is installed:
        the hook expects Triton's own launch path)."""
        return True

    def __call__(self, roots: Sequence[torch.Tensor | None], arena: torch.Tensor | None, stream: int) -> None:
        raise NotImplementedError


class _CompiledTrace(Trace):
    """Replays through each compiled kernel's own launcher: ``launch(grid, stream, function, ..., *args)`` of
    Triton's generated C launcher when the kernel needs no scratch allocation, else the launcher object."""

    def __init__(self, recorded: list[tuple]):
        self._recorded = recorded
        self._items = []
        used: set[int] = set()
        for _, compiled, grid, values, slots, _ in recorded:
            template = list(values)
            for i, *_ in slots:
                template[i] = 0  # the pointer, substituted per replay
            run = compiled.run
            direct = getattr(run, "launch", None)
            if (
                direct is not None
                and not getattr(run, "global_scratch_size", 1)
                and not getattr(run, "profile_scratch_size", 1)
            ):
                fn, rest = (
                    direct,
                    (
                        compiled.function,
                        run.launch_cooperative_grid,
                        run.launch_pdl,
                        None,
                        None,
                        compiled.packed_metadata,
                        None,
                        None,
                        None,
                    ),
                )
            else:
                fn, rest = run, (compiled.function, compiled.packed_metadata, None, None, None)
            subs = tuple((i, src, off) for i, src, off, *_ in slots)
            used.update(src for _, src, _ in subs)
            self._items.append((fn, *grid, rest, template, subs))
        self._used = tuple(sorted(used))  # the sources (roots, -1 = arena) whose pointers a replay reads
        self.launches = len(self._items)

    def parts(self) -> list[tuple[str, Trace]]:
        # the compiled kernel's name, which profilers show (a kernel may name its specializations: _moe_gemm)
        return [(r[1].name, _CompiledTrace([r])) for r in self._recorded]

    def ready(self) -> bool:
        return not _hooked()

    def __call__(self, roots, arena, stream) -> None:
        bases = {}
        for src in self._used:
            t = roots[src] if src >= 0 else arena
            bases[src] = t.data_ptr()
        for fn, g0, g1, g2, rest, template, subs in self._items:
            args = template.copy()
            for i, src, off in subs:
                args[i] = bases[src] + off
            fn(g0, g1, g2, stream, *rest, *args)


def _hook_active(hook) -> bool:
    # Triton >= 3.5 keeps hooks in a HookChain (always present, empty when nothing is installed).
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooked() -> bool:
    """Whether a Triton launch hook (a profiler's) is installed: then launches go through ``kernel[grid]``."""
    rt = _runtime_knobs()
    return _hook_active(rt.launch_enter_hook) or _hook_active(rt.launch_exit_hook)


@functools.cache
def _runtime_knobs():
    from triton import knobs

    return knobs.runtime


class _InterpretedTrace(Trace):
    """The CPU interpreter's replay: tensor views rebuilt at the recorded offsets, launched via kernel[grid]."""

    def __init__(self, recorded: list[tuple]):
        self._items = recorded
        self.launches = len(recorded)

    def parts(self) -> list[tuple[str, Trace]]:
        return [(r[0].fn.__name__, _InterpretedTrace([r])) for r in self._items]

    def __call__(self, roots, arena, stream) -> None:
        sources = [*roots, arena]
        for kernel, _, grid, values, slots, options in self._items:
            args = list(values)
            for i, src, off, shape, stride, dtype in slots:
                args[i] = _view_at(sources[src], off, shape, stride, dtype)
            kernel[grid](*args, **options)


def _view_at(base: torch.Tensor, offset: int, shape, stride, dtype: torch.dtype) -> torch.Tensor:
    """A ``dtype`` view of ``base``'s storage starting ``offset`` bytes after ``base``'s first element."""
    start = base.storage_offset() * base.element_size() + offset
    view = torch.empty(0, dtype=dtype, device=base.device)
    return view.set_(base.untyped_storage(), start // dtype.itemsize, shape, stride)


UNSEEN = object()


class Replays:
    """Traces by key, bounded: what one entry point has recorded.

    ``get(key)`` is the key's :class:`Trace`, None when its recorded run was not replayable, or
    :data:`UNSEEN`; ``record(key, fn, roots, arena)`` runs ``fn()`` under a :class:`Recorder` and stores the
    outcome. A cleared cache only costs a re-recording.
    """

    def __init__(self, limit: int = 4096):
        self._traces: dict[object, Trace | None] = {}
        self._reasons: dict[object, str | None] = {}
        self.limit = limit

    def get(self, key):
        return self._traces.get(key, UNSEEN)

    def record(self, key, fn, roots: Sequence[torch.Tensor | None], arena: torch.Tensor | None):
        """Run ``fn()`` recorded; returns its result."""
        with Recorder(roots, arena) as rec:
            result = fn()
        if len(self._traces) >= self.limit:
            self._traces.clear()
            self._reasons.clear()
        self._traces[key] = rec.trace()
        self._reasons[key] = rec.reason
        return result

    def reason(self, key) -> str | None:
        """Why ``key``'s calls are not replayed (None if they are)."""
        if key not in self._traces:
            return "not recorded yet"
        return self._reasons.get(key)

    def clear(self) -> None:
        self._traces.clear()
        self._reasons.clear()
