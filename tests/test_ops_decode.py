"""The two-launch decode path (no alignment, top-k reduce in registers) against the float64 reference: the op on
the CPU (Triton interpreter) and on CUDA, the Triton experts taking it when the switch is on (poisoned, every
activation), and on CUDA an expert-mapped call under CUDA-graph replay."""

import pytest
import torch
from devices import TRITON_DEVICES, interpreter, tolerance
from hardening_util import decode_path

import fusedmoe
from fusedmoe.api import get_kernel
from fusedmoe.ops.decode import MAX_DECODE_SLOTS, decode_supported, moe_decode
from fusedmoe.reference import fused_moe_reference, relative_error


def _problem(M, E, k, H, I, device, ids=None):
    x = torch.randn(M, H, device=device)
    w1 = torch.randn(E, 2 * I, H, device=device) / H**0.5
    w2 = torch.randn(E, H, I, device=device) / I**0.5
    if ids is None:
        ids = torch.rand(M, E, device=device).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(M, k, device=device) + 0.1
    return x, w1, w2, w, ids


def _run(x, w1, w2, w, ids, *, emap=None, gE=None, activation="silu", on_input=False):
    M, H = x.shape
    k, I = ids.shape[1], w2.shape[2]
    out = torch.full((M, H), float("nan"), device=x.device)
    act = torch.full((M * k, I), float("nan"), device=x.device)  # poisoned scratch
    moe_decode(
        x,
        w1,
        w2,
        w,
        ids,
        out,
        act,
        expert_map=emap,
        global_num_experts=gE or w1.shape[0],
        activation=activation,
        apply_router_weight_on_input=on_input,
        block_n1=16,
        block_n2=16,
        block_k=32,
    )
    return out


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("M,E,k", [(1, 8, 2), (2, 4, 4), (3, 6, 1), (1, 1, 1)])
def test_decode_matches_reference(M, E, k, activation, on_input, device):
    """Random problems (H, I not multiples of the tiles), both activations, weight on input or output."""
    x, w1, w2, w, ids = _problem(M, E, k, 40, 24, device)
    out = _run(x, w1, w2, w, ids, activation=activation, on_input=on_input)
    ref = fused_moe_reference(x, w1, w2, w, ids, activation=activation, apply_router_weight_on_input=on_input)
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_decode_expert_map_and_invalid_ids(device):
    """Non-local experts and out-of-range ids contribute nothing; a token with no local slot is exactly 0."""
    x, w1, w2, w, _ = _problem(3, 4, 2, 40, 24, device)
    emap = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32, device=device)
    ids = torch.tensor([[1, 3], [0, 9], [2, -4]], dtype=torch.int32, device=device)  # token 2: nothing local
    out = _run(x, w1, w2, w, ids, emap=emap, gE=8)
    ref = fused_moe_reference(x, w1, w2, w, ids, expert_map=emap, global_num_experts=8)
    assert relative_error(out, ref) < 1e-5
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_decode_supported_bounds():
    assert decode_supported(1, None, "silu", False) and decode_supported(MAX_DECODE_SLOTS, None, "gelu", False)
    assert not decode_supported(MAX_DECODE_SLOTS + 1, None, "silu", False)
    assert not decode_supported(0, None, "silu", False)
    assert not decode_supported(8, "fp8_token", "silu", False) and not decode_supported(8, None, "silu", True)


#: (device, dtype, M, E, k, H, I): a tiny float32 problem on the CPU, the qwen3-30b-a3b shape in bf16 on CUDA
LAYER_CASES = [pytest.param("cpu", torch.float32, 2, 8, 4, 40, 24, marks=interpreter, id="cpu-M2")]
LAYER_CASES += [
    pytest.param("cuda", torch.bfloat16, M, 128, 8, 2048, 768, marks=pytest.mark.gpu, id=f"cuda-M{M}") for M in (1, 2)
]


@pytest.mark.parametrize("device,dtype,M,E,k,H,I", LAYER_CASES)
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_triton_experts_use_the_decode_path_when_enabled(device, dtype, M, E, k, H, I, activation):
    """With the switch on, a decode-sized call plans only ``act`` (no alignment, no [M*k, H] buffer), gives the
    same bits with the arena poisoned as zero-filled, and matches the reference."""
    g = torch.Generator(device=device).manual_seed(M)
    x = torch.randn(M, H, device=device, generator=g).to(dtype)
    w1 = (torch.randn(E, 2 * I, H, device=device, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device=device, generator=g) / I**0.5).to(dtype)
    w, ids = fusedmoe.route(torch.randn(M, E, device=device, generator=g), k)
    with decode_path(True):
        p = fusedmoe.MoEProblem(M, H, I, E, E, k, dtype, dtype, activation=activation)
        assert {b.name for b in get_kernel("triton").plan(p).buffers} == {"act"}
        clean, dirty = (
            fusedmoe.fused_moe(
                x,
                w1,
                w2,
                w,
                ids,
                activation=activation,
                backend="triton",
                workspace=fusedmoe.WorkspaceManager(device, strategy=s, poison=poison),
            )
            for s, poison in (("alloc_zeros", False), ("shared", True))
        )
    assert torch.equal(clean, dirty)
    ref = fused_moe_reference(x, w1, w2, w, ids, activation=activation)
    assert relative_error(clean, ref) < tolerance(dtype)


@pytest.mark.gpu
def test_decode_path_expert_map_and_graph_replay():
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    E, H, I = 32, 2048, 768
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16, generator=g)
    w1 = (torch.randn(E, 2 * I, H, device=dev, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=dev, generator=g) / I**0.5).bfloat16()
    emap = torch.full((128,), -1, dtype=torch.int32, device=dev)
    emap[::4] = torch.arange(32, dtype=torch.int32, device=dev)
    mgr = fusedmoe.WorkspaceManager(dev)
    logits = torch.randn(1, 128, device=dev)

    def call():
        w, ids = fusedmoe.route(logits, 8)
        return fusedmoe.fused_moe(x, w1, w2, w, ids, expert_map=emap, global_num_experts=128, workspace=mgr)

    with decode_path(True):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s), mgr.slot("g"):
            call()
            mgr.freeze()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s):
                out = call()
        for seed in range(3):
            logits.copy_(torch.randn(1, 128, device=dev, generator=torch.Generator(dev).manual_seed(seed)))
            graph.replay()
            torch.cuda.synchronize()
            w, ids = fusedmoe.route(logits, 8)
            ref = fused_moe_reference(x, w1, w2, w, ids, expert_map=emap, global_num_experts=128)
            assert relative_error(out, ref) < 2e-2
