"""The slot-order decode GEMMs (``fusedmoe.ops.slot_gemm``): GEMM1 over the slots as they come, GEMM2 with the top-k
reduce folded in (float and fp8 weights) or per slot before the reduce (MXFP4), against the aligned path they
replace (align, GEMM1, GEMM2 into float32 rows, reduce) at the same tiles: GEMM1 and the per-slot GEMM2 make the
same products in the same order (bit-identical), the folded GEMM2 sums the slots per K tile (float32 rounding
apart). With non-local experts, int64 ids, biases, weights on either side, fp8 weight-only and MXFP4 weights,
unwritten scratch, the edges and the argument errors; then in the layer: two launches, one scratch buffer."""

import pytest
import torch
from devices import TRITON_DEVICES, interpreter

from fusedmoe.ops import slot_gemm
from fusedmoe.ops.align import align_params, moe_align
from fusedmoe.ops.configs import GemmConfig, MoEConfig, pinned_config
from fusedmoe.ops.expert_gemm import Numerics
from fusedmoe.ops.grouped_gemm import grid_blocks, moe_gemm1, moe_gemm2
from fusedmoe.ops.reduce import moe_reduce
from fusedmoe.ops.slot_gemm import (
    MIN_TOKEN_BLOCK_N,
    moe_gemm1_slots,
    moe_gemm2_reduce,
    moe_gemm2_slots,
    token_reduces,
    token_tile,
)
from fusedmoe.quant import QuantConfig, quantize_weights

ONE_ROW = GemmConfig(1, 16, 32)


def _weights(E, H, I, quant, device, g):
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(device)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(device)
    q = QuantConfig.parse(quant)
    if q is None:
        return w1, w2, Numerics(), Numerics()
    w1, w2, s1, s2 = quantize_weights(w1, w2, q)
    mode = q.kernel_mode
    shape = tuple(q.block_shape)
    n1, n2 = (Numerics(mode, None, _scale_view(s, mode, E), shape) for s in (s1, s2))
    return w1, w2, n1, n2


def _scale_view(s, mode, E):
    from fusedmoe.experts.triton_experts import _w_scale

    return _w_scale(s, mode, E)


def _aligned(x, w1, w2, ids, tw, n1, n2, *, E, gE, emap, bias1, bias2, on_input, activation, cfg=ONE_ROW):
    """The four-launch path at the same tiles: align, GEMM1, GEMM2 into float32 rows, the top-k reduce."""
    M, k = ids.shape
    S, I, H = M * k, w2.shape[-1] * (2 if n2.mode == "mxfp4" else 1), w2.shape[1]
    sorted_ids, block_expert, _ = moe_align(ids, E, cfg.block_m, expert_map=emap, global_num_experts=gE)
    nb = grid_blocks(S, align_params(S, E, cfg.block_m).max_blocks)
    act = torch.full((S, I), float("nan"), dtype=x.dtype, device=x.device)
    moe_gemm1(
        x,
        w1,
        act,
        sorted_ids,
        block_expert,
        top_k=k,
        num_blocks=nb,
        config=cfg,
        activation=activation,
        topk_weights=tw if on_input else None,
        numerics=n1,
        bias=bias1,
    )
    y = torch.full((S, H), float("nan"), dtype=torch.float32, device=x.device)
    moe_gemm2(
        act,
        w2,
        y,
        sorted_ids,
        block_expert,
        num_blocks=nb,
        config=cfg,
        topk_weights=None if on_input else tw,
        numerics=n2,
        bias=bias2,
    )
    out = torch.empty(M, H, dtype=x.dtype, device=x.device)
    return act, moe_reduce(y, ids, out, E, expert_map=emap, global_num_experts=gE)


def _slots(x, w1, w2, ids, tw, n1, n2, *, E, gE, emap, bias1, bias2, on_input, activation, act_fill=float("nan")):
    """(act, out) of the slot-order path: GEMM1, then GEMM2 summing the slots, or per slot and the reduce (MXFP4)."""
    M, k = ids.shape
    I, H = w2.shape[-1] * (2 if n2.mode == "mxfp4" else 1), w2.shape[1]
    act = torch.full((M * k, I), act_fill, dtype=x.dtype, device=x.device)
    common = dict(num_experts=E, global_num_experts=gE, expert_map=emap, config=ONE_ROW)
    weights1, weights2 = (tw, None) if on_input else (None, tw)
    moe_gemm1_slots(x, w1, act, ids, activation=activation, topk_weights=weights1, numerics=n1, bias=bias1, **common)
    out = torch.full((M, H), float("nan"), dtype=x.dtype, device=x.device)
    if token_reduces(n2.mode):
        moe_gemm2_reduce(act, w2, out, ids, topk_weights=weights2, numerics=n2, bias=bias2, **common)
        return act, out
    y = torch.full((M * k, H), float("nan"), dtype=torch.float32, device=x.device)
    moe_gemm2_slots(act, w2, y, ids, topk_weights=weights2, numerics=n2, bias=bias2, **common)
    return act, moe_reduce(y, ids, out, E, expert_map=emap, global_num_experts=gE)


def _ids(M, k, gE, g, *, low=None):
    """[M, k] distinct global ids per token; ``low`` draws from [low, gE) with repeats instead (out-of-range ids)."""
    if low is not None:
        return torch.randint(low, gE, (M, k), generator=g, dtype=torch.int32)
    return torch.stack([torch.randperm(gE, generator=g)[:k] for _ in range(M)]).int()


CASES = [
    # M, H, I, E, gE, k, map, int64 ids, bias, on_input, activation, quant
    (9, 40, 24, 4, 6, 2, True, False, False, False, "silu", None),  # non-local ids, N and K off the tiles
    (5, 32, 48, 8, 8, 3, False, True, True, False, "gelu", None),  # int64 ids, biases
    (7, 40, 24, 4, 4, 2, False, False, False, True, "silu", None),  # router weight on the input
    (1, 32, 32, 4, 4, 4, False, False, False, False, "silu", None),  # M = 1, top-k = E
    (6, 32, 16, 1, 1, 1, False, False, True, False, "silu", None),  # one expert
    (6, 64, 32, 4, 6, 2, True, False, False, False, "silu", "fp8_block"),
    (6, 40, 24, 4, 4, 2, False, False, False, False, "silu", "fp8_token"),
    (6, 40, 24, 4, 4, 2, False, False, False, True, "silu", "fp8_tensor"),
    (6, 64, 64, 4, 6, 2, True, True, False, False, "silu", "mxfp4"),
]


@interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-k{c[5]}-{c[11] or 'float'}-{c[10]}")
def test_matches_the_aligned_path(case):
    """GEMM1 writes exactly the aligned GEMM1's rows (and no others); the output is the aligned path's, to the bit
    where GEMM2 runs per slot (MXFP4), within float32 rounding where it sums the slots."""
    M, H, I, E, gE, k, mapped, wide, biased, on_input, activation, quant = case
    g = torch.Generator().manual_seed(M * 31 + k)
    x = torch.randn(M, H, generator=g)
    w1, w2, n1, n2 = _weights(E, H, I, quant, "cpu", g)
    ids = _ids(M, k, gE, g, low=-1 if mapped else None)
    if wide:
        ids = ids.long()
    emap = torch.tensor([0, -1, 1, 2, 3, -1][:gE], dtype=torch.int32) if mapped else None
    tw = torch.rand(M, k, generator=g) + 0.1
    bias1 = torch.randn(E, 2 * I, generator=g) if biased else None
    bias2 = torch.randn(E, H, generator=g) if biased else None
    kw = dict(E=E, gE=gE, emap=emap, bias1=bias1, bias2=bias2, on_input=on_input, activation=activation)
    act_want, want = _aligned(x, w1, w2, ids, tw, n1, n2, **kw)
    act, got = _slots(x, w1, w2, ids, tw, n1, n2, **kw)
    assert torch.equal(act.isnan(), act_want.isnan())  # the same rows written: the local slots'
    assert torch.equal(act.nan_to_num(), act_want.nan_to_num())
    assert torch.isfinite(got).all()
    if token_reduces(n2.mode):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want)


@interpreter
def test_non_local_slots_are_neither_written_nor_read():
    """GEMM1 leaves the act rows of non-local slots as they were (NaN here) and GEMM2 never reads them: the output is
    finite, a token whose every slot is non-local gets a zero row, and the output matches a run whose act started
    as zeros."""
    g = torch.Generator().manual_seed(7)
    M, H, I, E, k = 5, 32, 16, 4, 2
    x = torch.randn(M, H, generator=g)
    w1, w2, n1, n2 = _weights(E, H, I, None, "cpu", g)
    emap = torch.tensor([0, 1, -1, 2, 3, -1], dtype=torch.int32)
    ids = torch.tensor([[0, 2], [5, 2], [1, 3], [4, 0], [2, 5]], dtype=torch.int32)  # token 1 and 4: nothing local
    tw = torch.rand(M, k, generator=g)
    kw = dict(E=E, gE=6, emap=emap, bias1=None, bias2=None, on_input=False, activation="silu")
    act = torch.full((M * k, I), float("nan"))
    moe_gemm1_slots(x, w1, act, ids, num_experts=E, expert_map=emap, config=ONE_ROW)
    local = torch.tensor([[True, False], [False, False], [True, True], [True, True], [False, False]]).reshape(-1)
    assert act[~local].isnan().all() and torch.isfinite(act[local]).all()
    _, dirty = _slots(x, w1, w2, ids, tw, n1, n2, **kw)
    _, clean = _slots(x, w1, w2, ids, tw, n1, n2, **kw, act_fill=0.0)
    assert torch.isfinite(dirty).all() and torch.equal(dirty, clean)
    assert (dirty[1] == 0).all() and (dirty[4] == 0).all() and (dirty[0] != 0).any()


@interpreter
def test_all_tokens_on_one_expert_and_m_zero():
    g = torch.Generator().manual_seed(11)
    M, H, I, E, k = 6, 40, 24, 8, 1
    x = torch.randn(M, H, generator=g)
    w1, w2, n1, n2 = _weights(E, H, I, None, "cpu", g)
    ids = torch.full((M, k), 5, dtype=torch.int32)
    tw = torch.rand(M, k, generator=g)
    kw = dict(E=E, gE=E, emap=None, bias1=None, bias2=None, on_input=False, activation="silu")
    torch.testing.assert_close(
        _slots(x, w1, w2, ids, tw, n1, n2, **kw)[1], _aligned(x, w1, w2, ids, tw, n1, n2, **kw)[1]
    )
    empty = torch.empty(0, k, dtype=torch.int32)
    out = torch.empty(0, H)
    act = torch.empty(0, I)
    moe_gemm1_slots(x[:0], w1, act, empty, num_experts=E, config=ONE_ROW)
    assert moe_gemm2_reduce(act, w2, out, empty, num_experts=E, config=ONE_ROW).shape == (0, H)


@pytest.mark.parametrize("M", [1, 2, 8, 64])
@pytest.mark.parametrize("sms", [0, 8, 132])
def test_token_tile_narrows_columns_until_the_programs_cover_the_sms(M, sms):
    """Narrower only while the programs are fewer than twice the SMs; the tile keeps its elements (K widened as N
    narrows) until K reaches I rounded up; never below MIN_TOKEN_BLOCK_N columns."""
    H, I = 2048, 768
    cfg = GemmConfig(1, 16, 128, num_warps=4)
    got = token_tile(cfg, M, H, I, sms)
    programs = M * -(-H // got.block_n)
    if M * -(-H // cfg.block_n) >= 2 * sms:
        assert got == cfg
    else:
        assert programs >= 2 * sms or got.block_n == MIN_TOKEN_BLOCK_N
        assert M * -(-H // (2 * got.block_n)) < 2 * sms  # one step less would not have covered them
        assert got.block_n * got.block_k == cfg.block_n * cfg.block_k and got.block_k <= 1024
        assert (got.block_m, got.num_warps) == (1, 4)
    assert token_tile(GemmConfig(1, 16, 32), 1, 64, 24, 132).block_k == 32  # K = 24: no wider than 32


@interpreter
@pytest.mark.parametrize("quant", [None, "fp8_block", "fp8_token"])
def test_narrowed_token_tile_matches_the_tuned_tile(quant, monkeypatch):
    """The same output (float32 rounding apart) when the token GEMM2 narrows the tuned tile for a GPU of many SMs,
    including fp8 128x128 blocks read by K tiles four groups wide (a scale per K row)."""
    g = torch.Generator().manual_seed(5)
    M, H, I, E, k = 2, 40, 384, 4, 3
    w1, w2, n1, n2 = _weights(E, H, I, quant, "cpu", g)
    ids, tw = _ids(M, k, E, g), torch.rand(M, k, generator=g)
    act = torch.randn(M * k, I, generator=g)
    cfg = GemmConfig(1, 16, 128)
    common = dict(num_experts=E, config=cfg, topk_weights=tw, numerics=n2)
    want = moe_gemm2_reduce(act, w2, torch.empty(M, H), ids, **common)
    monkeypatch.setattr(slot_gemm, "_sm_count", lambda device: 64)
    assert token_tile(cfg, M, H, I, 64).block_k == 512
    got = moe_gemm2_reduce(act, w2, torch.full((M, H), float("nan")), ids, **common)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_argument_errors_name_the_argument():
    x, w1, w2 = torch.randn(2, 32), torch.randn(4, 32, 32), torch.randn(4, 32, 16)
    ids = torch.zeros(2, 2, dtype=torch.int32)
    act, out = torch.empty(4, 16), torch.empty(2, 32)
    with pytest.raises(ValueError, match="BLOCK_M 1"):
        moe_gemm1_slots(x, w1, act, ids, num_experts=4, config=GemmConfig(16, 32, 32))
    with pytest.raises(ValueError, match="topk_ids"):
        moe_gemm1_slots(x, w1, act, ids.float(), num_experts=4, config=ONE_ROW)
    with pytest.raises(ValueError, match="shape mismatch"):
        moe_gemm1_slots(x, w1, torch.empty(3, 16), ids, num_experts=4, config=ONE_ROW)
    with pytest.raises(ValueError, match="shape mismatch"):
        moe_gemm2_reduce(act, w2, torch.empty(3, 32), ids, num_experts=4, config=ONE_ROW)
    with pytest.raises(ValueError, match="bias"):
        moe_gemm2_reduce(act, w2, out, ids, num_experts=4, config=ONE_ROW, bias=torch.zeros(4, 31))
    with pytest.raises(ValueError, match="expert_map"):
        moe_gemm2_reduce(act, w2, out, ids, num_experts=4, config=ONE_ROW, expert_map=torch.zeros(4))
    with pytest.raises(ValueError, match="moe_gemm2_slots"):
        moe_gemm2_reduce(act, w2, out, ids, num_experts=4, config=ONE_ROW, numerics=Numerics("mxfp4"))
    with pytest.raises(ValueError, match="mma-layout"):
        moe_gemm2_reduce(act, w2, out, ids, num_experts=4, config=ONE_ROW, numerics=Numerics("mxfp4_mma"))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_layer_runs_two_launches_with_one_buffer(device):
    """A one-row config plans only ``act`` and runs GEMM1 and GEMM2 (no align, no reduce), poisoned scratch and all,
    and gives the same output as 16-row tiles within float32 rounding (bf16's on the GPU)."""
    from fusedmoe import LocalPrepareFinalize, MoEKernel
    from fusedmoe.experts.base import ExpertsInputs
    from fusedmoe.experts.triton_experts import TritonExperts
    from fusedmoe.problem import MoEProblem
    from fusedmoe.reference import relative_error
    from fusedmoe.workspace.manager import WorkspaceManager

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(5)
    M, H, I, E, k = 3, 64, 32, 8, 2
    x = torch.randn(M, H, generator=g).to(device, dtype)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(device, dtype)
    ids = _ids(M, k, E, g).to(device)
    tw = torch.rand(M, k, generator=g).to(device)
    p = MoEProblem(M, H, I, E, E, k, dtype, dtype)
    kernel = MoEKernel(LocalPrepareFinalize(), TritonExperts())

    def run(cfg):
        with pinned_config(cfg):
            plan = kernel.plan(p)
            steps = [s.name for s in kernel.experts.steps(p, kernel.experts.launch(p))]
            out = kernel(ExpertsInputs(x, w1, w2, tw, ids), p, manager=WorkspaceManager(x.device, poison=True))
        return [b.name for b in plan.buffers], steps, out

    buffers, steps, out = run(MoEConfig.simple(1, 16, 32))
    assert buffers == ["act"] and steps == ["gemm1_slots", "gemm2_reduce"]
    _, steps16, want = run(MoEConfig.simple(16, 32, 32))
    assert steps16[0] == "align" and steps16[-1] == "reduce"
    assert torch.isfinite(out).all()
    assert relative_error(out, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@interpreter
def test_mxfp4_layer_keeps_the_reduce():
    """MXFP4 weights at one-row tiles: GEMM1 and GEMM2 in slot order, then the top-k reduce (no alignment)."""
    from fusedmoe import LocalPrepareFinalize, MoEKernel
    from fusedmoe.experts.triton_experts import TritonExperts
    from fusedmoe.problem import MoEProblem

    p = MoEProblem(3, 64, 64, 4, 4, 2, torch.float32, torch.uint8, quant=QuantConfig.parse("mxfp4"))
    kernel = MoEKernel(LocalPrepareFinalize(), TritonExperts())
    with pinned_config(MoEConfig.simple(1, 32, 64)):
        steps = [s.name for s in kernel.experts.steps(p, kernel.experts.launch(p))]
        buffers = {b.name for b in kernel.plan(p).buffers}
    assert steps == ["gemm1_slots", "gemm2_slots", "reduce"] and buffers == {"act", "y"}
