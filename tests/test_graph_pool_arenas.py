"""Persistent arenas under CUDA graphs that nobody froze (torch.compile's CUDA graph trees): an arena a graph
captured outlives its replacement by a larger one (until release()), and a CUDA arena never lands in the private
pool into which graph trees route their warm-up thread's allocations."""

import weakref

import pytest
import torch

from fusedmoe.layer import FusedMoE
from fusedmoe.reference import relative_error
from fusedmoe.workspace.manager import WorkspaceManager
from fusedmoe.workspace.plan import BufferSpec, WorkspacePlan

DEV = "cuda"


def _plan(nbytes: int) -> WorkspacePlan:
    return WorkspacePlan([BufferSpec("buf", (nbytes,), torch.uint8, 0, 0)])


def _grow_twice(mgr: WorkspaceManager, capturing_first: bool):
    """Serve a small plan (captured or not), then one too large for its arena; returns a weak reference to the
    first arena's bytes."""
    mgr._capturing = lambda: capturing_first
    first = mgr.arena_for(_plan(1 << 16))
    mgr._capturing = lambda: False
    first_ref = weakref.ref(first)
    del first
    mgr.arena_for(_plan(1 << 20))
    return first_ref


def test_captured_arena_is_kept_when_a_larger_one_replaces_it():
    mgr = WorkspaceManager("cpu")
    first = _grow_twice(mgr, capturing_first=True)
    assert first() is not None, "a graph's replays would write into a freed arena"
    assert mgr.stats.reserved_bytes == (1 << 16) + (1 << 20)
    mgr.release()
    assert first() is None and mgr.stats.reserved_bytes == 0


def test_uncaptured_arena_is_freed_when_a_larger_one_replaces_it():
    mgr = WorkspaceManager("cpu")
    first = _grow_twice(mgr, capturing_first=False)
    assert first() is None
    assert mgr.stats.reserved_bytes == 1 << 20


@pytest.mark.gpu
def test_arena_growth_in_graph_trees_warmup_stays_out_of_the_private_pool():
    """What graph trees do around a warm-up (route the thread's allocations to the pool, then check the pool holds
    only outputs), around a manager's first acquire on the warm-up stream."""
    from torch._inductor.cudagraph_trees import _use_cuda_memory_pool_manager, check_memory_pool

    device = torch.cuda.current_device()
    stream = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    keep_pool = torch.cuda.CUDAGraph()
    with torch.cuda.graph(keep_pool, pool=pool, stream=stream, capture_error_mode="thread_local"):
        pass
    mgr = WorkspaceManager(DEV)
    with _use_cuda_memory_pool_manager(device, pool, stream):
        ws = mgr.acquire(_plan(3 << 20))
        inside = torch.empty(16, device=DEV)  # the routing is active: this one does land in the pool
    assert ws.arena.numel() >= 3 << 20
    with pytest.raises((RuntimeError, AssertionError), match="not tracked as outputs"):
        check_memory_pool(device, pool, [])  # the probe sees the pool
    del inside
    check_memory_pool(device, pool, [])  # the arena is not in it


@pytest.mark.gpu
def test_reduce_overhead_compiled_layer_grows_and_replays_earlier_graphs():
    """A layer compiled with mode="reduce-overhead" (CUDA graph trees) on a fresh manager, token counts growing
    after graphs were recorded, then the smaller graph replayed: every output equals the eager layer's on its own
    manager (graph trees refused the first warm-up before), and the arena the small graph captured was kept when
    the larger call replaced it (its replays write there)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    kw = dict(backend="triton", dtype=torch.bfloat16, device=DEV)
    layer = FusedMoE(8, 2, 256, 128, workspace=WorkspaceManager(DEV), **kw)
    eager = FusedMoE(8, 2, 256, 128, workspace=WorkspaceManager(DEV), **kw)
    eager.load_state_dict(layer.state_dict())
    counters.clear()
    compiled = torch.compile(layer, mode="reduce-overhead", dynamic=False)
    xs = {m: torch.randn(m, 256, device=DEV, dtype=torch.bfloat16) for m in (4, 512)}
    with torch.no_grad():
        for m in (4, 4, 4, 512, 512, 512, 4, 512):
            out = compiled(xs[m]).clone()  # a graph's output is overwritten by its next replay
            assert relative_error(out, eager(xs[m])) < 1e-2, f"M={m}"
    assert not counters["inductor"]["cudagraph_skips"], "the compiled layer ran without CUDA graphs"
    assert layer.workspace.stats.growths >= 2
    assert layer.workspace._retired, "the arena the M=4 graph captured was freed when M=512 replaced it"
