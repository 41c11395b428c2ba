"""scripts/sass_stats.py: GEMM1 compiled for sm90 on a CPU-only machine (the ptxas and cuobjdump of Triton's wheel),
as the H200 runs it: software-pipelined (asynchronous global-to-shared copies) with wgmma tensor-core ops, and the
MXFP4 kernel through Triton's e2m1 upcast."""

import json
import os
import subprocess
import sys

import pytest
from script_module import load_script

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "sass_stats.py")


#: fp8 GEMM1 tiles: 16 token rows (weights first), 64 rows (tokens first), 64 rows quantizing the output
FP8_VARIANTS = ["fp8-block:16,64,128,4,4", "fp8-token:16,64,128,4,4", "fp8-block:64,128,128,8,3",
                "fp8-block-quantized:64,128,128,8,3"]  # fmt: skip


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton has no cuobjdump")
    out = tmp_path_factory.mktemp("sass") / "counts.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, not interpreted
    variants = ["bf16:64,64,128,4,3", "mxfp4:64,64,128,4,3", "mxfp4-mma:16,64,128,4,4", *FP8_VARIANTS]
    subprocess.run([sys.executable, SCRIPT, "--variants", *variants, "--json", str(out)], env=env, check=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("quant", ["bf16", "mxfp4"])
def test_gemm1_for_sm90_is_pipelined_on_wgmma(counts, quant):
    c = counts[f"{quant}:64,64,128,4,3"]
    ttgir, sass = c["ttgir"], c["sass"]
    assert ttgir["async_copy_global_to_local"] > 0 and sass["LDGSTS"] > 0  # weights and activations prefetched
    assert sass["HGMMA"] > 0 and sass.get("HMMA", 0) == 0
    assert (ttgir["fp4_to_fp"] > 0) == (quant == "mxfp4")
    assert (sass.get("PRMT", 0) > 0) == (quant == "mxfp4")  # byte shuffles of the e2m1 upcast; none in bf16


def test_mma_layout_k_loop_decodes_into_the_operand_registers(counts):
    """The mma-layout MXFP4 K loop (fusedmoe.mxfp4_layout) on wgmma: the weights' bytes arrive by 16-byte
    asynchronous copies and reach the tensor cores' register operand by shifts and masks, without shared-memory
    stores, warp shuffles or Triton's e2m1 upcast, in under 4 instructions per weight (the tl.dot_scaled loop takes
    about 7: no longer issue-bound below the H200's read rate, ~3.5 per weight)."""
    c = counts["mxfp4-mma:16,64,128,4,4"]
    loop = c["loop"]
    assert c["ttgir"]["fp4_to_fp"] == 0 and c["ttgir"]["async_copy_global_to_local"] > 0
    assert loop.get("HGMMA", 0) > 0 and loop.get("LDGSTS", 0) > 0
    assert loop.get("STS", 0) == 0 and loop.get("SHFL", 0) == 0
    assert c["loop_per_weight"] < 4.0 < counts["mxfp4:64,64,128,4,3"]["loop_per_weight"]


def test_opcode_counts_read_predicated_instructions():
    sass = "        /*0040*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;\n"
    sass += "        /*0050*/              @!P0 LDGSTS.E.BYPASS.128 [R3], desc[UR6][R4.64] ;\n"
    sass += "        /*0060*/              @P1 BRA 0x80 ;\n"
    sass += "        /*0070*/                   @UP0 EXIT ;\n"
    assert load_script("sass_stats.py").opcode_counts(sass) == {"HGMMA": 1, "LDGSTS": 1, "BRA": 1, "EXIT": 1}


@pytest.mark.parametrize("variant", FP8_VARIANTS)
def test_fp8_k_loop_runs_fp8_wgmma(counts, variant):
    """Every fp8 tensor-core tile multiplies on the fp8 wgmma (QGMMA), also at 16 token rows, where tokens first
    would take Triton's fallback that widens each operand pair to fp16 (F2FP) for mma.sync (HMMA); fp8_block adds
    one multiply-add per accumulator element per K tile (the scales combined first: with tokens first the weight
    scale is one per tile, weights first one per row), not a product and a sum."""
    c = counts[variant]
    loop = c["loop"]
    assert loop.get("QGMMA", 0) > 0 and loop.get("HMMA", 0) == 0 and loop.get("F2FP", 0) == 0
    bm, bn, bk, warps = (int(t) for t in variant.split(":")[1].split(",")[:4])
    accumulators_per_thread = bm * 2 * bn // (32 * warps)
    scale_ops = loop.get("FFMA", 0) + loop.get("FMUL", 0)
    if variant.startswith("fp8-token"):
        assert scale_ops == 0  # per-token scales apply once, after the loop
    elif bm >= 64:
        assert loop.get("FFMA", 0) == accumulators_per_thread and loop.get("FMUL", 0) < accumulators_per_thread
    else:
        assert scale_ops <= 2 * accumulators_per_thread
