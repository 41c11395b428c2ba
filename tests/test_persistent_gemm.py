"""Persistent grouped GEMMs (``GemmConfig.persistent``): one program per SM walking the tiles of the valid
blocks give the same output as one program per tile, bit for bit, in every mode."""

from dataclasses import replace

import pytest
import torch
from devices import TRITON_DEVICES, tolerance

from fusedmoe import LocalPrepareFinalize, MoEKernel
from fusedmoe.experts.base import ExpertsInputs
from fusedmoe.experts.triton_experts import TritonExperts
from fusedmoe.ops.align import moe_align
from fusedmoe.ops.configs import GemmConfig, MoEConfig, pinned_config
from fusedmoe.ops.grouped_gemm import grid_blocks, moe_gemm1, moe_gemm2
from fusedmoe.problem import MoEProblem
from fusedmoe.quant import QuantConfig, quantize_weights
from fusedmoe.reference import relative_error
from fusedmoe.workspace.manager import WorkspaceManager


def _call(x, w1, w2, tw, ids, q, kw, emap, poison):
    M, H = x.shape
    E, two_i, _ = w1.shape
    p = MoEProblem(M, H, two_i // 2, E, emap.numel(), ids.shape[1], x.dtype, w1.dtype, "silu", False, True, q)
    kernel = MoEKernel(LocalPrepareFinalize(), TritonExperts())
    inputs = ExpertsInputs(x, w1, w2, tw, ids, expert_map=emap, **kw)
    return kernel(inputs, p, manager=WorkspaceManager(x.device, poison=poison))


def _problem(seed: int, device: str):
    """(generator, (M, H, I, E, k), dtype, x, w1, w2): a partial N tile and a K tail for the tiles of
    :func:`_base_config`; on the GPU more tiles than SMs."""
    g = torch.Generator().manual_seed(seed)
    M, H, I, E, k = (13, 80, 48, 4, 2) if device == "cpu" else (700, 208, 80, 8, 2)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(M, H, generator=g).to(device, dtype)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(device, dtype)
    return g, (M, H, I, E, k), dtype, x, w1, w2


def _base_config(device: str) -> GemmConfig:
    """One program per tile: tiny tiles for the interpreter, Hopper-sized ones on a GPU."""
    bn, bk = (32, 32) if device == "cpu" else (64, 64)
    return GemmConfig(16, bn, bk, num_warps=4, num_stages=2 if device == "cpu" else 3)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("quant", [None, "fp8_block"])
@pytest.mark.parametrize("mode", [1, 2, 3])
def test_persistent_equals_one_program_per_tile(mode, quant, device):
    """Bit-identical to the non-persistent launch (same tiles, same K order) with non-local experts, experts
    without tokens, a partial N tile and a K tail, under poison; the GPU case has more tiles than SMs. A flattened
    persistent GEMM2 (modes 2, 3) stores its rows in the activation dtype (``triton_experts.y_dtype``): in bf16
    the layers then differ by that rounding, so each GEMM is also compared alone, bit for bit
    (:func:`test_persistent_gemms_alone`)."""
    g, (M, H, I, E, k), dtype, x, w1, w2 = _problem(mode, device)
    ids = torch.randint(0, E + 2, (M, k), generator=g, dtype=torch.int32).to(device)
    tw = (torch.rand(M, k, generator=g) + 0.1).to(device)
    emap = torch.tensor([*range(E), -1, -1], dtype=torch.int32, device=device)
    q = QuantConfig.parse(quant)
    kw = {}
    if q is not None:
        w1, w2, s1, s2 = quantize_weights(w1, w2, q)
        kw = dict(w1_scale=s1, w2_scale=s2)
    base = _base_config(device)
    outs = []
    for persistent in (0, mode):
        g_ = GemmConfig(**{**base.__dict__, "persistent": persistent})
        with pinned_config(MoEConfig(g_, g_)):
            outs.append(_call(x, w1, w2, tw, ids, q, kw, emap, poison=persistent > 0))
    assert torch.isfinite(outs[0]).all()
    if mode == 1 or dtype == torch.float32:
        assert torch.equal(outs[0], outs[1])
    else:
        assert relative_error(outs[1], outs[0]) < (6e-2 if quant else tolerance(dtype))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("mode", [1, 2, 3])
def test_persistent_gemms_alone(mode, device):
    """GEMM1 (interleaved too) and GEMM2 on a persistent grid write exactly what one program per tile writes, into
    outputs of the same dtype, with experts without tokens, a partial N tile and a K tail."""
    g, (M, H, I, E, k), dtype, x, w1, w2 = _problem(mode, device)
    ids = torch.randint(0, E - 1, (M, k), generator=g, dtype=torch.int32).to(device)  # expert E-1: no tokens
    tw = (torch.rand(M, k, generator=g) + 0.1).to(device)
    base = _base_config(device)
    sorted_ids, block_expert, _ = moe_align(ids, E, 16)
    nb = grid_blocks(M * k, block_expert.numel())
    for interleave in (False, True):
        outs = []
        for persistent in (0, mode):
            cfg = replace(base, persistent=persistent, interleave=interleave)
            act = torch.full((M * k, I), float("nan"), device=device, dtype=dtype)
            y = torch.full((M * k, H), float("nan"), device=device, dtype=dtype)
            moe_gemm1(x, w1, act, sorted_ids, block_expert, top_k=k, num_blocks=nb, config=cfg)
            moe_gemm2(act, w2, y, sorted_ids, block_expert, num_blocks=nb, config=cfg, topk_weights=tw)
            outs.append((act, y))
        assert torch.isfinite(outs[0][1]).all()
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_persistent_round_trips():
    g = GemmConfig(128, 128, 64, 16, 8, 4, tma=True, persistent=2)
    assert GemmConfig.from_dict(g.to_dict()) == g
    assert "persistent" not in GemmConfig(128, 128, 64).to_dict()
