"""GEMM1's interleaved gate-up tile (``GemmConfig.interleave``): one dot over gate and up rows read as one tile,
by pointer loads or the 4-D TMA descriptor, alone or on a persistent grid; the same layer as two dots, against
the float64 reference, under poison, at the edges; and where it does not apply, the two-dot loop it falls back to."""

from dataclasses import replace

import pytest
import torch
from devices import TRITON_DEVICES, tolerance
from test_triton_experts import ACT_DTYPE, _case, _run, check_edges, check_pin_against

from fusedmoe.ops.configs import GemmConfig, MoEConfig, pinned_config
from fusedmoe.ops.expert_gemm import Numerics, weight_descriptor
from fusedmoe.reference import relative_error


def _pins(device: str, **kw) -> tuple[MoEConfig, MoEConfig]:
    """(two dots, interleaved) pins; N and K tiles that do not divide I and H (partial last N tile, K tail)."""
    bn, bk, stages = (16, 32, 2) if device == "cpu" else (64, 64, 3)
    g = GemmConfig(16, bn, bk, num_warps=4, num_stages=stages, **kw)
    return MoEConfig(g, g), MoEConfig(replace(g, interleave=True), g)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("quant", [None, "fp8_token", "fp8_tensor"])
@pytest.mark.parametrize("tma", [False, True])
def test_interleaved_matches_two_dots_and_reference(tma, quant, device):
    """Non-local experts (expert_map), I not a multiple of BLOCK_N and H not of BLOCK_K, under poison."""
    dtype = ACT_DTYPE[device] if quant else (torch.float32 if device == "cpu" else torch.bfloat16)
    H, I = (80, 40) if device == "cpu" else (208, 80)
    M = 13 if device == "cpu" else 300
    case = _case(M, H, I, 4, 2, device=device, dtype=dtype, quant=quant, gE=6)
    emap = torch.tensor([0, -1, 1, 2, 3, -1], dtype=torch.int32, device=device)
    two_dots, interleaved = _pins(device, tma=tma)
    check_pin_against(two_dots, interleaved, case, emap=emap)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("persistent", [1, 2, 3])
def test_interleaved_on_a_persistent_grid(persistent, device):
    """Bit-identical to the one-program-per-tile launch of the same interleaved tiles (same K order)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    M = 13 if device == "cpu" else 700
    case = _case(M, 80, 40, 4, 2, device=device, dtype=dtype)
    _, interleaved = _pins(device, tma=device != "cpu")
    on_grid = MoEConfig(replace(interleaved.gemm1, persistent=persistent), interleaved.gemm2)
    with pinned_config(interleaved):
        want, ref = _run(*case)
    with pinned_config(on_grid):
        got, _ = _run(*case, poison=True)
    assert relative_error(want, ref) < tolerance(dtype)
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_interleaved_edges(device):
    """M = 1, top_k = E, every token on one expert (the others empty), and gpt-oss's activation with biases."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    _, interleaved = _pins(device, tma=True)
    check_edges(interleaved, device, dtype, 80, 40)
    with pinned_config(interleaved):
        x, w1, w2, tw, ids, q, kw = _case(11, 80, 40, 4, 2, device=device, dtype=dtype)
        g = torch.Generator().manual_seed(1)
        b1, b2 = (torch.randn(4, 80, generator=g).to(device, dtype) for _ in range(2))  # [E, 2I] and [E, H]
        out, ref = _run(x, w1, w2, tw, ids, q, dict(w1_bias=b1, w2_bias=b2), activation="swigluoai")
        assert relative_error(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_interleave_ignored_where_it_does_not_apply(device):
    """fp8_block (per-K-tile scales) keeps its two-dot loop under an interleaved pin: same output as without."""
    dtype = ACT_DTYPE[device]
    case = _case(13, 80, 48, 4, 2, device=device, dtype=dtype, quant="fp8_block")
    two_dots, interleaved = _pins(device)
    with pinned_config(two_dots):
        want, _ = _run(*case)
    with pinned_config(interleaved):
        got, _ = _run(*case)
    assert torch.equal(got, want)


def test_interleaved_descriptor():
    """The 4-D descriptor views [E, 2N, K] as [E, N, 2, K]: gate row j and up row j one block row apart."""
    w = torch.randn(3, 64, 40)
    cfg = GemmConfig(16, 16, 32, tma=True, interleave=True)
    desc = weight_descriptor(w, cfg, Numerics(), interleave=True)
    assert list(desc.shape) == [3, 32, 2, 40] and list(desc.block_shape) == [1, 16, 2, 32]
    assert list(desc.strides) == [64 * 40, 40, 32 * 40, 1]
    assert weight_descriptor(w, replace(cfg, tma=False), Numerics(), interleave=True) is None


def test_interleave_round_trips():
    g = GemmConfig(128, 128, 64, 16, 8, 3, tma=True, persistent=2, interleave=True)
    assert GemmConfig.from_dict(g.to_dict()) == g
    assert "interleave" not in GemmConfig(128, 128, 64).to_dict()
