"""Persistent grouped GEMMs (``GemmConfig.persistent``): one program per SM walking the tiles of the valid
blocks give the same output as one program per tile, bit for bit, in every mode."""

import pytest
import torch
from devices import TRITON_DEVICES

from fusedmoe import LocalPrepareFinalize, MoEKernel
from fusedmoe.experts.base import ExpertsInputs
from fusedmoe.experts.triton_experts import TritonExperts
from fusedmoe.ops.configs import GemmConfig, MoEConfig, pinned_config
from fusedmoe.problem import MoEProblem
from fusedmoe.quant import QuantConfig, quantize_weights
from fusedmoe.workspace.manager import WorkspaceManager


def _call(x, w1, w2, tw, ids, q, kw, emap, poison):
    M, H = x.shape
    E, two_i, _ = w1.shape
    p = MoEProblem(M, H, two_i // 2, E, emap.numel(), ids.shape[1], x.dtype, w1.dtype, "silu", False, True, q)
    kernel = MoEKernel(LocalPrepareFinalize(), TritonExperts())
    inputs = ExpertsInputs(x, w1, w2, tw, ids, expert_map=emap, **kw)
    return kernel(inputs, p, manager=WorkspaceManager(x.device, poison=poison))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("quant", [None, "fp8_block"])
@pytest.mark.parametrize("mode", [1, 2, 3])
def test_persistent_equals_one_program_per_tile(mode, quant, device):
    """Bit-identical to the non-persistent launch (same tiles, same K order) with non-local experts, experts
    without tokens, a partial N tile and a K tail, under poison; the GPU case has more tiles than SMs."""
    g = torch.Generator().manual_seed(mode)
    M, H, I, E, k = (13, 80, 48, 4, 2) if device == "cpu" else (700, 208, 80, 8, 2)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(M, H, generator=g).to(device, dtype)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(device, dtype)
    ids = torch.randint(0, E + 2, (M, k), generator=g, dtype=torch.int32).to(device)
    tw = (torch.rand(M, k, generator=g) + 0.1).to(device)
    emap = torch.tensor([*range(E), -1, -1], dtype=torch.int32, device=device)
    q = QuantConfig.parse(quant)
    kw = {}
    if q is not None:
        w1, w2, s1, s2 = quantize_weights(w1, w2, q)
        kw = dict(w1_scale=s1, w2_scale=s2)
    bn, bk = (32, 32) if device == "cpu" else (64, 64)
    base = GemmConfig(16, bn, bk, num_warps=4, num_stages=2 if device == "cpu" else 3)
    outs = []
    for persistent in (0, mode):
        g_ = GemmConfig(**{**base.__dict__, "persistent": persistent})
        with pinned_config(MoEConfig(g_, g_)):
            outs.append(_call(x, w1, w2, tw, ids, q, kw, emap, poison=persistent > 0))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])


def test_persistent_round_trips():
    g = GemmConfig(128, 128, 64, 16, 8, 4, tma=True, persistent=2)
    assert GemmConfig.from_dict(g.to_dict()) == g
    assert "persistent" not in GemmConfig(128, 128, 64).to_dict()
