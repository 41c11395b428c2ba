"""MXFP4 in the mma layout (:mod:`fusedmoe.mxfp4_layout`): the re-laid format (torch, CPU) and the expert GEMMs
that read it, against the same GEMMs on the dequantized weights (CPU interpreter in float32 through the portable
decode; bf16 on the GPU through the PTX decode)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from devices import INTERPRETING, TRITON_DEVICE_DTYPES

from fusedmoe.mxfp4 import E2M1_VALUES, GROUP, dequantize_mxfp4, quantize_mxfp4
from fusedmoe.mxfp4_layout import MAX_SCALE_BYTE, SLOT_BITS, from_mma_layout, mma_shapes, to_mma_layout
from fusedmoe.ops.align import align_params, moe_align
from fusedmoe.ops.configs import GemmConfig
from fusedmoe.ops.expert_gemm import Numerics
from fusedmoe.ops.grouped_gemm import grid_blocks, moe_gemm1, moe_gemm2


def _random_mxfp4(*shape, seed=0, max_scale=MAX_SCALE_BYTE):
    g = torch.Generator().manual_seed(seed)
    *lead, N, K = shape
    packed = torch.randint(0, 256, (*lead, N, K // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(max_scale - 30, max_scale + 1, (*lead, N, K // GROUP), generator=g, dtype=torch.uint8)
    return packed, scales


# ---- the format -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("N,K", [(32, 64), (64, 96), (48, 2880)])  # K = 96, 2880: padded to whole 64-column chunks
def test_layout_round_trips(gated, N, K):
    packed, scales = _random_mxfp4(3, N, K)
    values, sc = to_mma_layout(packed, scales, gated)
    assert (values.shape[1:], sc.shape[1:]) == mma_shapes(N, K)
    back = from_mma_layout(values, sc, K, gated)
    assert torch.equal(back[0], packed) and torch.equal(back[1], scales)


def _kernel_decode(values: torch.Tensor, scales: torch.Tensor, K: int) -> torch.Tensor:
    """float64 weights [N, K] (layout rows) as the kernels decode one expert, written from the layout's definition
    alone: each 32-bit word masked after shifts of 0, 3, 6 (slots 0-2) or by its three pieces (slot 3), each 16-bit
    half read as bf16, times 2^(scale byte - 127)."""
    R, VB = values.shape
    words = values.view(R, VB // 4, 4).to(torch.int64)
    words = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24
    m = 0x81C081C0
    slots = [words & m, (words << 3) & m, (words << 6) & m]
    slots.append(((words << 1) & 0x80008000) | ((words >> 3) & 0x01800180) | ((words >> 7) & 0x00400040))

    def bf16(bits):  # 16-bit patterns -> float64
        return (bits << 16).to(torch.int32).view(torch.float32).double()

    # [R, words] x (slot s = 2 j + h, half t) -> [R, kc, g, q, kt, j, h, t] -> rows (R, h, g), cols (kc, kt, j, q, t)
    v = torch.stack([torch.stack([bf16(x & 0xFFFF), bf16((x >> 16) & 0xFFFF)], -1) for x in slots], -2)
    Kp = VB // 8
    v = v.view(R, Kp // 64, 8, 4, 4, 2, 2, 2).permute(0, 6, 2, 1, 4, 5, 3, 7).reshape(16 * R, Kp)
    s = scales.view(R, Kp // 64, 8, 2, 2).permute(0, 4, 2, 1, 3).reshape(16 * R, Kp // GROUP)
    scale = torch.exp2(s.double() - 127).repeat_interleave(GROUP, dim=1)
    return (v * scale)[:, :K]


@pytest.mark.parametrize("gated", [False, True])
def test_every_code_and_scale_decodes_exactly(gated):
    """Every e2m1 code under every scale byte the layout holds (0..128), decoded by the kernels' shifts and masks,
    gives the checkpoint's value exactly (e2m1 zero exponents land on bf16 subnormals, folded back by the scale)."""
    N, K = 32, 128 * 4  # 512 columns: every (code, scale byte) pair appears
    codes = torch.arange(16).repeat(N * K // 16).view(N, K)
    codes = codes[torch.randperm(N, generator=torch.Generator().manual_seed(1))]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scales = (torch.arange(N * K // GROUP) % (MAX_SCALE_BYTE + 1)).view(N, K // GROUP).to(torch.uint8)
    values, sc = to_mma_layout(packed, scales, gated)
    want = dequantize_mxfp4(packed, scales, torch.float64)
    if gated:  # layout rows: per 8 output columns, their gate rows then their up rows
        cols = torch.arange(N // 2).view(-1, 8)
        want = want[torch.stack((cols, cols + N // 2), dim=1).reshape(-1)]
    assert torch.equal(_kernel_decode(values, sc, K), want)


def test_slots_are_disjoint_and_cover_the_half():
    bits = [b for slot in SLOT_BITS for b in slot]
    assert sorted(bits) == list(range(16))


def test_refuses_what_it_cannot_hold():
    packed, scales = _random_mxfp4(2, 32, 64)
    scales[1, 3, 0] = MAX_SCALE_BYTE + 1
    with pytest.raises(ValueError, match="scale bytes up to 128"):
        to_mma_layout(packed, scales, gated=False)
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        to_mma_layout(*_random_mxfp4(40, 64), gated=True)
    with pytest.raises(ValueError, match="K = 64 does not match"):
        from_mma_layout(*to_mma_layout(*_random_mxfp4(32, 128), gated=False), K=64, gated=False)


def test_known_value():
    """Row 0 of a one-expert weight: +0.5 at column 0, -6 at column 1, scale 2^1 for the first 32 columns."""
    packed = torch.zeros(16, 32, dtype=torch.uint8)
    packed[0, 0] = 0x1 | (0xF << 4)
    scales = torch.full((16, 2), 127, dtype=torch.uint8)
    scales[0, 0] = 128
    values, sc = to_mma_layout(packed, scales, gated=False)
    w = _kernel_decode(values, sc, 64)
    assert w[0, 0] == 1.0 and w[0, 1] == -12.0 and w[0, 2:].eq(0).all() and w[1:].eq(0).all()
    assert E2M1_VALUES[1] == 0.5 and E2M1_VALUES[15] == -6.0


# ---- the GEMMs ----------------------------------------------------------------------------------------------------
CFG = GemmConfig(16, 32, 64)


def _setup(M, k, E, device, block_m):
    g = torch.Generator().manual_seed(M)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).int().to(device)
    s, b, _ = moe_align(ids, E, block_m)
    return s, b, grid_blocks(M * k, align_params(M * k, E, block_m).max_blocks)


def _mma(w: torch.Tensor, gated: bool, device):
    packed, scales = quantize_mxfp4(w)
    values, sc = to_mma_layout(packed, scales, gated)
    return values.to(device), sc.to(device), dequantize_mxfp4(packed, scales)


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("H,I,block_n", [(64, 32, 32), (96, 64, 32), (128, 96, 64)])  # 96: masked K / N tails
def test_gemm1_mma_matches_dequantized(device, dtype, activation, H, I, block_n):
    M, k, E = 13, 2, 3
    s, b, nb = _setup(M, k, E, device, CFG.block_m)
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    values, scales, w1 = _mma(torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(3)), True, device)
    bias = torch.randn(E, 2 * I).to(device, dtype) if activation == "swigluoai" else None
    ieee = dtype == torch.float32
    outs = []
    for w, num in (
        (values, Numerics(mode="mxfp4_mma", w_scale=scales, fp32_ieee=ieee)),
        (w1.to(device, dtype), Numerics(fp32_ieee=ieee)),
    ):
        out = torch.full((M * k, I), float("nan"), device=device, dtype=dtype)
        cfg = replace(CFG, block_n=block_n) if num.mode else CFG
        moe_gemm1(x, w, out, s, b, top_k=k, num_blocks=nb, config=cfg, activation=activation, numerics=num, bias=bias)
        outs.append(out.float())
    assert torch.isfinite(outs[0]).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (outs[0] - outs[1]).norm() / outs[1].norm() < tol


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize("H,I", [(32, 64), (48, 96)])  # 48: a partial 32-row tile; 96: the K tail
def test_gemm2_mma_matches_dequantized(device, dtype, H, I):
    M, k, E = 9, 3, 4
    a = torch.randn(M * k, I, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    tw = torch.rand(M, k, generator=torch.Generator().manual_seed(5)).to(device)
    values, scales, w2 = _mma(torch.randn(E, H, I, generator=torch.Generator().manual_seed(6)), False, device)
    ieee = dtype == torch.float32
    s, b, nb = _setup(M, k, E, device, CFG.block_m)
    outs = []
    for w, num in (
        (values, Numerics(mode="mxfp4_mma", w_scale=scales, fp32_ieee=ieee)),
        (w2.to(device, dtype), Numerics(fp32_ieee=ieee)),
    ):
        out = torch.full((M * k, H), float("nan"), device=device, dtype=dtype)
        moe_gemm2(a, w, out, s, b, num_blocks=nb, config=CFG, topk_weights=tw, numerics=num)
        outs.append(out.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.isfinite(outs[0]).all() and (outs[0] - outs[1]).norm() / outs[1].norm() < tol


def test_gemm_refuses_tiles_the_layout_cannot_feed():
    values, scales, _ = _mma(torch.randn(2, 64, 64), True, "cpu")
    x = torch.randn(4, 64)
    s, b, nb = _setup(4, 1, 2, "cpu", 1)
    out = torch.empty(4, 32)
    num = Numerics(mode="mxfp4_mma", w_scale=scales)
    for bad in (GemmConfig(1, 32, 64), GemmConfig(16, 24, 64), GemmConfig(16, 32, 32)):
        with pytest.raises(ValueError, match="mxfp4_mma needs BLOCK_M >= 16"):
            moe_gemm1(x, values, out, s, b, top_k=1, num_blocks=nb, config=bad, numerics=num)
    with pytest.raises(TypeError, match="no a_scale"):
        moe_gemm1(x.half().to(torch.float8_e4m3fn), values, out, s, b, top_k=1, num_blocks=nb, config=CFG, numerics=num)


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
def test_gemm_decodes_every_code_and_scale_exactly(device, dtype):
    """GEMM2 of one-hot activation rows returns the weights themselves: every e2m1 code under every scale byte the
    layout holds (0..128, down to bf16 subnormals) comes out of the kernel's decode and dot bit for bit (float32
    output; on the GPU through the PTX decode and the bf16 tensor cores)."""
    H, I = 32, 512  # one expert's [32, 512] weight: 16,384 codes, every (code, scale byte) pair among them
    codes = (
        torch.arange(16).repeat(H * I // 16).view(H, I)[torch.randperm(H, generator=torch.Generator().manual_seed(2))]
    )
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)[None]
    scales = (torch.arange(H * I // GROUP) % (MAX_SCALE_BYTE + 1)).view(1, H, I // GROUP).to(torch.uint8)
    values, sc = (t.to(device) for t in to_mma_layout(packed, scales, gated=False))
    slots = I  # slot i's row is the one-hot of column i, all on expert 0
    a = torch.eye(I, device=device, dtype=dtype)
    s, b, nb = _setup_one_expert(slots, device)
    out = torch.full((slots, H), float("nan"), device=device, dtype=torch.float32)
    moe_gemm2(
        a,
        values,
        out,
        s,
        b,
        num_blocks=nb,
        config=replace(CFG, block_k=128),
        numerics=Numerics("mxfp4_mma", w_scale=sc, fp32_ieee=True),
    )
    want = dequantize_mxfp4(packed, scales)[0].T.to(device)
    assert torch.equal(out, want)


def _setup_one_expert(slots: int, device):
    ids = torch.zeros(slots, 1, dtype=torch.int32, device=device)
    s, b, _ = moe_align(ids, 1, CFG.block_m)
    return s, b, grid_blocks(slots, align_params(slots, 1, CFG.block_m).max_blocks)


# ---- fused_moe on the mma layout ----------------------------------------------------------------------------------
def _edge_case(case: str, M: int, E: int, k: int):
    """topk ids of an edge case: random, all tokens on expert 0, top-k = E, or half the experts idle."""
    g = torch.Generator().manual_seed(M + k)
    if M == 0:
        return torch.zeros(0, k, dtype=torch.int32), torch.zeros(0, k)
    if case == "one_expert":
        ids = torch.stack(
            [torch.cat([torch.tensor([0]), torch.randperm(E - 1, generator=g)[: k - 1] + 1]) for _ in range(M)]
        )
    elif case == "idle":
        ids = torch.stack([torch.randperm(E // 2, generator=g)[:k] for _ in range(M)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    return ids.to(torch.int32), torch.rand(M, k, generator=g)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    "case,M,k,expert_map",
    [("random", 9, 2, False), ("random", 0, 2, False), ("random", 1, 2, False), ("one_expert", 7, 2, False),
     ("idle", 8, 2, False), ("random", 5, 4, False), ("random", 6, 2, True)],
)  # fmt: skip
def test_fused_moe_mma_matches_the_reference(backend, case, M, k, expert_map):
    """fused_moe(quant="mxfp4_mma") against the float64 reference on the dequantized weights, over the edge grid
    (M = 0 and 1, top-k = E, tokens all on one expert, idle experts, non-local experts of an expert map), with a
    poisoned workspace; H = 96 and I = 96 leave masked K and N tails."""
    if backend == "triton" and not INTERPRETING:
        pytest.skip("the Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    from fusedmoe import WorkspaceManager, fused_moe, quantize_weights
    from fusedmoe.reference import fused_moe_reference

    E, H, I = 4, 96, 96
    g = torch.Generator().manual_seed(11)
    w1, w2, s1, s2 = quantize_weights(
        torch.randn(E, 2 * I, H, generator=g) / 8, torch.randn(E, H, I, generator=g) / 8, "mxfp4_mma"
    )
    x = torch.randn(M, H, generator=g)
    ids, tw = _edge_case(case, M, E, k)
    kw = dict(quant="mxfp4_mma", w1_scale=s1, w2_scale=s2)
    if expert_map:  # 6 global experts, experts 1 and 4 on another rank
        emap = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32)
        ids = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(M)]).to(torch.int32) if M else ids
        kw.update(expert_map=emap, global_num_experts=6)
    out = fused_moe(x, w1, w2, tw, ids, backend=backend, workspace=WorkspaceManager("cpu", poison=True), **kw)
    ref = fused_moe_reference(x, w1, w2, tw, ids, **kw)
    assert out.shape == (M, H) and torch.isfinite(out).all()
    if M:
        assert (out.double() - ref).norm() / ref.norm() < 1e-5


def test_fused_moe_refuses_wrong_mma_arguments_by_name():
    from fusedmoe import fused_moe, quantize_weights

    E, H, I = 2, 64, 32
    w1, w2, s1, s2 = quantize_weights(torch.randn(E, 2 * I, H), torch.randn(E, H, I), "mxfp4_mma")
    x, ids, tw = torch.randn(3, H), torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    with pytest.raises(ValueError, match=r"w2 must be the mma layout \[2, 4, 512\]"):
        fused_moe(x, w1, w2[:, :2], tw, ids, quant="mxfp4_mma", w1_scale=s1, w2_scale=s2)
    with pytest.raises(TypeError, match="w1_scale must be uint8"):
        fused_moe(x, w1, w2, tw, ids, quant="mxfp4_mma", w1_scale=s1.float(), w2_scale=s2)
    with pytest.raises(ValueError, match="w2_scale must have shape"):
        fused_moe(x, w1, w2, tw, ids, quant="mxfp4_mma", w1_scale=s1, w2_scale=s2[..., :4])
    with pytest.raises(ValueError, match="a1_scale was given"):
        fused_moe(x, w1, w2, tw, ids, quant="mxfp4_mma", w1_scale=s1, w2_scale=s2, a1_scale=torch.ones(1))
    with pytest.raises(ValueError, match="H and I multiples of 32"):
        fused_moe(torch.randn(3, 48), w1, w2, tw, ids, quant="mxfp4_mma", w1_scale=s1, w2_scale=s2)
