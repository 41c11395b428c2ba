"""The two-launch decode path (no alignment, top-k reduce in registers) against the float64 reference."""

import os

import pytest
import torch

from fusedmoe.ops.decode import MAX_DECODE_SLOTS, decode_supported, moe_decode
from fusedmoe.reference import fused_moe_reference, relative_error

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="needs Triton"
)


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
    moe_decode(x, w1, w2, w, ids, out, act, expert_map=emap, global_num_experts=gE or w1.shape[0],
               activation=activation, apply_router_weight_on_input=on_input, block_n1=16, block_n2=16, block_k=32)
    return out


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("M,E,k", [(1, 8, 2), (2, 4, 4), (3, 6, 1), (1, 1, 1)])
def test_decode_matches_reference(M, E, k, activation, on_input, device):
    """Random problems (H, I not multiples of the tiles), both activations, weight on input or output."""
    x, w1, w2, w, ids = _problem(M, E, k, 40, 24, device)
    out = _run(x, w1, w2, w, ids, activation=activation, on_input=on_input)
    ref = fused_moe_reference(x, w1, w2, w, ids, activation=activation, apply_router_weight_on_input=on_input)
    assert relative_error(out, ref) < 1e-5


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


def test_triton_experts_use_the_decode_path_when_enabled(device):
    """With the switch on, a decode-sized call plans only ``act`` and still matches the reference (poisoned)."""
    import fusedmoe
    from fusedmoe.api import get_kernel, set_decode_path
    from fusedmoe.ops import decode

    was = decode.ENABLED
    set_decode_path(True)
    try:
        x, w1, w2, w, ids = _problem(2, 8, 4, 40, 24, device)
        p = fusedmoe.MoEProblem(2, 40, 24, 8, 8, 4, torch.float32, torch.float32)
        assert [b.name for b in get_kernel("triton").plan(p).buffers] == ["act"]
        mgr = fusedmoe.WorkspaceManager(device, poison=True)
        out = fusedmoe.fused_moe(x, w1, w2, w, ids, backend="triton", workspace=mgr)
        assert relative_error(out, fused_moe_reference(x, w1, w2, w, ids)) < 1e-5
    finally:
        set_decode_path(was)
