"""MXFP4 weights: the format (torch, CPU) and the expert GEMMs' mxfp4 weight mode against the same GEMMs on the
dequantized weights (CPU interpreter in float32, bf16 on the GPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from devices import TRITON_DEVICE_DTYPES, TRITON_DEVICES, interpreter

from fusedmoe.mxfp4 import (
    E2M1_VALUES,
    GROUP,
    check_mxfp4,
    dequantize_mxfp4,
    from_checkpoint_blocks,
    quantize_mxfp4,
    split_interleaved_rows,
)
from fusedmoe.ops.align import align_params, moe_align
from fusedmoe.ops.batched_gemm import batched_gemm1, batched_gemm2
from fusedmoe.ops.configs import GemmConfig
from fusedmoe.ops.expert_gemm import Numerics
from fusedmoe.ops.grouped_gemm import grid_blocks, moe_gemm1, moe_gemm2


# ---- the format -------------------------------------------------------------------------------------------------
def test_known_bytes_decode():
    """Low nibble first; e2m1 codes are sign, 2 exponent bits, 1 mantissa bit; a scale byte s means 2^(s-127)."""
    packed = torch.tensor([[0x21] + [0] * 15, [0xF8] + [0x77] * 15], dtype=torch.uint8)
    scales = torch.tensor([[127], [129]], dtype=torch.uint8)
    w = dequantize_mxfp4(packed, scales)
    assert w[0, :2].tolist() == [0.5, 1.0] and w[0, 2:].eq(0).all()
    assert w[1, 0].item() == 0.0 and torch.signbit(w[1, 0]) and w[1, 1].item() == -6.0 * 4
    assert w[1, 2:].eq(6.0 * 4).all()
    assert len(E2M1_VALUES) == 16 and E2M1_VALUES[7] == 6.0 and E2M1_VALUES[9] == -0.5


def test_representable_weights_round_trip_exactly():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4, 6, 96), generator=g)
    codes[..., ::GROUP] = 7  # each group holds a +6, so its scale is the one it was built with
    exps = torch.randint(-20, 20, (4, 6, 96 // GROUP), generator=g).float()
    w = torch.tensor(E2M1_VALUES)[codes] * torch.exp2(exps).repeat_interleave(GROUP, dim=-1)
    packed, scales = quantize_mxfp4(w)
    assert packed.shape == (4, 6, 48) and scales.shape == (4, 6, 3)
    assert torch.equal(dequantize_mxfp4(packed, scales), w)


def test_quantization_error_and_fixed_point():
    w = torch.randn(8, 16, 128, generator=torch.Generator().manual_seed(1))
    packed, scales = quantize_mxfp4(w)
    d = dequantize_mxfp4(packed, scales)
    assert (d - w).norm() / w.norm() < 0.15  # 4-bit values with a shared power-of-two scale per 32
    assert (d.abs() <= w.abs().unflatten(-1, (4, GROUP)).amax(-1).repeat_interleave(GROUP, -1) * 1.5).all()
    again = quantize_mxfp4(d)
    assert torch.equal(again[0], packed) and torch.equal(again[1], scales)
    zeros = quantize_mxfp4(torch.zeros(2, 32))
    assert dequantize_mxfp4(*zeros).eq(0).all()


def test_chunked_quantization_matches_one_pass(monkeypatch):
    """Whole expert stacks are (de)quantized a chunk of rows at a time (gpt-oss-120b's would otherwise need
    over 100 GB of temporaries): chunks of 4 rows (the last one partial) give the bytes and values of a single
    pass."""
    import fusedmoe.mxfp4 as mx

    w = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(8))
    one_pass = quantize_mxfp4(w)
    values = dequantize_mxfp4(*one_pass)
    monkeypatch.setattr(mx, "CHUNK_ELEMENTS", 4 * 64)  # 21 rows: chunks of 4, 4, 4, 4, 4, 1
    chunked = quantize_mxfp4(w)
    assert all(torch.equal(a, b) for a, b in zip(one_pass, chunked))
    assert chunked[0].shape == (3, 7, 32) and chunked[1].shape == (3, 7, 2)
    assert torch.equal(dequantize_mxfp4(*chunked), values)


def test_checkpoint_blocks_and_interleaved_rows():
    """gpt-oss's blocks [E, N, K/32, 16] are the packed bytes; its gate_up rows alternate gate, up."""
    w = torch.randn(2, 8, 64)
    packed, scales = quantize_mxfp4(w)
    blocks = packed.unflatten(-1, (2, 16))
    p2, s2 = from_checkpoint_blocks(blocks, scales)
    assert torch.equal(p2, packed) and p2.data_ptr() == packed.data_ptr()
    ps, ss = split_interleaved_rows(packed, scales)
    d, ds = dequantize_mxfp4(packed, scales), dequantize_mxfp4(ps, ss)
    assert torch.equal(ds[:, :4], d[:, 0::2]) and torch.equal(ds[:, 4:], d[:, 1::2])


@pytest.mark.parametrize(
    "packed,scales,error,match",
    [
        (torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8), TypeError, "w must be uint8"),
        (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1), TypeError, "w_scale must be uint8"),
        (
            torch.zeros(2, 16, dtype=torch.uint8),
            torch.zeros(2, 2, dtype=torch.uint8),
            ValueError,
            r"w_scale must be \[2, 1\]",
        ),
        (torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 0, dtype=torch.uint8), ValueError, "multiple of 32"),
    ],
)
def test_invalid_weights_name_the_argument(packed, scales, error, match):
    with pytest.raises(error, match=match):
        check_mxfp4("w", packed, scales)


def test_shape_mismatch_and_bad_blocks():
    packed, scales = quantize_mxfp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"holds a \[4, 64\] MXFP4 weight, expected \[4, 96\]"):
        check_mxfp4("w1", packed, scales, shape=(4, 96))
    with pytest.raises(ValueError, match="blocks must be"):
        from_checkpoint_blocks(packed, scales)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 40))


# ---- the GEMMs' mxfp4 weight mode -------------------------------------------------------------------------------
CFG = GemmConfig(16, 32, 64)
#: BLOCK_M 16 (dots: tl.dot_scaled for bf16 on the GPU, else decode + dot) and the decode-sized rows of the
#: multiply-add K loop (1: one slot per block, 4: a few).
BLOCK_MS = [16, 1, 4]


def _setup(M, k, E, device, block_m=CFG.block_m):
    g = torch.Generator().manual_seed(M)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).int().to(device)
    s, b, _ = moe_align(ids, E, block_m)
    return s, b, grid_blocks(M * k, align_params(M * k, E, block_m).max_blocks)


def _mx(w, device):
    packed, scales = quantize_mxfp4(w)
    return packed.to(device), scales.to(device), dequantize_mxfp4(packed, scales)


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("H", [64, 96])  # 96: K is not a multiple of BLOCK_K (a masked tail tile)
@pytest.mark.parametrize("block_m", BLOCK_MS)
def test_gemm1_mxfp4_matches_dequantized(device, dtype, activation, H, block_m):
    M, k, E, I = 13, 2, 3, 40  # I: not a multiple of BLOCK_N
    s, b, nb = _setup(M, k, E, device, block_m)
    cfg = replace(CFG, block_m=block_m)
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    packed, scales, w1 = _mx(torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(3)), device)
    bias = torch.randn(E, 2 * I).to(device, dtype) if activation == "swigluoai" else None
    ieee = dtype == torch.float32
    outs = []
    for w, num in (
        (packed, Numerics(mode="mxfp4", w_scale=scales, fp32_ieee=ieee)),
        (w1.to(device, dtype), Numerics(fp32_ieee=ieee)),
    ):
        out = torch.full((M * k, I), float("nan"), device=device, dtype=dtype)
        cfg_w = cfg if num.mode == "mxfp4" else CFG  # the dense reference's K loop is a dot: 16 rows at least
        s_w, b_w, nb_w = (s, b, nb) if num.mode == "mxfp4" else _setup(M, k, E, device)
        moe_gemm1(
            x, w, out, s_w, b_w, top_k=k, num_blocks=nb_w, config=cfg_w, activation=activation, numerics=num, bias=bias
        )
        outs.append(out.float())
    assert torch.isfinite(outs[0]).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (outs[0] - outs[1]).norm() / outs[1].norm() < tol


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize("block_m", BLOCK_MS)
def test_gemm2_mxfp4_matches_dequantized(device, dtype, block_m):
    M, k, E, H, I = 9, 3, 4, 40, 64
    a = torch.randn(M * k, I, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    tw = torch.rand(M, k, generator=torch.Generator().manual_seed(5)).to(device)
    packed, scales, w2 = _mx(torch.randn(E, H, I, generator=torch.Generator().manual_seed(6)), device)
    ieee = dtype == torch.float32
    outs = []
    for w, num, bm in (
        (packed, Numerics(mode="mxfp4", w_scale=scales, fp32_ieee=ieee), block_m),
        (w2.to(device, dtype), Numerics(fp32_ieee=ieee), CFG.block_m),
    ):
        s, b, nb = _setup(M, k, E, device, bm)
        out = torch.full((M * k, H), float("nan"), device=device, dtype=dtype)
        moe_gemm2(a, w, out, s, b, num_blocks=nb, config=replace(CFG, block_m=bm), topk_weights=tw, numerics=num)
        outs.append(out.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.isfinite(outs[0]).all() and (outs[0] - outs[1]).norm() / outs[1].norm() < tol


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize("block_m", BLOCK_MS)
def test_batched_gemms_mxfp4_match_dequantized(device, dtype, block_m):
    E, T, H, I = 3, 20, 64, 32
    mx = replace(CFG, block_m=block_m)
    counts = torch.tensor([20, 0, 7], dtype=torch.int32, device=device)  # a full, an idle and a partial expert
    g = torch.Generator().manual_seed(7)
    a = torch.randn(E, T, H, generator=g).to(device, dtype)
    p1, s1, w1 = _mx(torch.randn(E, 2 * I, H, generator=g), device)
    p2, s2, w2 = _mx(torch.randn(E, H, I, generator=g), device)
    ieee = dtype == torch.float32
    mid = [torch.zeros(E, T, I, device=device, dtype=dtype) for _ in range(2)]
    batched_gemm1(a, p1, mid[0], counts, config=mx, numerics=Numerics(mode="mxfp4", w_scale=s1, fp32_ieee=ieee))
    batched_gemm1(a, w1.to(device, dtype), mid[1], counts, config=CFG, numerics=Numerics(fp32_ieee=ieee))
    out = [torch.zeros(E, T, H, device=device, dtype=dtype) for _ in range(2)]
    batched_gemm2(mid[1], p2, out[0], counts, config=mx, numerics=Numerics(mode="mxfp4", w_scale=s2, fp32_ieee=ieee))
    batched_gemm2(mid[1], w2.to(device, dtype), out[1], counts, config=CFG, numerics=Numerics(fp32_ieee=ieee))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in ((mid[0], mid[1]), (out[0], out[1])):
        assert (got.float() - want.float()).norm() / want.float().norm() < tol
    assert out[0][1].eq(0).all()  # the idle expert's rows are not written


def test_mxfp4_dot_choice(monkeypatch):
    """bf16 on the GPU takes tl.dot_scaled; float32, fp16, the interpreter and the diagnostic switch decode (tiles of
    fewer than 16 rows multiply-add under either code: test_triton_experts.test_small_tiles_compile_without_dots)."""
    from fusedmoe.ops.expert_gemm import ENV_MXFP4_DOT, MXFP4_SCALED_DOT, QUANT_CODES, mxfp4_quant_code

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(ENV_MXFP4_DOT, raising=False)
    assert mxfp4_quant_code(torch.bfloat16) == MXFP4_SCALED_DOT
    assert mxfp4_quant_code(torch.float32) == mxfp4_quant_code(torch.float16) == QUANT_CODES["mxfp4"]
    monkeypatch.setenv(ENV_MXFP4_DOT, "decode")
    assert mxfp4_quant_code(torch.bfloat16) == QUANT_CODES["mxfp4"]
    monkeypatch.delenv(ENV_MXFP4_DOT)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert mxfp4_quant_code(torch.bfloat16) == QUANT_CODES["mxfp4"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_k", [32, 64, 128])
def test_scaled_dot_and_decode_agree(monkeypatch, dtype, block_k):
    """The MXFP4 K loops on the GPU (bf16: tl.dot_scaled, then the register decode; fp16: the decode; both: the
    multiply-adds of 1- and 4-row blocks) match GEMM1 on the dequantized weights, with a K tail (H = 96 + 64) and
    N not a multiple of the tile."""
    from fusedmoe.ops.expert_gemm import ENV_MXFP4_DOT, MXFP4_SCALED_DOT, QUANT_CODES, mxfp4_quant_code

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    M, k, E, H, I = 37, 2, 3, 160, 40
    cfg = GemmConfig(16, 32, block_k)
    g = torch.Generator().manual_seed(11)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).int().cuda()
    s, b, _ = moe_align(ids, E, cfg.block_m)
    nb = grid_blocks(M * k, align_params(M * k, E, cfg.block_m).max_blocks)
    x = torch.randn(M, H, generator=g).to("cuda", dtype)
    packed, scales, w1 = _mx(torch.randn(E, 2 * I, H, generator=g), "cuda")
    outs = {}
    for path in ("scaled", "decode"):
        monkeypatch.setenv(ENV_MXFP4_DOT, path)
        scaled = path == "scaled" and dtype == torch.bfloat16
        assert mxfp4_quant_code(dtype) == (MXFP4_SCALED_DOT if scaled else QUANT_CODES["mxfp4"])
        out = torch.full((M * k, I), float("nan"), device="cuda", dtype=dtype)
        num = Numerics(mode="mxfp4", w_scale=scales)
        moe_gemm1(x, packed, out, s, b, top_k=k, num_blocks=nb, config=cfg, activation="silu", numerics=num)
        outs[path] = out.float()
    for bm in (1, 4):  # the multiply-add loop of decode-sized blocks
        s_m, b_m, _ = moe_align(ids, E, bm)
        nb_m = grid_blocks(M * k, align_params(M * k, E, bm).max_blocks)
        out = torch.full((M * k, I), float("nan"), device="cuda", dtype=dtype)
        num = Numerics(mode="mxfp4", w_scale=scales)
        cfg_m = replace(cfg, block_m=bm)
        moe_gemm1(x, packed, out, s_m, b_m, top_k=k, num_blocks=nb_m, config=cfg_m, activation="silu", numerics=num)
        outs[f"fma{bm}"] = out.float()
    ref = torch.empty(M * k, I, device="cuda", dtype=dtype)
    moe_gemm1(x, w1.to("cuda", dtype), ref, s, b, top_k=k, num_blocks=nb, config=cfg, activation="silu")
    for got in outs.values():
        assert torch.isfinite(got).all() and (got - ref.float()).norm() / ref.float().norm() < 2e-2


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("block_m", [16, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_byte_and_scale_decodes_exactly(monkeypatch, device, block_m, dtype):
    """The kernels' decode of every byte value (both nibbles) under e8m0 scales across the range: GEMM2 on one-hot
    activation rows reads each weight column back, equal to the torch decode bit for bit (the products are exact in
    float32, TF32 and bf16: e2m1 values have 2 significant bits). float32: the bit-assembled register decode; bf16
    on the GPU: ``tl.dot_scaled``'s upcast (16-row tiles, with ``fast_math``) and the one-row word decode."""
    from fusedmoe.ops.expert_gemm import ENV_MXFP4_DOT, MXFP4_SCALED_DOT, mxfp4_quant_code

    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter has no tl.dot_scaled and no exact bf16")
    monkeypatch.delenv(ENV_MXFP4_DOT, raising=False)  # the shipped K loops, whatever the caller's environment
    assert (mxfp4_quant_code(dtype) == MXFP4_SCALED_DOT) == (dtype == torch.bfloat16)
    E, N, K = 1, 16, 64  # 16 rows x 32 bytes: every byte value twice
    packed = torch.arange(N * K // 2, dtype=torch.int32).remainder(256).to(torch.uint8).reshape(E, N, K // 2)
    low = [0, 1, 2] if device == "cpu" else [3]  # subnormal scales: exact on the CPU; the GPU may flush them
    picks = torch.tensor(low + [60, 100, 126, 127, 128, 129, 140, 200, 250, 252], dtype=torch.int32)
    scales = picks[torch.arange(N * K // GROUP) % len(picks)].to(torch.uint8).reshape(E, N, K // GROUP)
    want = dequantize_mxfp4(packed, scales)[0]  # [N, K]
    ids = torch.zeros(K, 1, dtype=torch.int32, device=device)  # K tokens, all on the one expert
    s, b, _ = moe_align(ids, E, block_m)
    nb = grid_blocks(K, align_params(K, E, block_m).max_blocks)
    out = torch.full((K, N), float("nan"), device=device, dtype=dtype)
    num = Numerics(mode="mxfp4", w_scale=scales.to(device), fp32_ieee=True)
    cfg = GemmConfig(block_m, 16, 64)
    eye = torch.eye(K, device=device, dtype=dtype)
    moe_gemm2(eye, packed.to(device), out, s, b, num_blocks=nb, config=cfg, numerics=num)
    assert torch.equal(out.float().cpu(), want.T)


@interpreter
def test_gemm_mxfp4_rejects_bad_operands():
    device = "cpu"
    s, b, nb = _setup(4, 2, 3, device)
    x = torch.randn(4, 64)
    packed, scales, _ = _mx(torch.randn(3, 16, 64), device)
    out = torch.empty(8, 8)
    num = Numerics(mode="mxfp4", w_scale=scales)
    with pytest.raises(ValueError, match="BLOCK_K must be a multiple of 32"):
        moe_gemm1(x, packed, out, s, b, top_k=2, num_blocks=nb, config=GemmConfig(16, 32, 16), numerics=num)
    with pytest.raises(ValueError, match="w_scale must be"):
        moe_gemm1(
            x, packed, out, s, b, top_k=2, num_blocks=nb, config=CFG, numerics=num._replace(w_scale=scales[..., :1])
        )
    with pytest.raises(TypeError, match="unquantized activations"):
        moe_gemm1(x.to(torch.float8_e4m3fn), packed, out, s, b, top_k=2, num_blocks=nb, config=CFG, numerics=num)
    with pytest.raises(TypeError, match="must be uint8"):
        moe_gemm1(x, packed.view(torch.int8), out, s, b, top_k=2, num_blocks=nb, config=CFG, numerics=num)
    # the one-row loop reads aligned 32-bit words: byte rows that are not (a view one byte in) are refused
    shifted = torch.zeros(packed.numel() + 1, dtype=torch.uint8)[1:].view(packed.shape).copy_(packed)
    with pytest.raises(ValueError, match="4-byte aligned"):
        moe_gemm1(x, shifted, out, s, b, top_k=2, num_blocks=nb, config=CFG, numerics=num)
    with pytest.raises(ValueError, match="contiguous along K"):
        moe_gemm1(
            x,
            packed.transpose(1, 2).contiguous().transpose(1, 2),
            out,
            s,
            b,
            top_k=2,
            num_blocks=nb,
            config=CFG,
            numerics=num,
        )


# ---- fused_moe(quant="mxfp4") -----------------------------------------------------------------------------------
def _mx_call(M, E, k, H, I, *, device, dtype, bias=False, ids=None, seed=0):
    from fusedmoe.quant import quantize_weights

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).to(device, dtype)
    w1q, w2q, s1, s2 = quantize_weights(
        torch.randn(E, 2 * I, H, generator=g) / 8, torch.randn(E, H, I, generator=g) / 6, "mxfp4"
    )
    tw = torch.rand(M, k, generator=g).to(device)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)] or [torch.zeros(0)]).reshape(M, k)
    kw = dict(quant="mxfp4", w1_scale=s1.to(device), w2_scale=s2.to(device))
    if bias:
        kw.update(
            w1_bias=torch.randn(E, 2 * I, generator=g).to(device, dtype),
            w2_bias=torch.randn(E, H, generator=g).to(device, dtype),
        )
    return x, w1q.to(device), w2q.to(device), tw, ids.to(device, torch.int32), kw


def _check_against_reference(out, args, kw, dtype, **extra):
    from fusedmoe.reference import fused_moe_reference

    ref = fused_moe_reference(*args, **kw, **extra)
    assert out.dtype == dtype and torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    denom = ref.norm().item() or 1.0
    assert (out.double() - ref).norm().item() / denom < tol


def _case(case: str):
    """(fused_moe args, extra keywords) of a named float32 CPU case."""
    dtype, extra = torch.float32, {}
    if case == "plain":
        args = _mx_call(9, 4, 2, 64, 32, device="cpu", dtype=dtype)
    elif case == "gpt_oss":  # swigluoai with biases, I not a multiple of the tile
        args = _mx_call(9, 4, 2, 64, 96, device="cpu", dtype=dtype, bias=True)
        extra["activation"] = "swigluoai"
    elif case == "expert_map":
        ids = torch.tensor([[0, 3], [1, 2], [3, 4], [5, 1], [2, 0]])
        args = _mx_call(5, 3, 2, 32, 32, device="cpu", dtype=dtype, ids=ids)
        extra.update(expert_map=torch.tensor([-1, 0, 1, -1, 2, -1], dtype=torch.int32), global_num_experts=6)
    elif case == "M1":
        args = _mx_call(1, 4, 2, 32, 64, device="cpu", dtype=dtype)
    elif case == "topk_equals_E":
        args = _mx_call(6, 3, 3, 32, 32, device="cpu", dtype=dtype)
    else:
        args = _mx_call(12, 4, 1, 32, 32, device="cpu", dtype=dtype, ids=torch.full((12, 1), 2))
    return args, extra


CASES = ["plain", "gpt_oss", "expert_map", "M1", "topk_equals_E", "all_on_one"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES)
def test_fused_moe_mxfp4_matches_the_reference(backend, case):
    """On the CPU: the torch backend (weights decoded in row chunks) and, under the interpreter, the Triton
    kernels, against the float64 reference on the dequantized weights."""
    from devices import INTERPRETING

    from fusedmoe import fused_moe
    from fusedmoe.workspace.manager import WorkspaceManager

    if backend == "triton" and not INTERPRETING:
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    (x, w1, w2, tw, ids, kw), extra = _case(case)
    out = fused_moe(x, w1, w2, tw, ids, backend=backend, workspace=WorkspaceManager("cpu", poison=True), **kw, **extra)
    _check_against_reference(out, (x, w1, w2, tw, ids), kw, torch.float32, **extra)


@interpreter
@pytest.mark.parametrize("block_m", [1, 4])
@pytest.mark.parametrize("case", CASES)
def test_fused_moe_mxfp4_decode_sized_blocks(case, block_m):
    """The multiply-add K loop (BLOCK_M < 16, what decode-sized batches get) through the whole layer, poisoned
    scratch, against the float64 reference: padding rows of partly filled blocks, idle and non-local experts."""
    from fusedmoe import fused_moe
    from fusedmoe.ops.configs import MoEConfig, pinned_config
    from fusedmoe.workspace.manager import WorkspaceManager

    (x, w1, w2, tw, ids, kw), extra = _case(case)
    with pinned_config(MoEConfig.simple(block_m, 32, 64)):
        out = fused_moe(
            x, w1, w2, tw, ids, backend="triton", workspace=WorkspaceManager("cpu", poison=True), **kw, **extra
        )
    _check_against_reference(out, (x, w1, w2, tw, ids), kw, torch.float32, **extra)


@interpreter
def test_fused_moe_mxfp4_refuses_misaligned_weights_after_a_cached_call():
    """The one-row loop reads packed weights as aligned 32-bit words: a view of the same shape and strides one
    byte off (the same 16-byte verdict as a 4-byte-aligned one) is still refused, not served a cached verdict."""
    from fusedmoe import fused_moe
    from fusedmoe.ops.configs import MoEConfig, pinned_config

    x, w1, w2, tw, ids, kw = _mx_call(2, 4, 2, 64, 32, device="cpu", dtype=torch.float32)

    def at_offset(w, offset):  # w's bytes copied into a buffer at ``offset`` bytes (16-aligned storage)
        buf = torch.zeros(w.numel() + 16, dtype=torch.uint8)
        return buf[offset : offset + w.numel()].view(w.shape).copy_(w)

    with pinned_config(MoEConfig.simple(1, 32, 64)):
        want = fused_moe(x, at_offset(w1, 4), w2, tw, ids, backend="triton", **kw)
        torch.testing.assert_close(fused_moe(x, at_offset(w1, 8), w2, tw, ids, backend="triton", **kw), want)
        with pytest.raises(ValueError, match="4-byte aligned"):
            fused_moe(x, at_offset(w1, 5), w2, tw, ids, backend="triton", **kw)


@pytest.mark.gpu
def test_fused_moe_mxfp4_on_the_gpu():
    from fusedmoe import fused_moe

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for M in (1, 8, 100):
        x, w1, w2, tw, ids, kw = _mx_call(M, 8, 2, 256, 192, device="cuda", dtype=torch.bfloat16, bias=True)
        out = fused_moe(x, w1, w2, tw, ids, activation="swigluoai", **kw)
        _check_against_reference(out, (x, w1, w2, tw, ids), kw, torch.bfloat16, activation="swigluoai")


def test_fused_moe_mxfp4_empty_batch():
    from fusedmoe import fused_moe

    x, w1, w2, tw, ids, kw = _mx_call(0, 4, 2, 32, 32, device="cpu", dtype=torch.float32)
    assert fused_moe(x, w1, w2, tw, ids, backend="torch", **kw).shape == (0, 32)


def test_fused_moe_mxfp4_validation_names_the_argument():
    from fusedmoe import fused_moe
    from fusedmoe.checks import GradientNotSupportedError

    x, w1, w2, tw, ids, kw = _mx_call(4, 3, 2, 64, 32, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"w1_scale must be \[3, 64, 2\]"):
        fused_moe(x, w1, w2, tw, ids, **{**kw, "w1_scale": kw["w1_scale"][..., :1]})
    with pytest.raises(ValueError, match="needs w2_scale"):
        fused_moe(x, w1, w2, tw, ids, **{**kw, "w2_scale": None})
    with pytest.raises(ValueError, match="a1_scale was given but quant='mxfp4' quantizes weights only"):
        fused_moe(x, w1, w2, tw, ids, a1_scale=torch.ones(1), **kw)
    with pytest.raises(TypeError, match="w1 must be uint8"):
        fused_moe(x, w1.view(torch.int8), w2, tw, ids, **kw)
    with pytest.raises(
        ValueError, match=r"w1 must be \[E, 2I, H\] with H=32 \(from hidden_states\) \(MXFP4: H/2 bytes"
    ):
        fused_moe(x[:, :32], w1, w2, tw, ids, **kw)
    with pytest.raises(GradientNotSupportedError, match=r"quantized calls \(fp8, mxfp4\) have no backward"):
        fused_moe(x.requires_grad_(), w1, w2, tw, ids, backend="torch", **kw)


def test_mxfp4_never_takes_an_fp8_table():
    """The shipped H200 tables are tuned for bf16 and fp8 operands; MXFP4 (bf16 activations, decoded weights)
    looks for tables of its own and, finding none, uses the heuristic with K tiles of whole scale groups."""
    from fusedmoe.ops.configs import config_file_name, get_config, heuristic_config, load_table

    assert config_file_name(32, 2880, "NVIDIA_H200", "mxfp4").endswith(",dtype=mxfp4_w4a16.json")
    assert load_table(32, 2880, "NVIDIA_H200", "fp8_tensor") is not None  # gpt-oss-20b's fp8 table exists
    assert load_table(32, 2880, "NVIDIA_H200", "mxfp4") is None
    for M in (1, 64, 4096):
        cfg = get_config(M, 32, 2880, 2880, 4, quant_mode="mxfp4", device="NVIDIA_H200")
        assert cfg == heuristic_config(M, 32, 2880, 2880, 4, "mxfp4")


def test_decode_sized_mxfp4_blocks_take_the_multiply_add_loop():
    """Up to DECODE_ROWS rows per expert, MXFP4 problems get one-row blocks with the rows of an expert side by side
    in the grid (GROUP_M > 1), never other modes; above it, 16-row tiles and dots as before."""
    from fusedmoe.ops.configs import DECODE_ROWS, heuristic_config
    from fusedmoe.ops.expert_gemm import MIN_DOT_BLOCK_M

    E, H, I, k = 32, 2880, 2880, 4  # gpt-oss-20b: rows per expert = M * k / E
    assert heuristic_config(1, E, H, I, k, "mxfp4").block_m == 1
    decode = heuristic_config(int(DECODE_ROWS * E / k), E, H, I, k, "mxfp4")  # the most rows that still take them
    assert decode.block_m == 1 and decode.gemm1.group_m > 1 and decode.gemm2.group_m > 1
    assert heuristic_config(int(DECODE_ROWS * E / k) + 1, E, H, I, k, "mxfp4").block_m >= MIN_DOT_BLOCK_M
    # one row per expert: one-row blocks of the word-decode loop win (331 us against 394 for dots, H200); two: dots
    assert heuristic_config(8, E, H, I, k, "mxfp4").block_m == 1
    assert heuristic_config(16, E, H, I, k, "mxfp4").block_m >= MIN_DOT_BLOCK_M
    assert heuristic_config(64, E, H, I, k, "mxfp4").block_m == 16  # 8 rows per expert: 16-row tiles (measured)
    for mode in (None, "fp8_token", "fp8_block"):
        assert heuristic_config(1, E, H, I, k, mode).block_m >= MIN_DOT_BLOCK_M
    small = heuristic_config(1, 4, 64, 96, 2, "mxfp4")  # tiles never wider than the problem, K tiles >= 32
    assert small.gemm1.block_k == 64 and small.gemm2.block_k == 128
