"""Time our MXFP4 layer (routing + both GEMMs) under tile candidates for one K-loop path, on the GPU (#18).

The path is the process's ``FUSEDMOE_MXFP4_DOT`` (unset or ``scaled``: ``tl.dot_scaled``; ``decode``: the register
decode and dots; see ``ops.expert_gemm.mxfp4_quant_code``), so run one process per path. For each preset and M: the
shipped choice (``get_config``) and each candidate pinned for both GEMMs, timed over a CUDA graph of 10 calls (as the
bench), with the largest relative difference of its output from the shipped choice's. Candidates that fail to
compile print their error. (At 726cc6e it also timed two weights-first K loops, ``acc^T = W @ A^T``, removed after
it: BENCHMARKS.md, tenth session.)
Usage: FUSEDMOE_MXFP4_DOT=decode python scripts/mxfp4_probe.py [--presets gpt-oss-20b,gpt-oss-120b]
       [--tokens 1,8,64,512,4096] [--json OUT.json]"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402

from fusedmoe.ops.configs import GemmConfig, MoEConfig, pinned_config  # noqa: E402
from fusedmoe.tools.bench import kernel, peers, timing  # noqa: E402
from fusedmoe.workspace import WorkspaceManager  # noqa: E402

#: (block_m, block_n, block_k, num_warps, num_stages) by average rows per expert: up to 8, up to 64, more.
CANDIDATES = {
    8: [
        (16, 64, 128, 4, 3),
        (16, 64, 256, 4, 3),
        (16, 128, 128, 4, 3),
        (16, 128, 256, 4, 4),
        (16, 128, 128, 8, 3),
        (16, 64, 128, 4, 5),
        (32, 128, 128, 4, 3),
    ],
    64: [
        (32, 128, 128, 4, 3),
        (64, 128, 128, 4, 3),
        (64, 128, 128, 8, 3),
        (64, 64, 128, 4, 4),
        (32, 64, 256, 4, 3),
        (64, 128, 256, 8, 3),
        (16, 128, 128, 4, 3),
    ],
    10**9: [
        (64, 128, 128, 8, 3),
        (128, 128, 128, 8, 3),
        (128, 128, 64, 8, 4),
        (64, 128, 128, 4, 4),
        (128, 64, 128, 4, 3),
        (128, 128, 128, 8, 4),
        (128, 256, 64, 8, 3),
    ],
}


def candidates(rows: float) -> list[MoEConfig]:
    """The candidates of the first class of :data:`CANDIDATES` that holds ``rows`` per expert, both GEMMs alike."""
    tiles = next(tiles for bound, tiles in CANDIDATES.items() if rows <= bound)
    return [MoEConfig(g, g) for g in (GemmConfig(bm, bn, bk, 8, w, s) for bm, bn, bk, w, s in tiles)]


def label(cfg: MoEConfig | None) -> str:
    if cfg is None:
        return "shipped"
    g = cfg.gemm1
    return f"bm{g.block_m} bn{g.block_n} bk{g.block_k} w{g.num_warps} s{g.num_stages}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="gpt-oss-20b,gpt-oss-120b")
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--json")
    opts = ap.parse_args()
    path = os.environ.get("FUSEDMOE_MXFP4_DOT", "scaled")
    device = torch.device("cuda")
    results = []
    for preset in opts.presets.split(","):
        shape = kernel.shape_from_args(argparse.Namespace(preset=preset))
        w1, w2, quantized = kernel._weights(shape, "mxfp4", device)
        manager = WorkspaceManager(device, strategy="shared")
        for M in [int(t) for t in opts.tokens.split(",")]:
            manager.release()
            gen = torch.Generator(device=device).manual_seed(M)
            x = torch.randn(M, shape.hidden, device=device, dtype=torch.bfloat16, generator=gen)
            logits = [torch.randn(M, shape.num_experts, device=device, generator=gen) for _ in range(10)]
            fn = kernel._make_call("triton", shape, x, w1, w2, quantized, None, manager)
            ref = fn(logits[0]).float()
            rows = M * shape.top_k / shape.local_experts
            for cfg in [None, *candidates(rows)]:
                name = label(cfg)
                row = {"preset": preset, "M": M, "path": path, "config": name}
                try:
                    with pinned_config(cfg):
                        us = timing.graph_time_us([lambda lg=lg, fn=fn: fn(lg) for lg in logits])
                        err = peers.check_close(fn(logits[0]), ref)
                    row.update(us=us, rel_err=err)
                    print(f"{preset} M={M} {path} {name}: {us:.1f} us (rel diff {err:.1e})", flush=True)
                except Exception as exc:  # a candidate this path cannot compile is a result too
                    torch.cuda.synchronize()
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    print(f"{preset} M={M} {path} {name}: {row['error']}", flush=True)
                results.append(row)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
