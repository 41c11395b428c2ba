"""fp8 128x128 blocks at K = 7168 on vLLM's block-fp8 test recipe (tests/test_gpu_fp8_recipe.py): how far fusedmoe
and vLLM's own fp8 kernel (run from ``.peers``, see docs/benchmarks.md) each are from that test's reference and from
float64 math, per case. GPU only; run once per accumulation setting to compare them, e.g.
``FUSEDMOE_FP8_BLOCK_ACC=32 python scripts/fp8_recipe_diag.py`` (``fusedmoe.ops.expert_gemm.ENV_FP8_BLOCK_ACC``).

Prints one JSON line per case: relative (Frobenius) errors against float64, the relative distance to the reference,
and how many elements break vLLM's tolerance (atol = rtol = 0.035) for fusedmoe and for vLLM's kernel."""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_gpu_fp8_recipe import CASES, TOLERANCE, _reference, recipe_inputs  # noqa: E402

from fusedmoe import fused_moe  # noqa: E402
from fusedmoe.reference import fused_moe_reference, relative_error  # noqa: E402


def breaks(out: torch.Tensor, ref: torch.Tensor) -> int:
    return int(((out.double() - ref.double()).abs() > TOLERANCE + TOLERANCE * ref.double().abs()).sum())


def main() -> int:
    vllm = None
    try:
        from fusedmoe.tools.bench import peers

        vllm = peers.load_vllm_fused_moe(str(peers.vllm_peer_folder()))
    except Exception as exc:  # no .peers: fusedmoe's figures only
        print(f"vLLM's kernel not run: {type(exc).__name__}: {exc}", flush=True)
    for M, I, E, top_k in CASES:
        x, w1, w2, s1, s2, q, topk_weights, topk_ids = recipe_inputs(M, I, E, top_k)
        ref = _reference(x, w1, w2, s1, s2, topk_weights, topk_ids)
        exact = fused_moe_reference(x, w1, w2, topk_weights, topk_ids, quant=q, w1_scale=s1, w2_scale=s2)
        ours = fused_moe(x, w1, w2, topk_weights, topk_ids, quant=q, w1_scale=s1, w2_scale=s2, backend="triton")
        row = {
            "case": [M, I, E, top_k],
            "block_acc": os.environ.get("FUSEDMOE_FP8_BLOCK_ACC"),
            "ref_vs_f64": relative_error(ref, exact),
            "ours_vs_f64": relative_error(ours, exact),
            "ours_vs_ref": relative_error(ours, ref),
            "ours_breaks": breaks(ours, ref),
        }
        if vllm is not None:
            theirs = peers.vllm_fp8_experts(
                vllm, x, topk_weights, topk_ids, w1, w2, s1, s2, block_shape=list(q.block_shape)
            )
            row.update(
                vllm_vs_f64=relative_error(theirs, exact),
                vllm_vs_ref=relative_error(theirs, ref),
                vllm_breaks=breaks(theirs, ref),
            )
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
