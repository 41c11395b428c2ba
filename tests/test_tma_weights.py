"""Weight tiles through TMA descriptors (``GemmConfig.tma``): same results as pointer loads, the fallbacks where
the hardware's rules are not met, and no replay of a launch that carries a descriptor."""

import pytest
import torch
from devices import TRITON_DEVICES
from test_triton_experts import ACT_DTYPE, _case, check_edges, check_pin_against

from fusedmoe.ops.configs import GemmConfig, MoEConfig
from fusedmoe.ops.expert_gemm import Numerics, weight_descriptor
from fusedmoe.ops.launcher import Recorder


def _pins(device: str, block_m: int = 16) -> tuple[MoEConfig, MoEConfig]:
    """(pointer loads, TMA) pins: tiny tiles for the interpreter, Hopper-sized ones on a GPU; N and K tiles that
    do not divide I and H, so the descriptor's out-of-range rows and columns are exercised."""
    bn, bk, stages = (32, 32, 2) if device == "cpu" else (64, 64, 3)
    g = GemmConfig(block_m, bn, bk, num_warps=4, num_stages=stages)
    tma = GemmConfig(block_m, bn, bk, num_warps=4, num_stages=stages, tma=True)
    return MoEConfig(g, g), MoEConfig(tma, tma)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("quant", [None, "fp8_token", "fp8_block"])
def test_tma_matches_pointer_loads_and_reference(quant, device):
    """Against pointer loads and the float64 reference, with non-local experts (expert_map), a partial last N
    tile and a K tail (H = 208 and I = 80 on the GPU, 80 and 48 on the interpreter: rows of a multiple of 16
    bytes in fp8 too), under poison."""
    dtype = ACT_DTYPE[device] if quant else (torch.float32 if device == "cpu" else torch.bfloat16)
    H, I = (80, 48) if device == "cpu" else (208, 80)
    M = 13 if device == "cpu" else 300
    case = _case(M, H, I, 4, 2, device=device, dtype=dtype, quant=quant, gE=6)
    emap = torch.tensor([0, -1, 1, 2, 3, -1], dtype=torch.int32, device=device)
    plain, tma = _pins(device)
    assert weight_descriptor(case[1], tma.gemm1, Numerics(quant and case[5].mode)) is not None
    check_pin_against(plain, tma, case, emap=emap)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_tma_edges(device):
    """M = 1, top_k = E, one expert with every token, and experts with none."""
    _, tma = _pins(device)
    check_edges(tma, device, torch.float32 if device == "cpu" else torch.bfloat16, 80, 48)


def test_descriptor_only_where_the_rules_hold():
    """None (pointer loads) without ``tma``, for MXFP4 and decode-sized tiles, for a row stride that is not a
    multiple of 16 bytes, for non-contiguous K and for experts that are not packed back to back."""
    w = torch.randn(3, 32, 40)
    on = GemmConfig(16, 16, 32, tma=True)
    assert weight_descriptor(w, GemmConfig(16, 16, 32), Numerics()) is None
    desc = weight_descriptor(w, on, Numerics())
    assert list(desc.shape) == [96, 40] and list(desc.block_shape) == [16, 32]
    assert weight_descriptor(w, GemmConfig(1, 16, 32, tma=True), Numerics()) is None
    assert weight_descriptor(torch.zeros(3, 32, 20, dtype=torch.uint8), on, Numerics("mxfp4")) is None
    assert weight_descriptor(torch.randn(3, 32, 38), on, Numerics()) is None  # 152-byte rows
    assert weight_descriptor(torch.randn(3, 40, 32).transpose(1, 2), on, Numerics()) is None
    assert weight_descriptor(torch.randn(3, 64, 40)[:, :32], on, Numerics()) is None


def test_config_round_trip_and_defaults():
    """``tma`` survives the JSON form, and a table without the key means pointer loads."""
    g = GemmConfig(64, 128, 64, 8, 4, 3, tma=True)
    assert GemmConfig.from_dict(g.to_dict()) == g
    assert GemmConfig.from_dict(GemmConfig(64, 128, 64).to_dict()).tma is False
    assert "tma" not in GemmConfig(64, 128, 64).to_dict()


def test_recorder_refuses_descriptor_arguments():
    """A descriptor packs the weights' address at launch: a replay could not substitute it, so the recorder
    refuses the run (the call then always launches through Triton)."""

    def kernel(a_ptr, w_desc):
        pass

    class FakeKernel:
        fn = staticmethod(kernel)

    desc = weight_descriptor(torch.randn(2, 16, 32), GemmConfig(16, 16, 32, tma=True), Numerics())
    a = torch.zeros(4)
    with Recorder([a], None) as rec:
        rec.add(FakeKernel(), None, (1,), (a, desc), {})
    assert rec.trace() is None and "descriptor" in rec.reason
