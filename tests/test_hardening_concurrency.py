"""Hardening, part 5: concurrency. Work that may overlap must not share arena bytes.

CPU: two threads using two explicit slots of one manager get correct results from disjoint arenas. To make the
test able to fail, the two calls are forced to interleave at the worst point: each thread stops right before
its first GEMM, after it has sorted, gathered (torch) or aligned (Triton) into its arena, and waits for the
other to get there too. With distinct slots both results are right; the control runs the same schedule with
one deliberately shared slot and must see a wrong result (the detector works). GPU (``-m gpu``): two CUDA
streams with the default, stream-keyed slots run a layer stack concurrently, bit-identical to a sequential run,
from two disjoint arenas.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from fusedmoe import FusedMoE, WorkspaceManager, fused_moe
from fusedmoe.ops.configs import MoEConfig, pinned_config
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.workspace.plan import BufferSpec, WorkspacePlan

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
_interp = pytest.mark.skipif(not INTERPRETING, reason="interpreter")
BACKENDS = ["torch", pytest.param("triton", marks=_interp)]
H, I, E, K = 40, 24, 4, 2
TIMEOUT = 60


def args(M: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(M, H, generator=g),
        "w1": torch.randn(E, 2 * I, H, generator=g) / H**0.5,
        "w2": torch.randn(E, H, I, generator=g) / I**0.5,
        "topk_weights": torch.rand(M, K, generator=g) + 0.1,
        "topk_ids": torch.rand(M, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32),
    }


def correct(out: torch.Tensor, a: dict) -> bool:
    return relative_error(out, fused_moe_reference(*a.values())) < 1e-5


def record_arenas(mgr: WorkspaceManager, log: list):
    """Wrap ``mgr.acquire`` to log (slot, first byte, end byte) of every arena handed out."""
    real = mgr.acquire

    def acquire(plan, owner=None):
        ws = real(plan, owner)
        a = ws.arena
        log.append((mgr.current_slot(), a.data_ptr(), a.data_ptr() + a.numel()))
        return ws

    mgr.acquire = acquire


def run_threads(fns, barrier: threading.Barrier | None = None) -> list:
    results: list = [None] * len(fns)
    errors: list = []

    def wrap(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # surfaced below
            errors.append(e)
            if barrier is not None:
                barrier.abort()  # do not leave the other thread waiting

    threads = [threading.Thread(target=wrap, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


def pause_before_first_gemm(monkeypatch, backend: str, barrier: threading.Barrier) -> None:
    """Each thread, at its first GEMM of the call, waits until the other thread got there too."""
    local = threading.local()

    def wait_once():
        if not getattr(local, "paused", False):
            local.paused = True
            barrier.wait(TIMEOUT)

    if backend == "torch":
        import fusedmoe.experts.torch_experts as mod

        class PausingTorch:  # the torch module as torch_experts sees it, with a pausing mm
            def __getattr__(self, name):
                return getattr(torch, name)

            @staticmethod
            def mm(*a, **k):
                wait_once()
                return torch.mm(*a, **k)

        monkeypatch.setattr(mod, "torch", PausingTorch())
    else:
        # The Triton CPU interpreter is not thread-safe, so interpreted launches are serialized by a lock; the
        # threads still interleave between launches, which is where arena sharing would show.
        import fusedmoe.experts.triton_experts as mod

        lock = threading.Lock()

        def serialized(name, pause):
            real = getattr(mod, name)

            def op(*a, **k):
                if pause:
                    wait_once()
                with lock:
                    return real(*a, **k)

            monkeypatch.setattr(mod, name, op)

        for name in ("moe_align", "moe_gemm1", "moe_gemm2", "moe_reduce", "quantize_activation"):
            serialized(name, name == "moe_gemm1")


def interleaved_pair(monkeypatch, backend: str, slots: tuple[str, str], poison: bool):
    """Two same-shape calls (7 tokens x top-2) with different data, forced to interleave; returns (outputs,
    inputs, arena log)."""
    # The interleaving is forced inside the steps' kernel wrappers, which a replayed call does not run.
    from fusedmoe.ops import launcher

    monkeypatch.setattr(launcher, "ENABLED", False)
    mgr = WorkspaceManager("cpu", poison=poison)
    for slot in set(slots):
        # Size each slot's arena first: the manager is not thread-safe while an arena grows (two threads growing
        # one slot at once each allocate an arena, and one is orphaned), so growth is kept out of the race.
        with mgr.slot(slot):
            mgr.reserve(1 << 20)
    log: list = []
    record_arenas(mgr, log)
    barrier = threading.Barrier(2)
    pause_before_first_gemm(monkeypatch, backend, barrier)
    inputs = [args(7, seed=10), args(7, seed=11)]

    def call(i):
        def fn():
            with pinned_config(MoEConfig.simple(16, 32, 32)), mgr.slot(slots[i]):
                return fused_moe(**inputs[i], backend=backend, workspace=mgr)

        return fn

    outs = run_threads([call(0), call(1)], barrier)
    return outs, inputs, log


@pytest.mark.parametrize("poison", [False, True], ids=["plain", "poison"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_slots_survive_a_worst_case_interleaving(backend, poison, monkeypatch):
    outs, inputs, log = interleaved_pair(monkeypatch, backend, ("slot-a", "slot-b"), poison)
    assert all(correct(o, a) for o, a in zip(outs, inputs))
    (sa, a0, a1), (sb, b0, b1) = sorted(log, key=lambda r: r[0])
    assert {sa, sb} == {"slot-a", "slot-b"}
    assert a1 <= b0 or b1 <= a0, "the two slots' arenas overlap"


@pytest.mark.parametrize("poison", [False, True], ids=["plain", "poison"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_control_a_deliberately_shared_slot_is_detected(backend, poison, monkeypatch):
    """The same schedule with both calls in one slot: the test's detector must fire (the two calls were served
    the same bytes, and a result is wrong, or a call fails on the other's poison or indices). This is what the
    test above would see if slots were shared. Intra-op threads are off: a thread that fails inside a parallel
    region while the other runs one can stall torch's pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outs, inputs, log = interleaved_pair(monkeypatch, backend, ("same", "same"), poison)
    except (IndexError, RuntimeError, threading.BrokenBarrierError):  # corrupted indices: detected too
        return
    finally:
        torch.set_num_threads(threads)
    assert log[0][1:] == log[1][1:]
    assert not all(correct(o, a) for o, a in zip(outs, inputs)), "sharing a slot went unnoticed"


def test_many_calls_from_two_threads_in_two_slots():
    """Free-running: two threads, 25 calls each of varying M, own slots of one poisoned manager; every result is
    right, each slot keeps to its own arena(s), and no arena of one slot overlaps one of the other."""
    mgr = WorkspaceManager("cpu", poison=True)
    log: list = []
    record_arenas(mgr, log)
    start = threading.Barrier(2)

    def worker(slot, seed):
        def fn():
            start.wait(TIMEOUT)
            bad = 0
            with mgr.slot(slot):
                for j in range(25):
                    a = args(1 + (7 * j + seed) % 97, seed=seed * 1000 + j)
                    bad += not correct(fused_moe(**a, backend="torch", workspace=mgr), a)
            return bad

        return fn

    assert run_threads([worker("a", 1), worker("b", 2)]) == [0, 0]
    assert mgr.stats.calls == 50
    # A grown-away arena's bytes may be recycled by the allocator for the other slot later; only arenas live at
    # the same time matter, and the last one of each slot is live now.
    assert {r[0] for r in log} == {"a", "b"}
    last = {s: [r for r in log if r[0] == s][-1] for s in ("a", "b")}
    (_, a0, a1), (_, b0, b1) = last["a"], last["b"]
    assert a1 <= b0 or b1 <= a0


@pytest.mark.parametrize("strategy", ["shared", "per_layer"])
def test_concurrent_growth_in_distinct_slots_keeps_the_books(strategy):
    """Eight threads grow arenas in their own slots at the same time (thread switches forced every
    microsecond): the reserved bytes equal the arenas actually held, and every growth and call is counted."""
    mgr = WorkspaceManager("cpu", strategy=strategy)
    threads, steps = 8, 300
    start = threading.Barrier(threads)
    plans = [WorkspacePlan((BufferSpec("b", (64 * (j + 1),), torch.uint8, 3, 3),)) for j in range(steps)]

    def worker(i):
        def fn():
            start.wait(TIMEOUT)
            for j, plan in enumerate(plans):
                mgr.reserve(64 * (j + 1), owner="layer", slot=(i, j % 3))  # exact sizes: each one grows
                with mgr.slot((i, "a")):
                    mgr.acquire(plan, owner="layer")
            return 0

        return fn

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        assert run_threads([worker(i) for i in range(threads)]) == [0] * threads
    finally:
        sys.setswitchinterval(interval)
    assert mgr.stats.reserved_bytes == sum(a.nbytes for a in mgr._arenas.values())
    assert mgr.stats.calls == threads * steps
    assert mgr.stats.device_allocations == threads * steps + mgr.stats.growths
    assert mgr.stats.growths >= threads  # every acquiring slot grew at least once


def test_slot_choice_does_not_leak_across_threads():
    """A slot chosen in one thread is not the slot of another thread running at the same time."""
    mgr = WorkspaceManager("cpu")
    inside = threading.Event()
    done = threading.Event()
    seen = {}

    def chooser():
        with mgr.slot("mine"):
            seen["chooser"] = mgr.current_slot()
            inside.set()
            done.wait(TIMEOUT)

    def other():
        inside.wait(TIMEOUT)
        seen["other"] = mgr.current_slot()
        done.set()

    run_threads([chooser, other])
    assert seen == {"chooser": "mine", "other": "default"}


# ---- GPU -----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_two_cuda_streams_default_slots_run_a_stack_concurrently():
    dev = torch.device("cuda")
    mgr = WorkspaceManager(dev, strategy="shared", poison=True)
    torch.manual_seed(0)
    layers = [
        FusedMoE(64, 4, 1024, 512, dtype=torch.bfloat16, device=dev, workspace=mgr, backend="triton") for _ in range(8)
    ]
    xs = [torch.randn(M, 1024, dtype=torch.bfloat16, device=dev) for M in (37, 300)]

    def stack(x):
        outs = []
        for layer in layers:
            x = layer(x)
            outs.append(x)
        return outs

    expected = [stack(x) for x in xs]  # sequential, default stream
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    hs, got = list(xs), [[], []]
    for layer in layers:  # issue layer by layer, alternating streams: the two stacks overlap on the GPU
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                hs[i] = layer(hs[i])
                got[i].append(hs[i])
    torch.cuda.synchronize()
    for i in range(2):
        for a, b in zip(got[i], expected[i]):
            assert torch.equal(a, b)
    w, ids = layers[0].route(xs[1])
    ref = fused_moe_reference(xs[1], layers[0].w1, layers[0].w2, w, ids)
    assert relative_error(expected[1][0], ref) < 2e-2
    arenas = {k: (a.data.data_ptr(), a.data.data_ptr() + a.nbytes) for k, a in mgr._arenas.items()}
    keys = [("stream", s.cuda_stream) for s in streams]
    assert all(k in arenas for k in keys)
    (a0, a1), (b0, b1) = arenas[keys[0]], arenas[keys[1]]
    assert a1 <= b0 or b1 <= a0
