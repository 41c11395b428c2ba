"""GPU probe of the weight-gradient GEMM (dW1 = Σ dhᵀ x per expert): our kernel's operand modes and tiles against
torch._grouped_mm's weight-gradient form and a cuBLAS bmm ceiling. Usage: wgrad_probe.py [name:M ...]."""

import sys

import torch

from fusedmoe.ops.align import moe_align
from fusedmoe.ops.moe_backward import expert_block_ranges, moe_wgrad
from fusedmoe.routing import route
from fusedmoe.tools.bench.floors import _median_ms

SHAPES = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336), "dsv2lite": (64, 6, 2048, 1408)}
TILES = [(128, 256, 8, 3), (128, 256, 8, 4), (256, 128, 8, 3), (256, 128, 8, 4), (128, 128, 8, 4), (128, 128, 4, 3)]


def main():
    for spec in sys.argv[1:] or ["mixtral:4096", "qwen3:16384"]:
        name, M = spec.split(":")
        M = int(M)
        E, k, H, I = SHAPES[name]
        dt = torch.bfloat16
        x = torch.randn(M, H, device="cuda", dtype=dt)
        logits = torch.randn(M, E, device="cuda")
        _, ids = route(logits, k)
        rows = M * k / E
        block_m = 16 if rows <= 16 else 32 if rows <= 64 else 64
        sorted_ids, block_expert, _ = moe_align(ids, E, block_m)
        ranges = expert_block_ranges(block_expert, torch.empty(E, 2, dtype=torch.int32, device="cuda"))
        P = sorted_ids.shape[0]
        valid = sorted_ids < M * k
        tok = torch.where(valid, sorted_ids // k, 0).long()
        dh = torch.randn(P, 2 * I, device="cuda", dtype=dt) * valid[:, None]
        xs = x[tok] * valid[:, None]  # x gathered into the aligned order
        out = torch.empty(E, 2 * I, H, device="cuda", dtype=dt)
        flops = 2 * M * k * 2 * I * H
        print(f"{name} M={M}: dW1 [E={E}, {2 * I}, {H}] over {M * k} rows, block_m {block_m}", flush=True)
        ref = None
        runs = [("token", t, 8) for t in TILES[:1]] + [("sorted", t, g) for t in TILES for g in (1, 8)]
        for mode, (bn, bk, warps, stages), group in runs:
            b = x if mode == "token" else xs

            def run():
                moe_wgrad(
                    dh,
                    b,
                    out,
                    sorted_ids,
                    ranges,
                    n_slots=M * k,
                    top_k=k,
                    block_m=block_m,
                    a_rows="sorted",
                    b_rows=mode,
                    block_n=bn,
                    block_k=bk,
                    group_n=group,
                    num_warps=warps,
                    num_stages=stages,
                )

            label = f"  x by {mode:6s} tile {bn}x{bk} w{warps} s{stages} group {group}"
            try:
                ms = _median_ms(run)
            except Exception as exc:  # out of shared memory etc.
                print(f"{label}: {type(exc).__name__}")
                continue
            if ref is None:
                ref = out.float().clone()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            print(f"{label}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s) err {err:.1e}", flush=True)
        # peers: torch._grouped_mm's weight-gradient form on compact sorted rows, and a bmm with equal counts
        flat = ids.reshape(-1).long()
        order = flat.argsort()
        offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
        dh_c = torch.randn(M * k, 2 * I, device="cuda", dtype=dt)
        x_c = x[order // k]
        ms = _median_ms(lambda: torch._grouped_mm(dh_c.t(), x_c, offs=offs))
        print(f"  torch._grouped_mm (2d x 2d, offs on K): {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)")
        n = M * k // E
        a3 = torch.randn(E, 2 * I, n, device="cuda", dtype=dt)
        b3 = torch.randn(E, n, H, device="cuda", dtype=dt)
        ms = _median_ms(lambda: torch.bmm(a3, b3))
        print(f"  cuBLAS bmm (equal counts): {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
        del x, dh, xs, out, dh_c, x_c, a3, b3
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
