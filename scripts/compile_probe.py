"""Compile the expert GEMM (``_moe_gemm``) for Hopper (sm_90) on this machine, no GPU needed, and print what the
compiler made of it: the dot instruction (wgmma or mma.sync), asynchronous copies (pipelined loads), layout
conversions, shared memory and registers/spills (from the ptxas Triton ships). For comparing K-loop variants
before running them on a GPU. Usage: python scripts/compile_probe.py [--quant 0,4,5] [--tiles 16,64,256:128,128,128]
[--warps 4] [--stages 3] [--gated 1] [--dump DIR] [--weight-only] [--tma] [--interleave] [--persistent 1]"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fusedmoe.ops.grouped_gemm import _moe_gemm  # noqa: E402

UNIT_STRIDES = ("stride_ak", "stride_wk", "stride_on", "stride_wsk", "stride_bn")


def _aligned(name: str, kind: str) -> bool:
    """Pointers, and ints a launch at the model shapes finds divisible by 16 (N, K and strides; not the
    unspecialized n_slots, num_pid_m, nor top_k)."""
    return kind.startswith("*") or (kind == "i32" and name not in ("n_slots", "num_pid_m", "top_k"))


def signature(quant: int, weight_only: bool = False) -> dict[str, str]:
    fp8 = 1 <= quant <= 3 and not weight_only  # fp8 activations (weight-only fp8: bf16 ones)
    w_type = "*u8" if quant >= 4 else ("*fp8e4nv" if 1 <= quant <= 3 else "*bf16")
    types = {"a_ptr": "*fp8e4nv" if fp8 else "*bf16", "w_ptr": w_type, "out_ptr": "*bf16"}
    types |= {"sorted_ptr": "*i32", "block_expert_ptr": "*i32", "topk_w_ptr": "*fp32", "a_scale_ptr": "*fp32"}
    types |= {"w_scale_ptr": "*u8" if quant >= 4 else "*fp32", "bias_ptr": "*bf16", "preact_ptr": "*bf16"}
    sig = {}
    for param in _moe_gemm.params:
        sig[param.name] = "constexpr" if param.is_constexpr else types.get(param.name, "i32")
    return sig


def compile_one(
    quant: int,
    bm: int,
    bn: int,
    bk: int,
    warps: int,
    stages: int,
    gated: bool,
    weight_only=False,
    tma=False,
    interleave=False,
    persistent=0,
):
    """``tma``: weights through a TMA descriptor (the interleaved 4-D one with ``interleave``); ``persistent``:
    ``GemmConfig.persistent`` on 132 SMs."""
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, QUANT=quant, GROUP_N=128, GROUP_K=128)
    consts |= dict(GATED=gated, ACTIVATION=0, WEIGHT_ON_INPUT=False, MUL_WEIGHT=not gated, IEEE=False)
    consts |= dict(EVEN_K=False, HAS_BIAS=False, A_SORTED=False, STORE_PREACT=False, INTERLEAVE=interleave)
    if persistent:
        consts |= dict(NUM_SMS=132, PERSISTENT=persistent)
    # as a launch specializes them: unit strides are constants, pointers, N, K and strides multiples of 16
    consts |= {name: 1 for name in UNIT_STRIDES}
    # constexprs left out take their defaults (NUM_SMS, PERSISTENT, K_PAIRS, ...), as a launch would
    # and optional arguments left out are None (w_desc: pointer loads of the weights)
    defaults = [p for p in _moe_gemm.params if p.has_default and p.name not in consts]
    consts |= {p.name: p.default for p in defaults if p.is_constexpr or p.default is None}
    sig = signature(quant, weight_only)
    if tma:
        w_type = sig["w_ptr"].lstrip("*")
        consts.pop("w_desc", None)
        block = f"1,{bn},2,{bk}" if interleave else f"{bn},{bk}"
        sig["w_desc"] = f"tensordesc<{w_type}[{block}]>"
    for name in consts:
        sig[name] = "constexpr"
    names = [p.name for p in _moe_gemm.params]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in sig and _aligned(n, sig[n])}
    src = ASTSource(_moe_gemm, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def ptxas_usage(ptx: str) -> dict[str, object]:
    """Registers per thread and spill bytes of ``ptx`` as the ptxas shipped with Triton reports them (sm_90a)."""
    import subprocess
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return {"regs": None, "spill_bytes": None}
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-v", "-arch=sm_90a", src, "-o", os.path.join(d, "k.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "regs": int(regs.group(1)) if regs else None,
        "spill_bytes": sum(map(int, spill.groups())) if spill else None,
    }


def stats(c) -> dict[str, object]:
    ttgir, ptx = c.asm["ttgir"], c.asm["ptx"]
    return {
        "dot": "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "fma"),
        "async_copies": ttgir.count("async_copy_global_to_local"),
        "convert_layout": ttgir.count("ttg.convert_layout"),
        "local_alloc": ttgir.count("ttg.local_alloc"),
        "fp4_to_fp": ttgir.count("fp4_to_fp"),
        # 0 right after each dot: the loop waits for every wgmma (no overlap of a dot with the next loads)
        "wgmma_wait_pendings": sorted({int(v) for v in re.findall(r"pendings = (\d+)", ttgir)}),
        "shared_bytes": c.metadata.shared,
        **ptxas_usage(ptx),
        "ptx_lines": len(ptx.splitlines()),
        "ptx_prmt": len(re.findall(r"\bprmt", ptx)),
        # shared-memory round trips (layout conversions, cross-warp reductions): in a K loop, each is a stall
        "bar_sync": len(re.findall(r"\bbar\.sync", ptx)),
        "shared_ld_st": len(re.findall(r"\b(?:ld|st)\.shared", ptx)),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quant", default="0,4,5", help="QUANT codes: 0 bf16, 1-3 fp8 tensor/token/block, 4-5 MXFP4")
    ap.add_argument("--tiles", default="16,64,256:64,128,128:128,128,128")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--gated", type=int, default=1)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--weight-only", action="store_true", help="fp8 codes with bf16 activations (BLOCK_M < 16)")
    ap.add_argument("--tma", action="store_true", help="weights through a TMA descriptor")
    ap.add_argument("--interleave", action="store_true", help="GemmConfig.interleave (gated: one gate-up dot)")
    ap.add_argument("--persistent", type=int, default=0, help="GemmConfig.persistent mode")
    args = ap.parse_args()
    for tile in args.tiles.split(":"):
        bm, bn, bk = (int(v) for v in tile.split(","))
        for q in (int(v) for v in args.quant.split(",")):
            c = compile_one(
                q,
                bm,
                bn,
                bk,
                args.warps,
                args.stages,
                bool(args.gated),
                args.weight_only,
                args.tma,
                args.interleave,
                args.persistent,
            )
            print(f"QUANT={q} tile {bm}x{bn}x{bk} warps {args.warps} stages {args.stages}: {stats(c)}")
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                for kind in ("ttgir", "ptx"):
                    with open(os.path.join(args.dump, f"q{q}_{bm}x{bn}x{bk}.{kind}"), "w") as f:
                        f.write(c.asm[kind])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
