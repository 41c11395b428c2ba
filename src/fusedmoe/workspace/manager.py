"""The workspace manager: where the bytes of a :class:`~fusedmoe.workspace.plan.WorkspacePlan` come from.

Strategies (one switch, same kernels, so the seeds' question is settled by measurement):

- ``alloc_zeros``: a fresh ``torch.zeros`` arena per call (vLLM's modular kernel before its pull request 19667).
- ``alloc_empty``: a fresh ``torch.empty`` arena per call (after it).
- ``per_layer``: every owner (layer) keeps its own persistent, grow-only arena (the reusable-workspace PR).
- ``shared`` (default): one persistent, grow-only arena per (device, slot), shared by every layer.

Caller-provided tensors (``workspace13=`` / ``workspace2=``) bypass the manager: see :func:`caller_workspace`.

Persistent arenas grow only when a plan needs more than they hold, rounded up to the next of 1.25, 1.5, 1.75 and
2 times a power of two (:func:`bucket_bytes`), so varying batch sizes cause O(log max M) growths;
:meth:`WorkspaceManager.reserve` sizes them ahead of time exactly;
:meth:`WorkspaceManager.freeze` forbids growth (CUDA graphs bake addresses in) and turns a too-large request
into :class:`WorkspaceFrozenError` instead of a reallocation.

CUDA graphs without freezing (torch.compile's CUDA graph trees, ``mode="reduce-overhead"``): a CUDA arena is
allocated on a short-lived thread of its own, so it never lands in the private memory pool into which graph trees
route the allocations of the thread that runs their warm-up (torch refuses a graph that leaves untracked tensors
in that pool); and an arena handed out while the current stream was capturing is kept, not freed, when a larger
one replaces it, because the recorded graph replays into its addresses (until :meth:`WorkspaceManager.release`).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .plan import ALIGNMENT, WorkspacePlan

STRATEGIES = ("alloc_zeros", "alloc_empty", "per_layer", "shared")

#: Smallest arena a growth allocates (bytes).
MIN_BUCKET = 1 << 16

#: Views of at most this many plans are cached per arena.
MAX_CACHED_VIEWS = 256

#: Poison of 1-byte buffers (0x7F is NaN in e4m3) and the 16-bit poison of wider ones (see poison_views).
POISON_BYTE = 0x7F
POISON_HALF = 0x7FC0


class WorkspaceError(ValueError):
    """A workspace request that cannot be served (bad caller buffer, wrong device, ...)."""


class WorkspaceFrozenError(WorkspaceError):
    """A frozen arena was asked to grow."""


def bucket_bytes(nbytes: int) -> int:
    """Capacity a growth allocates for a request of ``nbytes`` (at least MIN_BUCKET): the next of 1.25, 1.5, 1.75
    and 2 times a power of two, so an arena holds at most 25% more than its largest plan (power-of-two buckets
    wasted up to 100%: 2 GB for a 1.23 GB training backward) for at most four growths per doubling of M."""
    if nbytes <= MIN_BUCKET:
        return MIN_BUCKET
    step = (1 << (nbytes - 1).bit_length()) >> 3  # an eighth of the next power of two
    return -(-nbytes // step) * step


@dataclass
class WorkspaceStats:
    """Counters of one manager. ``reserved_bytes`` is what its persistent arenas hold right now."""

    reserved_bytes: int = 0
    peak_bytes: int = 0
    device_allocations: int = 0
    bytes_zeroed: int = 0
    zero_fills: int = 0
    poison_fills: int = 0
    calls: int = 0
    growths: int = 0
    plan_bytes: dict[object, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        d = dict(self.__dict__)
        d["plan_bytes"] = {str(k): v for k, v in self.plan_bytes.items()}
        return d


class Workspace:
    """Typed views of one plan's buffers, valid until the next request to the same arena.

    ``ws["name"]`` is a tensor of the buffer's shape and dtype. ``arena`` is the uint8 tensor behind them
    (None when the plan is empty).
    """

    __slots__ = ("plan", "views", "arena")

    def __init__(self, plan: WorkspacePlan, views: dict[str, torch.Tensor], arena: torch.Tensor | None):
        self.plan = plan
        self.views = views
        self.arena = arena

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.views[name]

    def __contains__(self, name: str) -> bool:
        return name in self.views


def _empty_view(spec, device) -> torch.Tensor:
    return torch.empty(spec.shape, dtype=spec.dtype, device=device)


def make_views(plan: WorkspacePlan, arena: torch.Tensor | None, placements=None) -> dict[str, torch.Tensor]:
    """Carve typed views of ``plan``'s buffers out of a uint8 ``arena`` at their placement offsets."""
    placements = plan.placements if placements is None else placements
    views = {}
    for spec in plan.buffers:
        if spec.nbytes == 0 or arena is None:
            views[spec.name] = _empty_view(spec, arena.device if arena is not None else "cpu")
            continue
        off = placements[spec.name].offset
        views[spec.name] = arena[off : off + spec.nbytes].view(spec.dtype).view(spec.shape)
    return views


class _Arena:
    """One persistent byte buffer plus a cache of views per plan (views are rebuilt only after a growth).
    ``captured``: it was handed out while the current CUDA stream was capturing a graph."""

    __slots__ = ("data", "views", "captured")

    def __init__(self, data: torch.Tensor):
        self.data = data
        self.views: dict[int, tuple[WorkspacePlan, dict[str, torch.Tensor]]] = {}
        self.captured = False

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def allocate_outside_pools(nbytes: int, device: torch.device) -> torch.Tensor:
    """``torch.empty(nbytes, dtype=uint8)`` on ``device``'s current stream, allocated by a thread of its own.

    CUDA graph trees route every allocation of the thread running their warm-up to the graph's private pool
    (``torch._C._cuda_beginAllocateCurrentThreadToPool``) and refuse a graph after which that pool holds tensors
    that are not outputs: a persistent arena must come from the ordinary pool. The routing is per thread, so
    another thread's allocation on the same stream escapes it. (While a stream captures, its allocations go to
    the capture's pool from any thread: growing under plain capture behaves as before.) Raises what
    ``torch.empty`` raises (out of memory) in the caller's thread.
    """
    stream = torch.cuda.current_stream(device)
    result: list = []

    def run() -> None:
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                result.append(torch.empty(nbytes, dtype=torch.uint8, device=device))
        except BaseException as e:  # re-raised in the caller's thread
            result.append(e)

    thread = threading.Thread(target=run, name="fusedmoe-arena-alloc")
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def current_stream(device_index: int) -> int:
    """The raw handle of the current CUDA stream of a device (what ``torch.cuda.current_stream().cuda_stream``
    returns, without building a Stream object)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


_MANAGER_IDS = itertools.count()
#: Every live manager by its ``id`` (weakly held): how a manager crosses the registered op's boundary.
MANAGERS: weakref.WeakValueDictionary[int, WorkspaceManager] = weakref.WeakValueDictionary()


class WorkspaceManager:
    """Serves workspace plans from arenas according to a strategy; see the module docstring.

    Args:
        device: device of the arenas (default: the current CUDA device if CUDA is available, else CPU).
        strategy: one of ``STRATEGIES``.
        poison: fill every view with NaN (floats) or 0x7F bytes (integers) before handing it out, to prove
            that no kernel reads memory it did not write.
    """

    def __init__(self, device: torch.device | str | None = None, *, strategy: str = "shared", poison: bool = False):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must name a torch device (e.g. 'cuda', 'cuda:1', 'cpu'), got {device!r}") from e
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.id = next(_MANAGER_IDS)  # a plain int, so torch.compile can read it as a constant
        MANAGERS[self.id] = self
        self.strategy = strategy
        self.poison = bool(poison)
        self.frozen = False
        self.stats = WorkspaceStats()
        self._arenas: dict[object, _Arena] = {}
        # Arenas replaced by larger ones after a CUDA graph captured them: its replays still write there.
        self._retired: list[_Arena] = []
        # Guards the arenas and the stats: threads serving distinct slots may grow arenas at the same time.
        # The hot path holds it for a few dict operations only; poisoning and zeroing run outside it.
        self._lock = threading.Lock()
        self._slot: contextvars.ContextVar[object | None] = contextvars.ContextVar(f"fusedmoe_slot_{id(self)}")

    def __deepcopy__(self, memo) -> WorkspaceManager:
        # A manager is a shared resource (its arenas serve every layer holding it): copies of a layer share it.
        return self

    def __reduce__(self):
        raise TypeError(
            "a WorkspaceManager holds device arenas and cannot be pickled; pickle the layers without "
            "workspace= (they use the device's default manager) or set it again after loading"
        )

    def __repr__(self) -> str:
        return (
            f"WorkspaceManager(device={self.device}, strategy={self.strategy!r}, poison={self.poison}, "
            f"frozen={self.frozen}, reserved={self.stats.reserved_bytes} B)"
        )

    # ---- slots -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def slot(self, name: object) -> Iterator[None]:
        """Serve requests made inside this context from the arena of slot ``name``.

        Work that may run concurrently (other CUDA streams, interleaved micro-batches) must use distinct slots.
        Outside any ``slot`` context the slot is the current CUDA stream (or ``"default"`` on CPU).
        """
        token = self._slot.set(name)
        try:
            yield
        finally:
            self._slot.reset(token)

    def current_slot(self) -> object:
        name = self._slot.get(None)
        if name is not None:
            return name
        if self.device.type == "cuda":
            return ("stream", current_stream(self.device.index))
        return "default"

    def _key(self, owner: object, slot: object | None) -> object:
        slot = self.current_slot() if slot is None else slot
        return (owner, slot) if self.strategy == "per_layer" else slot

    # ---- sizing ------------------------------------------------------------------------------------------
    def freeze(self) -> None:
        """Forbid arena growth from now on; a request past the reserved size raises WorkspaceFrozenError."""
        self.frozen = True

    def unfreeze(self) -> None:
        self.frozen = False

    def reserve(self, *plans: WorkspacePlan | int, owner: object = None, slot: object = None) -> int:
        """Size the arena that would serve ``owner`` in ``slot`` for the largest of ``plans`` (or byte counts).

        Reservation is exact (no bucket rounding) and grow-only. Returns the arena's capacity in bytes
        (0 for the per-call strategies, which keep nothing).
        """
        sizes = []
        for p in plans:
            if isinstance(p, WorkspacePlan):
                sizes.append(p.nbytes)
            elif isinstance(p, int) and not isinstance(p, bool):
                if p < 0:
                    raise ValueError(f"reserve() takes plans or byte counts >= 0, got {p} bytes")
                sizes.append(p)
            else:
                raise TypeError(f"reserve() takes WorkspacePlan objects or byte counts, got {type(p).__name__}")
        if self.strategy not in ("per_layer", "shared"):
            return 0
        need = max(sizes, default=0)
        key = self._key(owner, slot)
        with self._lock:
            arena = self._arenas.get(key)
            if arena is None or arena.nbytes < need:
                self._check_growth(need, arena)
                try:
                    self._replace(key, arena, need)
                except RuntimeError as e:  # out of memory, or more bytes than the allocator can address
                    raise WorkspaceError(f"could not reserve {need} bytes on {self.device}: {e}") from e
            return self._arenas[key].nbytes if key in self._arenas else 0

    def _check_growth(self, need: int, arena: _Arena | None) -> None:
        if self.frozen:
            have = arena.nbytes if arena is not None else 0
            raise WorkspaceFrozenError(
                f"workspace arena is frozen with {have} bytes but this call needs {need} bytes; "
                "reserve() the largest problem before freeze() (e.g. before CUDA-graph capture)"
            )

    def _replace(self, key: object, old: _Arena | None, nbytes: int) -> _Arena:
        """Swap in a larger arena. The new one is allocated first, so a failed allocation leaves the manager
        exactly as it was (at the price of holding both arenas for a moment). An old arena a CUDA graph captured
        is retired, not freed (still counted in ``reserved_bytes``)."""
        if self.device.type == "cuda":
            data = allocate_outside_pools(nbytes, self.device)
        else:
            data = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if old is not None:
            del self._arenas[key]
            if old.captured:
                self._retired.append(old)
            else:
                self.stats.reserved_bytes -= old.nbytes
            del old
        arena = _Arena(data)
        self._arenas[key] = arena
        self.stats.reserved_bytes += nbytes
        self.stats.device_allocations += 1
        return arena

    def release(self) -> None:
        """Drop every persistent arena (e.g. before resizing a model), those CUDA graphs captured included: the
        caller drops those graphs first (their replays would write into freed memory). Not allowed while frozen."""
        with self._lock:
            if self.frozen:
                raise WorkspaceFrozenError("release() on a frozen workspace manager")
            self._arenas.clear()
            self._retired.clear()
            self.stats.reserved_bytes = 0

    # ---- serving -----------------------------------------------------------------------------------------
    def acquire(self, plan: WorkspacePlan, owner: object = None) -> Workspace:
        """Views for every buffer of ``plan``, from the strategy's arena. Valid until the next acquire.

        Zero-requiring buffers are zeroed (and counted); in poison mode every view is poisoned first.
        """
        nbytes = plan.nbytes
        if self.strategy in ("alloc_zeros", "alloc_empty"):
            arena = None
            if nbytes:
                alloc = torch.zeros if self.strategy == "alloc_zeros" else torch.empty
                arena = alloc(nbytes, dtype=torch.uint8, device=self.device)
            views = make_views(plan, arena)
            with self._lock:
                if nbytes:
                    self.stats.device_allocations += 1
                    if self.strategy == "alloc_zeros":
                        self.stats.bytes_zeroed += nbytes
                        self.stats.zero_fills += 1
                self._count_call(owner, nbytes)
        else:
            key = self._key(owner, None)
            with self._lock:
                held = self._held(key, nbytes)
                cached = held.views.get(id(plan))
                if cached is None or cached[0] is not plan:
                    if len(held.views) >= MAX_CACHED_VIEWS:  # bounded under shape churn
                        held.views.clear()
                    cached = (plan, make_views(plan, held.data))
                    held.views[id(plan)] = cached
                arena, views = held.data, cached[1]
                self._count_call(owner, nbytes)
        ws = Workspace(plan, views, arena)
        self.prepare_views(ws)
        return ws

    def _held(self, key: object, nbytes: int) -> _Arena:
        """The persistent arena of ``key``, grown to hold ``nbytes``, marked when a CUDA graph is capturing the
        call (call with the lock held)."""
        held = self._arenas.get(key)
        if held is None or held.nbytes < nbytes:
            self._check_growth(nbytes, held)  # a refused or failed growth leaves no trace
            held = self._replace(key, held, bucket_bytes(nbytes))
            self.stats.growths += 1
        if not held.captured and self._capturing():
            held.captured = True
        return held

    def _capturing(self) -> bool:
        """Whether the current stream of the manager's device is capturing a CUDA graph."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def arena_for(self, plan: WorkspacePlan, owner: object = None) -> torch.Tensor:
        """The persistent arena serving ``plan`` now (grown if needed), counted as one call, for callers that
        address the plan's buffers by their placement offsets from the arena's first byte (a recorded
        :class:`~fusedmoe.ops.launcher.Trace`). Only for persistent strategies without poison and for plans
        without zero-requiring buffers: :meth:`acquire` serves everything else."""
        nbytes = plan.nbytes
        key = self._key(owner, None)
        with self._lock:
            held = self._held(key, nbytes)
            self._count_call(owner, nbytes)
        return held.data

    @property
    def replayable(self) -> bool:
        """Whether :meth:`arena_for` may serve calls (persistent arenas, no poison)."""
        return not self.poison and self.strategy in ("shared", "per_layer")

    def _count_call(self, owner: object, nbytes: int) -> None:
        self.stats.calls += 1
        if nbytes > self.stats.peak_bytes:
            self.stats.peak_bytes = nbytes
        self.stats.plan_bytes[owner] = nbytes

    def prepare_views(self, ws: Workspace) -> None:
        """Apply poison and the declared zero requirements to a workspace's views (in that order)."""
        if self.poison:
            poison_views(ws)
        zeroed_bytes = zero_fills = 0
        for spec in ws.plan.buffers:
            if spec.zero is not None and spec.nbytes:
                ws.views[spec.name].zero_()
                zeroed_bytes += spec.nbytes
                zero_fills += 1
        with self._lock:
            self.stats.poison_fills += int(self.poison)
            self.stats.bytes_zeroed += zeroed_bytes
            self.stats.zero_fills += zero_fills


def poison_views(ws: Workspace) -> None:
    """Fill every buffer with poison: the 16-bit pattern 0x7FC0 repeated for 2-, 4- and 8-byte dtypes (a NaN in
    bf16, fp16 and fp32, and a huge positive int16/int32/int64, so a float view over integer poison still reads
    NaN and an index view over float poison still points far out of range), 0x7F bytes for 1-byte dtypes (NaN
    in e4m3).

    Buffers that share bytes (disjoint lifetimes) are filled latest-first, so every byte holds the poison of
    the buffer that is live first there: the one that could read it before anything in the call wrote it.
    """
    for spec in sorted(ws.plan.buffers, key=lambda b: -int(b.first)):
        if not spec.nbytes:
            continue
        view = ws.views[spec.name]
        if spec.dtype.itemsize >= 2:
            view.view(torch.int16).fill_(POISON_HALF)
        else:
            view.view(torch.uint8).fill_(POISON_BYTE)


# ---- caller-provided workspaces ------------------------------------------------------------------------------
def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) byte range of the memory a tensor can touch."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return (t.data_ptr(), t.data_ptr() + span * t.element_size())


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.device.type == "meta":  # meta tensors have no memory to share
        return False
    a0, a1 = _extent(a)
    b0, b1 = _extent(b)
    return a0 < b1 and b0 < a1


def _check_caller_tensor(name: str, t: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise WorkspaceError(f"{name} is on {t.device} but hidden_states is on {device}")
    if t.dtype not in (dtype, torch.uint8):
        raise TypeError(f"{name} must have dtype {dtype} (as hidden_states) or torch.uint8, got {t.dtype}")
    if not t.is_contiguous():
        raise WorkspaceError(f"{name} must be contiguous (it is used as flat storage)")
    return t


def _bytes_of(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Flat uint8 view of a contiguous tensor, advanced to a 16-byte boundary; returns (view, bytes skipped)."""
    flat = t.reshape(-1).view(torch.uint8)
    skip = (-flat.data_ptr()) % 16 if flat.numel() else 0
    return flat[skip:], skip


def caller_workspace(
    plan: WorkspacePlan,
    workspace13: torch.Tensor | None,
    workspace2: torch.Tensor | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    protected: dict[str, torch.Tensor],
) -> Workspace:
    """Lay ``plan`` out in caller-owned tensors, validating them first.

    With both tensors, buffers of region "13" go to ``workspace13`` and those of region "2" to ``workspace2``
    (each region laid out with lifetime aliasing on its own). With ``workspace13`` alone, the whole plan goes
    there. Raises TypeError / WorkspaceError (a ValueError) naming the argument: wrong type, device or dtype,
    non-contiguous, too small (with bytes needed and available), or overlapping an input (``protected``) or
    each other. Nothing is written before every check passed.
    """
    if workspace13 is None:
        raise WorkspaceError("workspace2 was given without workspace13; pass workspace13 alone or both")
    given = {"workspace13": _check_caller_tensor("workspace13", workspace13, dtype, device)}
    if workspace2 is not None:
        given["workspace2"] = _check_caller_tensor("workspace2", workspace2, dtype, device)
        if _overlaps(workspace13, workspace2):
            raise WorkspaceError("workspace13 and workspace2 overlap in memory")
    for wname, w in given.items():
        for pname, p in protected.items():
            if p is not None and _overlaps(w, p):
                raise WorkspaceError(f"{wname} overlaps {pname}; a workspace must not alias inputs")

    if workspace2 is None:
        layouts = {"workspace13": (plan.placements, plan.nbytes)}
    else:
        layouts = {}
        for wname, region in (("workspace13", "13"), ("workspace2", "2")):
            placements, total = plan.region(region)
            layouts[wname] = (placements, total)
    views: dict[str, torch.Tensor] = {}
    checked = []
    for wname, (placements, total) in layouts.items():
        flat, skip = _bytes_of(given[wname])
        if flat.numel() < total:
            raise WorkspaceError(
                f"{wname} is too small: this call needs {total} bytes (+{skip} to reach 16-byte alignment), "
                f"the tensor holds {given[wname].numel() * given[wname].element_size()} bytes"
            )
        checked.append((flat, placements))
    for flat, placements in checked:
        for name, p in placements.items():
            spec = p.spec
            if spec.nbytes == 0:
                views[name] = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            else:
                views[name] = flat[p.offset : p.offset + spec.nbytes].view(spec.dtype).view(spec.shape)
    return Workspace(plan, views, None)


_DEFAULT_MANAGERS: dict[torch.device, WorkspaceManager] = {}


def default_manager(device: torch.device | str) -> WorkspaceManager:
    """The process-wide ``shared`` manager of ``device``, used whenever ``workspace`` is None."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    mgr = _DEFAULT_MANAGERS.get(device)
    if mgr is None:
        mgr = _DEFAULT_MANAGERS[device] = WorkspaceManager(device, strategy="shared")
    return mgr


__all__ = [
    "ALIGNMENT",
    "STRATEGIES",
    "Workspace",
    "WorkspaceError",
    "WorkspaceFrozenError",
    "WorkspaceManager",
    "WorkspaceStats",
    "bucket_bytes",
    "caller_workspace",
    "default_manager",
    "make_views",
    "poison_views",
]
