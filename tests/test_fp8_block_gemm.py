"""fp8_block GEMMs: GEMM1 quantizing its own output (``moe_gemm1(out_scale=...)``) and the per-tile weight scale
(``TILE_W_SCALE``), against the separate quantization pass and the float64 reference (CPU interpreter, float32 and
fp8 operands; the CUDA cases run the same checks at the block shape checkpoints ship)."""

import pytest
import torch
from devices import INTERPRETING, TRITON_DEVICES, tolerance
from test_triton_experts import _case, _run

from fusedmoe.experts.triton_experts import TritonExperts
from fusedmoe.ops.align import align_params, local_expert_reference, moe_align
from fusedmoe.ops.configs import GemmConfig, MoEConfig, pinned_config
from fusedmoe.ops.expert_gemm import Numerics
from fusedmoe.ops.grouped_gemm import fp8_output_fits, grid_blocks, moe_gemm1, tile_weight_scale
from fusedmoe.ops.quantize import quantize_activation
from fusedmoe.problem import MoEProblem
from fusedmoe.quant import FP8_DTYPE, QuantConfig, quantize_weights
from fusedmoe.reference import relative_error

#: scale groups small enough for interpreter shapes, or what checkpoints ship (the GPU)
GROUP = {"cpu": 32, "cuda": 128}


def _gemm1_case(device: str, M: int, k: int, E: int, H: int, I: int, g: int, cfg: GemmConfig, seed: int = 0):
    """fp8_block GEMM1 operands (fp8 activations with their group scales), the alignment of random routing over
    E + 2 global experts (ids E and E + 1 not local) and each slot's local expert (-1: none)."""
    gen = torch.Generator().manual_seed(seed)
    q = QuantConfig("fp8_block", block_shape=(g, g))
    w1 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    w1q, _, s1, _ = quantize_weights(w1, torch.randn(E, H, I, generator=gen), q)
    x = torch.randn(M, H, generator=gen)
    ids = torch.stack([torch.randperm(E + 2, generator=gen)[:k] for _ in range(M)]).int()
    x, w1q, s1, ids = (t.to(device) for t in (x, w1q, s1, ids))
    xq, xs = quantize_activation(x, "fp8_block", group_k=g)
    sorted_ids, blocks, _ = moe_align(ids, E, cfg.block_m, global_num_experts=E + 2)
    nb = grid_blocks(M * k, align_params(M * k, E, cfg.block_m).max_blocks)
    experts = local_expert_reference(ids.reshape(-1).cpu(), E, None, E + 2)  # -1: not local
    return xq, w1q, sorted_ids, blocks, nb, experts, Numerics("fp8_block", xs, s1, (g, g))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("I_groups", [(48, 1), (40, 1), (64, 2)])  # I past the last tile, a partial group, 2 groups
def test_gemm1_fp8_output_is_the_separate_pass_on_float32(device, I_groups):
    """GEMM1 with ``out_scale`` writes the bytes and scales the separate quantizer writes from GEMM1's float32
    output, and leaves the rows of non-local slots unwritten."""
    I_mult, groups_per_tile = I_groups
    g = GROUP[device]
    I = I_mult * g // 16
    cfg = GemmConfig(16, g * groups_per_tile, 32 if device == "cpu" else 128)
    M, k, E, H = 9, 2, 4, 2 * g
    xq, w1q, s, b, nb, experts, num = _gemm1_case(device, M, k, E, H, I, g, cfg)
    local = experts >= 0
    act = torch.empty(M * k, I, device=device)
    moe_gemm1(xq, w1q, act, s, b, top_k=k, num_blocks=nb, config=cfg, numerics=num)
    want_q, want_s = quantize_activation(act[local], "fp8_block", group_k=g)

    q = torch.full((M * k, I), float("nan"), device=device).to(FP8_DTYPE)
    scale = torch.full((M * k, -(-I // g)), float("nan"), device=device)
    moe_gemm1(xq, w1q, q, s, b, top_k=k, num_blocks=nb, config=cfg, numerics=num, out_scale=scale)
    assert torch.equal(q[local].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale[local], want_s)
    assert scale[~local].isnan().all() and q[~local].float().isnan().all()  # never written


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_gemm1_fp8_output_rejects_what_it_cannot_do(device):
    g = GROUP[device]
    cfg = GemmConfig(16, g, 32 if device == "cpu" else 128)
    M, k, E, H, I = 3, 1, 2, 2 * g, g
    xq, w1q, s, b, nb, _, num = _gemm1_case(device, M, k, E, H, I, g, cfg)
    q = torch.empty(M * k, I, device=device, dtype=FP8_DTYPE)
    scale = torch.empty(M * k, 1, device=device)
    call = dict(top_k=k, num_blocks=nb, numerics=num)
    with pytest.raises(ValueError, match="BLOCK_N a multiple of"):
        moe_gemm1(xq, w1q, q, s, b, config=GemmConfig(16, g // 2, cfg.block_k), out_scale=scale, **call)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        moe_gemm1(xq, w1q, q.float(), s, b, config=cfg, out_scale=scale, **call)
    with pytest.raises(ValueError, match="out_scale must be"):
        moe_gemm1(xq, w1q, q, s, b, config=cfg, out_scale=scale[:, :0], **call)
    assert not fp8_output_fits(GemmConfig(8, g, 32), g)  # multiply-add tiles: weight-only, nothing to quantize


def test_tile_weight_scale_needs_whole_groups():
    num = Numerics("fp8_block", block_shape=(128, 128))
    assert tile_weight_scale(GemmConfig(16, 64, 128), num, 768)
    assert not tile_weight_scale(GemmConfig(16, 256, 128), num, 768)  # a tile spans two groups
    assert not tile_weight_scale(GemmConfig(16, 64, 128), num, 700)  # up rows start inside a group
    assert not tile_weight_scale(GemmConfig(8, 64, 128), num, 768)  # multiply-add tiles scale per column
    assert not tile_weight_scale(GemmConfig(16, 64, 128), Numerics("fp8_token"), 768)


def _layer_case(device: str, M: int, I: int, g: int, seed: int = 0, ids=None):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    case = list(
        _case(
            M, 2 * g, I, 4, 2, device=device, dtype=dtype, quant=QuantConfig("fp8_block", block_shape=(g, g)), seed=seed
        )
    )
    if ids is not None:
        case[4] = ids.to(device)
    return case


def _launch(case, cfg: MoEConfig):
    x, w1, *_, q, _ = case
    p = MoEProblem(x.shape[0], x.shape[1], w1.shape[1] // 2, w1.shape[0], w1.shape[0], 2, x.dtype, w1.dtype, quant=q)
    with pinned_config(cfg):
        return TritonExperts().launch(p)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("gemm1_n_groups", [0.5, 1])  # GEMM1 tiles half a group wide (tile scale only), or whole
def test_fp8_block_layer_on_the_new_paths(device, interleave, gemm1_n_groups):
    """The layer through the per-tile weight scale (gate and up as two dots or one interleaved dot) and, with
    whole-group GEMM1 tiles, GEMM1 quantizing GEMM2's input: within the quantized tolerance of the float64 reference,
    with poisoned scratch, including an expert without tokens and all tokens on one expert."""
    g = GROUP[device]
    bk = 32 if device == "cpu" else 128
    g1 = GemmConfig(16, int(g * gemm1_n_groups), bk, interleave=interleave)
    cfg = MoEConfig(g1, GemmConfig(16, g // 2, bk))
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    for M, I, ids in ((7, 3 * g, None), (5, 2 * g, torch.tensor([[1, 3]] * 5, dtype=torch.int32))):
        case = _layer_case(device, M, I, g, ids=ids)
        L = _launch(case, cfg)
        assert L.gemm1_quantizes == (gemm1_n_groups == 1)
        num = Numerics("fp8_block", block_shape=(g, g))
        assert tile_weight_scale(cfg.gemm1, num, I) and tile_weight_scale(cfg.gemm2, num, 2 * g)
        with pinned_config(cfg):
            out, ref = _run(*case, poison=True)
        assert torch.isfinite(out).all()
        assert relative_error(out, ref) < tolerance(dtype, quantized=True)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_gemm1_quantizing_plans_no_float_activation(device):
    """When GEMM1 writes GEMM2's fp8 input, the plan holds no float ``act`` buffer and one launch fewer runs."""
    g = GROUP[device]
    bk = 32 if device == "cpu" else 128
    case = _layer_case(device, 3, 2 * g, g)
    fused = _launch(case, MoEConfig(GemmConfig(16, g, bk), GemmConfig(16, g, bk)))
    separate = _launch(case, MoEConfig(GemmConfig(16, g // 2, bk), GemmConfig(16, g, bk)))
    x, w1 = case[0], case[1]
    p = MoEProblem(3, x.shape[1], w1.shape[1] // 2, 4, 4, 2, x.dtype, w1.dtype, quant=case[5])
    ex = TritonExperts()
    names = {b.name for b in ex.buffers(p, fused)}
    assert "act" not in names and {"a2q", "a2_scale"} <= names
    assert "act" in {b.name for b in ex.buffers(p, separate)}
    assert len(ex.steps(p, fused)) == len(ex.steps(p, separate)) - 1


@pytest.mark.skipif(INTERPRETING, reason="the CPU case is test_gemm1_fp8_output_is_the_separate_pass_on_float32")
@pytest.mark.gpu
def test_fp8_block_m1_and_edges_on_gpu():
    """M = 1 with top_k = E, and more tokens than a tile, at the checkpoints' 128 x 128 blocks."""
    cfg = MoEConfig(GemmConfig(16, 128, 128), GemmConfig(16, 128, 128))
    for M, seed in ((1, 1), (300, 2)):
        case = _layer_case("cuda", M, 256, 128, seed=seed)
        with pinned_config(cfg):
            out, ref = _run(*case, poison=True)
        assert relative_error(out, ref) < tolerance(torch.bfloat16, quantized=True)
