"""What torch compiled during a ``fusedmoe bench model`` run, and whether CUDA graphs covered the decode step.

:class:`CompileWatch` attributes dynamo's compiled graphs, inductor's cudagraph skips (with the reasons inductor
logs: "skipping cudagraphs due to ...") and the CUDA graphs recorded and replayed to one implementation and phase
at a time; :func:`cudagraph_verdict` turns one implementation's :class:`Tally` into the row's ``cudagraphs`` text.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch


@dataclass
class Tally:
    """What :class:`CompileWatch` saw of one implementation."""

    skips: int = 0  # inductor's cudagraph skips
    reasons: list[str] = field(default_factory=list)  # the reasons inductor logged for them, each once
    compiled_after_warm_up: int = 0  # graphs dynamo compiled after the warm-up (at a switch, or while timed)
    compiled_while_timed: int = 0  # graphs dynamo compiled during the timed runs
    recorded_while_timed: int = 0  # CUDA graphs recorded during the timed runs
    replays_per_step: float | None = None  # CUDA graph replays per decode step in the last untimed run


class _CudagraphSkipHandler(logging.Handler):
    """Hands each warning of inductor's cudagraphs logger to ``sink`` (the message's first line)."""

    def __init__(self, sink):
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.sink(message.splitlines()[0] if message else "")


def _skip_reason(message: str) -> str:
    """``"skipping cudagraphs due to X"`` -> ``"X"`` (other messages as they are)."""
    for prefix in ("skipping cudagraphs due to ", "skipping cudagraph due to "):
        if message.startswith(prefix):
            return message[len(prefix) :]
    return message


def _cudagraphs_logger() -> logging.Logger:
    """The logger on which inductor says why it skips CUDA graphs (``log_cudagraph_skip_and_bump_counter``)."""
    try:
        from torch._inductor.cudagraph_utils import cudagraphs_log
    except ImportError:  # the name torch._logging.getArtifactLogger gives it
        return logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs")
    return cudagraphs_log


def _dynamo_counters():
    """torch's compile counters (``counters[group][name]``, zero until counted)."""
    from torch._dynamo.utils import counters

    return counters


class CompileWatch:
    """While entered, what torch compiled for each implementation and whether CUDA graphs ran for it.

    :meth:`during` attributes what happens inside it to one implementation and one phase (``warm-up``,
    ``untimed`` or ``timed``): graphs dynamo compiled (its ``unique_graphs`` counter); inductor's cudagraph skips
    (its ``cudagraph_skips`` counter) with the reasons inductor logs for them ("skipping cudagraphs due to ...",
    caught by a handler on its cudagraphs logger; only with ``compiled``); and, with ``on_cuda``, CUDA graphs
    recorded and replayed (``torch.cuda.CUDAGraph.capture_begin`` and ``replay``, which inductor's cudagraph trees
    call). Replays are counted outside the timed phase only, so that the timed runs carry no counting.
    """

    def __init__(self, *, compiled: bool, on_cuda: bool):
        self.compiled = compiled
        self.on_cuda = on_cuda
        self.tallies: dict[str, Tally] = {}
        self._current: Tally | None = None
        self._captures = 0
        self._replays = 0
        self._handler = _CudagraphSkipHandler(self._note_skip)
        self._logger: logging.Logger | None = None
        self._saved_capture_begin = None

    def __enter__(self) -> CompileWatch:
        if self.compiled:
            self._logger = _cudagraphs_logger()
            self._logger.addHandler(self._handler)
        if self.on_cuda:
            self._saved_capture_begin = torch.cuda.CUDAGraph.capture_begin
            torch.cuda.CUDAGraph.capture_begin = self._counting(self._saved_capture_begin, "_captures")
        return self

    def __exit__(self, *exc) -> None:
        if self._logger is not None:
            self._logger.removeHandler(self._handler)
        if self._saved_capture_begin is not None:
            torch.cuda.CUDAGraph.capture_begin = self._saved_capture_begin

    def _counting(self, method, counter: str):
        def counted(graph, *args, **kwargs):
            setattr(self, counter, getattr(self, counter) + 1)
            return method(graph, *args, **kwargs)

        return counted

    def _note_skip(self, message: str) -> None:
        reason = _skip_reason(message)
        if self._current is not None and reason not in self._current.reasons:
            self._current.reasons.append(reason)

    @contextlib.contextmanager
    def during(self, impl: str, phase: str, *, decode_steps: int = 0):
        """Attribute what happens inside to ``impl`` in ``phase``; outside the timed phase, with ``decode_steps``,
        set the implementation's replays per decode step."""
        tally = self.tallies.setdefault(impl, Tally())
        counters = _dynamo_counters()
        graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
        captures, replays = self._captures, self._replays
        count_replays = self.on_cuda and phase != "timed"
        saved_replay = torch.cuda.CUDAGraph.replay if count_replays else None
        if count_replays:
            torch.cuda.CUDAGraph.replay = self._counting(saved_replay, "_replays")
        self._current = tally
        try:
            yield tally
        finally:
            self._current = None
            if count_replays:
                torch.cuda.CUDAGraph.replay = saved_replay
            tally.skips += counters["inductor"]["cudagraph_skips"] - skips
            compiled = counters["stats"]["unique_graphs"] - graphs
            if phase != "warm-up":
                tally.compiled_after_warm_up += compiled
            if phase == "timed":
                tally.compiled_while_timed += compiled
                tally.recorded_while_timed += self._captures - captures
            elif count_replays and decode_steps:
                tally.replays_per_step = (self._replays - replays) / decode_steps


def cudagraph_verdict(device: torch.device, tally: Tally) -> str:
    """Whether CUDA graphs covered a compiled row's decode step: "yes" (its decode steps replayed CUDA graphs and
    inductor skipped none), "partial, skipped: <reasons>" (they replayed some, inductor skipped others),
    "skipped: <reasons>" (none replayed), "no: ..." (none replayed, no skip reported) or "n/a (CPU)"."""
    if device.type != "cuda":
        return f"n/a ({'CPU' if device.type == 'cpu' else device.type})"
    reasons = "; ".join(tally.reasons) or (f"{tally.skips} skip(s), reason not logged" if tally.skips else "")
    replayed = bool(tally.replays_per_step)
    if reasons:
        return f"partial, skipped: {reasons}" if replayed else f"skipped: {reasons}"
    return "yes" if replayed else "no: no CUDA graph replayed during decode"


@contextlib.contextmanager
def room_for_compiled_graphs(graphs: int):
    """Raise dynamo's recompile limit (per compiled function) to at least ``graphs`` inside: each implementation
    keeps its own graphs in the one compiled forward, per batch shape, and past the limit dynamo would run the
    forward uncompiled."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    before = getattr(dynamo_config, name)
    setattr(dynamo_config, name, max(before, graphs))
    try:
        yield
    finally:
        setattr(dynamo_config, name, before)
