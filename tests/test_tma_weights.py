"""Weight tiles through TMA descriptors (``GemmConfig.tma``): same results as pointer loads, the fallbacks where
the hardware's rules are not met, and no replay of a launch that carries a descriptor."""

import pytest
import torch
from devices import TRITON_DEVICES, tolerance

from fusedmoe import LocalPrepareFinalize, MoEKernel
from fusedmoe.experts.base import ExpertsInputs
from fusedmoe.experts.triton_experts import TritonExperts
from fusedmoe.ops.configs import GemmConfig, MoEConfig, pinned_config
from fusedmoe.ops.expert_gemm import Numerics, weight_descriptor
from fusedmoe.ops.launcher import Recorder
from fusedmoe.problem import MoEProblem
from fusedmoe.quant import QuantConfig, quantize_weights
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.workspace.manager import WorkspaceManager

#: activation dtype per device for the fp8 cases (the interpreter has no bf16)
ACT_DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}


def _pins(device: str, block_m: int = 16) -> tuple[MoEConfig, MoEConfig]:
    """(pointer loads, TMA) pins: tiny tiles for the interpreter, Hopper-sized ones on a GPU; N and K tiles that
    do not divide I and H, so the descriptor's out-of-range rows and columns are exercised."""
    bn, bk, stages = (32, 32, 2) if device == "cpu" else (64, 64, 3)
    g = GemmConfig(block_m, bn, bk, num_warps=4, num_stages=stages)
    tma = GemmConfig(block_m, bn, bk, num_warps=4, num_stages=stages, tma=True)
    return MoEConfig(g, g), MoEConfig(tma, tma)


def _run(x, w1, w2, tw, ids, q, kw, emap=None, gE=None, poison=False):
    M, H = x.shape
    E, two_i, _ = w1.shape
    gE = gE or E
    p = MoEProblem(M, H, two_i // 2, E, gE, ids.shape[1], x.dtype, w1.dtype, "silu", False, emap is not None, q)
    kernel = MoEKernel(LocalPrepareFinalize(), TritonExperts())
    inputs = ExpertsInputs(x, w1, w2, tw, ids, expert_map=emap, **kw)
    return kernel(inputs, p, manager=WorkspaceManager(x.device, poison=poison))


def _case(M, H, I, E, k, device, dtype, quant=None, gE=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    gE = gE or E
    x = torch.randn(M, H, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    ids = torch.stack([torch.randperm(gE, generator=g)[:k] for _ in range(M)]).int()
    tw = torch.rand(M, k, generator=g) + 0.1
    x, w1, w2 = (t.to(device, dtype) for t in (x, w1, w2))
    q = QuantConfig.parse(quant)
    kw = {}
    if q is not None:
        w1, w2, s1, s2 = quantize_weights(w1, w2, q)
        kw = dict(w1_scale=s1, w2_scale=s2)
    return x, w1, w2, tw.to(device), ids.to(device), q, kw


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("quant", [None, "fp8_token", "fp8_block"])
def test_tma_matches_pointer_loads_and_reference(quant, device):
    """Against pointer loads and the float64 reference, with non-local experts (expert_map), a partial last N
    tile and a K tail (H = 208 and I = 80 on the GPU, 80 and 48 on the interpreter: rows of a multiple of 16
    bytes in fp8 too), under poison."""
    dtype = ACT_DTYPE[device] if quant else (torch.float32 if device == "cpu" else torch.bfloat16)
    H, I = (80, 48) if device == "cpu" else (208, 80)
    M = 13 if device == "cpu" else 300
    case = _case(M, H, I, 4, 2, device, dtype, quant=quant, gE=6)
    emap = torch.tensor([0, -1, 1, 2, 3, -1], dtype=torch.int32, device=device)
    plain, tma = _pins(device)
    assert weight_descriptor(case[1], tma.gemm1, Numerics(quant and case[5].mode)) is not None
    with pinned_config(plain):
        ref_ptr = _run(*case, emap=emap, gE=6)
    with pinned_config(tma):
        out = _run(*case, emap=emap, gE=6, poison=True)
    x, w1, w2, tw, ids, q, kw = case
    ref = fused_moe_reference(x, w1, w2, tw, ids, expert_map=emap, global_num_experts=6, quant=q, **kw)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < tolerance(dtype, quantized=q is not None)
    assert relative_error(out, ref_ptr) < tolerance(dtype)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_tma_edges(device):
    """M = 1, top_k = E, one expert with every token, and experts with none."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    _, tma = _pins(device)
    with pinned_config(tma):
        case = _case(1, 80, 48, 4, 4, device, dtype)
        assert relative_error(_run(*case), fused_moe_reference(*case[:5])) < tolerance(dtype)
        x, w1, w2, tw, ids, q, kw = _case(9, 80, 48, 8, 1, device, dtype)
        ids = torch.full_like(ids, 5)
        assert relative_error(_run(x, w1, w2, tw, ids, q, kw), fused_moe_reference(x, w1, w2, tw, ids)) < tolerance(
            dtype
        )


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
