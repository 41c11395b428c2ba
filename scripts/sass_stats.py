"""Compile one ``_moe_gemm`` variant for sm90 on this machine (no GPU needed) and count what its code does.

Triton compiles for a target it is told (``GPUTarget("cuda", 90, 32)``) with the ptxas and cuobjdump its wheel
ships, so the TTGIR and SASS of a Hopper kernel can be read on a CPU-only machine. The arguments are specialized as
a launch on the H200 would specialize them for GEMM1 of gpt-oss-20b (strides of 1 as constants, 16-divisible
pointers and integers, 0 included, marked so): without those marks Triton cannot use asynchronous copies and the code read would
not be the code that runs. Prints, per variant, the shared memory, the counts of chosen TTGIR operations (software
pipelining, layout conversions, tensor-core ops) and of SASS opcodes (per kernel, the loop's code appearing once per
pipeline stage it is unrolled into).
Run it without ``TRITON_INTERPRET`` (the interpreter's kernels cannot be compiled).
Usage: python scripts/sass_stats.py [--variants mxfp4:64,64,128,4,3 bf16:64,64,64,4,3 ...] [--dump DIR] [--json F]
  quant:block_m,block_n,block_k,num_warps,num_stages; quant one of bf16, mxfp4 (tl.dot_scaled), mxfp4-decode,
  mxfp4-mma (the mma layout, fusedmoe.mxfp4_layout), fp8-block (128x128 block scales; fp8-block-interleave: gate
  and up as one dot), fp8-token (per-token x per-channel scales); the fp8 variants compile GEMM1 of qwen3-30b-a3b
  (H 2048, I 768). Also prints the K loop's own instructions (the code inside the kernel's largest backward branch)
  and what they cost per weight element of a K tile."""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fusedmoe.mxfp4_layout import padded_k  # noqa: E402
from fusedmoe.ops.configs import GemmConfig  # noqa: E402
from fusedmoe.ops.expert_gemm import MXFP4_SCALED_DOT, QUANT_CODES, weights_first_fp8  # noqa: E402
from fusedmoe.ops.grouped_gemm import _moe_gemm  # noqa: E402

H = I = 2880  # gpt-oss-20b
E = 32
FP8_H, FP8_I = 2048, 768  # qwen3-30b-a3b
TTGIR_OPS = ("async_copy_global_to_local", "convert_layout", "local_load", "warp_group_dot ", "tt.dot ", "fp4_to_fp")
SASS_OPS = (
    "HGMMA",
    "QGMMA",
    "HMMA",
    "LDGSTS",
    "LDS",
    "LDSM",
    "STS",
    "PRMT",
    "LOP3",
    "SHF",
    "SEL",
    "HMUL2",
    "FMUL",
    "FFMA",
    "FADD",
    "F2FP",
    "WARPGROUP",
    "WARPSYNC",
    "BAR",
)
QUANTS = {
    "bf16": 0,
    "mxfp4": MXFP4_SCALED_DOT,
    "mxfp4-decode": QUANT_CODES["mxfp4"],
    "mxfp4-mma": QUANT_CODES["mxfp4_mma"],
    "fp8-block": QUANT_CODES["fp8_block"],
    "fp8-token": QUANT_CODES["fp8_token"],
    "fp8-block-interleave": QUANT_CODES["fp8_block"],
    "fp8-block-quantized": QUANT_CODES["fp8_block"],
}


#: the kernels' mode of each fp8 variant
QUANT_MODES = {q: "fp8_token" if q == "fp8-token" else "fp8_block" for q in QUANTS if q.startswith("fp8")}


def gemm1_arguments(quant: str) -> dict[str, int]:
    """The integer arguments of GEMM1 (gated, [E, 2I, H] weights: bf16, MXFP4 bytes two per element, or the mma
    layout's row blocks of 16 rows, 8 bytes per element of K padded to 64)."""
    if quant == "mxfp4-mma":
        row, rows = 8 * padded_k(H), 2 * I // 16
        return dict(
            N=I, K=H, top_k=4, stride_am=H, stride_ak=1, stride_we=rows * row, stride_wn=row, stride_wk=1,
            stride_om=I, stride_on=1, stride_asm=0, stride_ask=0, stride_wse=rows * row // 16, stride_wsn=row // 16,
            stride_wsk=1, stride_be=0, stride_bn=0,
        )  # fmt: skip
    if quant.startswith("fp8"):
        block = quant.startswith("fp8-block")
        kg = FP8_H // 128
        return dict(
            N=FP8_I, K=FP8_H, top_k=8, stride_am=FP8_H, stride_ak=1, stride_we=2 * FP8_I * FP8_H, stride_wn=FP8_H,
            stride_wk=1, stride_om=FP8_I, stride_on=1, stride_asm=kg if block else 1, stride_ask=1 if block else 0,
            stride_wse=(2 * FP8_I // 128) * kg if block else 2 * FP8_I, stride_wsn=kg if block else 1,
            stride_wsk=1 if block else 0, stride_be=0, stride_bn=0, stride_osm=FP8_I // 128, stride_osk=1,
        )  # fmt: skip
    packed = quant != "bf16"
    row = H // 2 if packed else H
    return dict(
        N=I, K=H, top_k=4, stride_am=H, stride_ak=1, stride_we=2 * I * row, stride_wn=row, stride_wk=1,
        stride_om=I, stride_on=1, stride_asm=0, stride_ask=0, stride_wse=2 * I * (H // 32) if packed else 0,
        stride_wsn=H // 32 if packed else 0, stride_wsk=1 if packed else 0, stride_be=0, stride_bn=0,
    )  # fmt: skip


def compile_variant(quant: str, bm: int, bn: int, bk: int, warps: int, stages: int, extra: dict | None = None):
    code = QUANTS[quant]
    fp8 = quant.startswith("fp8")
    if quant == "fp8-block-interleave":  # gate and up as one dot (GemmConfig.interleave)
        extra = {"INTERLEAVE": True, **(extra or {})}
    quantized = quant == "fp8-block-quantized"  # the output quantized to fp8 in the epilogue (scales beside it)
    packed = code != 0 and not fp8
    ints = gemm1_arguments(quant)
    operand = "*fp8e4nv" if fp8 else "*bf16"
    pointers = {"a_ptr": operand, "w_ptr": "*u8" if packed else operand, "out_ptr": "*fp8e4nv" if quantized else "*bf16",
                "out_scale_ptr": "*fp32", "sorted_ptr": "*i32",
                "block_expert_ptr": "*i32", "topk_w_ptr": "*fp32", "a_scale_ptr": "*fp32" if fp8 else "*bf16",
                "w_scale_ptr": "*u8" if packed else ("*fp32" if fp8 else "*bf16"), "bias_ptr": "*bf16"}  # fmt: skip
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, QUANT=code, GROUP_N=128, GROUP_K=128, GATED=True,
                  ACTIVATION=0, WEIGHT_ON_INPUT=False, MUL_WEIGHT=False, IEEE=False, EVEN_K=ints["K"] % bk == 0,
                  HAS_BIAS=False, A_SORTED=False, STORE_PREACT=False, NUM_SMS=0, PERSISTENT=0, INTERLEAVE=False,
                  preact_ptr=None, stride_pm=0, w_desc=None, **({} if quantized else dict(out_scale_ptr=None, stride_osm=0, stride_osk=0)), OUT_FP8=int(quantized),
                  TILE_W_SCALE=quant.startswith("fp8-block") and 128 % bn == 0)  # fmt: skip
    consts["WEIGHTS_FIRST"] = fp8 and weights_first_fp8(QUANT_MODES[quant], GemmConfig(bm, bn, bk), gated=True)
    consts.update(extra or {})
    signature, attrs = {}, {}
    for p in _moe_gemm.params:
        name = p.name
        if name in consts or ints.get(name) == 1:  # constexprs, and the ints Triton specializes to the constant 1
            consts.setdefault(name, ints.get(name))
            signature[name] = "constexpr"
            continue
        signature[name] = pointers.get(name, "i32")
        if name in pointers or ints.get(name, 1) % 16 == 0:  # 16-divisible pointers and ints (0 included)
            attrs[(_moe_gemm.arg_names.index(name),)] = [["tt.divisibility", 16]]
    src = ASTSource(
        fn=_moe_gemm,
        signature=signature,
        constexprs={(_moe_gemm.arg_names.index(k),): v for k, v in consts.items()},
        attrs=attrs,
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def sass_of(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def opcode_counts(sass: str) -> collections.Counter:
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def loop_counts(sass: str) -> collections.Counter:
    """Opcode counts of the instructions inside the kernel's largest backward branch: its main K loop."""
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)(.*)", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(2), m.group(3)))
    spans = [(int(t.group(1), 16), addr) for addr, op, rest in lines
             if op == "BRA" and (t := re.search(r"0x([0-9a-f]+)", rest)) and int(t.group(1), 16) < addr]  # fmt: skip
    if not spans:
        return collections.Counter()
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    return collections.Counter(op for addr, op, _ in lines if lo <= addr <= hi)


def weights_per_tile(quant: str, bn: int, bk: int) -> int:
    """Weight elements a GEMM1 K tile reads: gate and up rows of BLOCK_N columns, BLOCK_K deep."""
    return 2 * bn * bk


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=["bf16:64,64,64,4,3", "mxfp4:64,64,128,4,3",
                    "mxfp4:16,64,256,4,3", "mxfp4-decode:16,64,256,4,3"])  # fmt: skip
    ap.add_argument("--dump", help="write each variant's TTGIR and SASS here")
    ap.add_argument("--json", help="write the counts here: {variant: {shared, ttgir: {op: n}, sass: {opcode: n}}}")
    opts = ap.parse_args()
    counts = {}
    for variant in opts.variants:
        quant, tiles = variant.split(":")
        kernel = compile_variant(quant, *(int(t) for t in tiles.split(",")))
        ttgir, sass = kernel.asm["ttgir"], sass_of(kernel.asm["cubin"])
        ops = opcode_counts(sass)
        loop = loop_counts(sass)
        bm, bn, bk, warps = (int(t) for t in tiles.split(",")[:4])
        per_weight = sum(loop.values()) * 32 * warps / weights_per_tile(quant, bn, bk)
        if opts.dump:
            os.makedirs(opts.dump, exist_ok=True)
            base = os.path.join(opts.dump, variant.replace(":", "-").replace(",", "x"))
            open(base + ".ttgir", "w").write(ttgir)
            open(base + ".sass", "w").write(sass)
        print(f"{variant}: shared memory {kernel.metadata.shared} B, {sum(ops.values())} SASS instructions")
        print("  TTGIR " + ", ".join(f"{o.strip()} {ttgir.count(o)}" for o in TTGIR_OPS))
        print("  SASS  " + ", ".join(f"{o} {ops[o]}" for o in SASS_OPS))
        print(f"  loop  {sum(loop.values())} instructions per thread ({per_weight:.2f} per weight element): "
              + ", ".join(f"{o} {loop[o]}" for o in SASS_OPS if loop[o]))  # fmt: skip
        ttgir_ops = {o.strip(): ttgir.count(o) for o in TTGIR_OPS}
        counts[variant] = {"shared": kernel.metadata.shared, "ttgir": ttgir_ops, "sass": dict(ops), "loop": dict(loop),
                           "loop_per_weight": per_weight}  # fmt: skip
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(counts, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
