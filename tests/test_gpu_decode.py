"""The opt-in decode path (FUSEDMOE_DECODE_PATH=1) on the GPU: bf16 vs reference, poison, graph replay."""

import pytest
import torch

import fusedmoe
from fusedmoe.api import get_kernel, set_decode_path
from fusedmoe.ops import decode
from fusedmoe.reference import fused_moe_reference, relative_error

pytestmark = pytest.mark.gpu


@pytest.fixture
def decode_on():
    was = decode.ENABLED
    set_decode_path(True)
    yield
    set_decode_path(was)


def _problem(M, E=128, k=8, H=2048, I=768, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).bfloat16()
    w, ids = fusedmoe.route(torch.randn(M, E, device="cuda", generator=g), k)
    return x, w1, w2, w, ids


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_decode_path_matches_reference_and_poison(decode_on, M, activation):
    x, w1, w2, w, ids = _problem(M)
    plan = get_kernel("triton").plan(
        fusedmoe.MoEProblem(M, 2048, 768, 128, 128, 8, torch.bfloat16, torch.bfloat16, activation=activation))
    assert {b.name for b in plan.buffers} == {"act"}  # no alignment, no [M*k, H] buffer
    clean = fusedmoe.fused_moe(x, w1, w2, w, ids, activation=activation,
                               workspace=fusedmoe.WorkspaceManager("cuda", strategy="alloc_zeros"))
    dirty = fusedmoe.fused_moe(x, w1, w2, w, ids, activation=activation,
                               workspace=fusedmoe.WorkspaceManager("cuda", poison=True))
    assert torch.equal(clean, dirty)
    ref = fused_moe_reference(x, w1, w2, w, ids, activation=activation)
    assert relative_error(clean, ref) < 2e-2


def test_decode_path_expert_map_and_graph_replay(decode_on):
    x, w1, w2, _, _ = _problem(1, E=32)
    emap = torch.full((128,), -1, dtype=torch.int32, device="cuda")
    emap[::4] = torch.arange(32, dtype=torch.int32, device="cuda")
    mgr = fusedmoe.WorkspaceManager("cuda")
    logits = torch.randn(1, 128, device="cuda")

    def call():
        w, ids = fusedmoe.route(logits, 8)
        return fusedmoe.fused_moe(x, w1, w2, w, ids, expert_map=emap, global_num_experts=128, workspace=mgr)

    s = torch.cuda.Stream()
    with torch.cuda.stream(s), mgr.slot("g"):
        call()
        mgr.freeze()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            out = call()
    for seed in range(3):
        logits.copy_(torch.randn(1, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        w, ids = fusedmoe.route(logits, 8)
        ref = fused_moe_reference(x, w1, w2, w, ids, expert_map=emap, global_num_experts=128)
        assert relative_error(out, ref) < 2e-2
