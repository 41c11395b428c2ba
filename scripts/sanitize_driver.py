"""Adversarial inputs for the Triton backend on CUDA, meant to run under compute-sanitizer (see scripts/sanitize).

Each scenario calls ``fused_moe`` with value checks off (the default) twice: with a poisoned shared manager, and
with caller workspaces that are exact-size slices of canary-filled buffers. The sanitizer catches any access
outside a CUDA allocation; the driver itself checks that the canaries around the caller workspaces are intact,
that results are finite and match the float64 reference on the tokens whose inputs are finite (out-of-range ids
contribute nothing), and that ``route`` gives in-range ids for NaN/inf logits. Exit status 1 on any finding.

Usage: python scripts/sanitize_driver.py [--quick] [--quant MODES] [--sizes MS] [--block-m N]
"""

from __future__ import annotations

import argparse
import sys
import traceback
import zlib

import torch

from fusedmoe import WorkspaceManager, fused_moe, get_kernel, route
from fusedmoe.checks import check_fused_moe_args
from fusedmoe.mxfp4_layout import from_mma_layout, to_mma_layout
from fusedmoe.ops.configs import MoEConfig, pinned_config
from fusedmoe.quant import QuantConfig, dequantize_weight, quantize_weights
from fusedmoe.reference import fused_moe_reference, relative_error

DEV = torch.device("cuda")
H, I, E, K, GLOBAL_E = 320, 224, 8, 3, 13  # H, I not multiples of the usual tiles: masked edges
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
PAD = 4096
QUANTS = [None, "fp8_tensor", "fp8_tensor_static", "fp8_token", "fp8_block", "mxfp4", "mxfp4_mma"]
#: --block-m: every call's tiles pinned to this many rows (below 16: the multiply-add K loops, fp8 weight-only)
BLOCK_M: list[int | None] = [None]
FAILURES: list[str] = []


def fail(msg: str) -> None:
    print("FAIL:", msg, flush=True)
    FAILURES.append(msg)


def make(M: int, quant: str | None, seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    tw = torch.rand(M, K, generator=g) + 0.1
    kw: dict = {}
    if quant is not None:
        q = QuantConfig.parse(quant)
        w1, w2, s1, s2 = quantize_weights(w1, w2, "mxfp4" if quant == "mxfp4_mma" else q)
        if quant == "mxfp4_mma":  # the layout FusedMoE holds (fusedmoe.mxfp4_layout)
            (w1, s1), (w2, s2) = to_mma_layout(w1, s1, gated=True), to_mma_layout(w2, s2, gated=False)
        kw.update(quant=q, w1_scale=s1.to(DEV), w2_scale=s2.to(DEV))
        if q.static_activation_scale:
            kw.update(a1_scale=torch.tensor([4.0 / 448], device=DEV), a2_scale=torch.tensor([0.5 / 448], device=DEV))
    else:
        w1, w2 = w1.bfloat16(), w2.bfloat16()
    t = {"hidden_states": x.bfloat16(), "w1": w1, "w2": w2, "topk_weights": tw, "topk_ids": ids}
    return {k: v.to(DEV) for k, v in t.items()}, kw


def scenario(name: str, M: int, quant: str | None) -> tuple[dict, dict, bool]:
    """(tensors, options, whether results are checkable row by row)."""
    t, kw = make(M, quant, seed=zlib.crc32(f"{name}/{M}".encode()) % 1000)
    ids, x, tw = t["topk_ids"], t["hidden_states"], t["topk_weights"]
    rows = torch.arange(M, device=DEV)
    if name == "negative_ids":
        ids[rows % 3 == 0, 0] = -1
        ids[rows % 5 == 1, 1] = I32_MIN
        ids[rows % 7 == 2] = -7
    elif name == "too_large_ids":
        ids[rows % 3 == 0, 0] = E
        ids[rows % 5 == 1, 1] = I32_MAX
        ids[rows % 7 == 2] = GLOBAL_E + 100
    elif name == "all_ids_invalid":
        ids.copy_(torch.tensor([-1, E, I32_MAX], device=DEV).repeat(M, 1))
    elif name == "int64_ids":
        t["topk_ids"] = ids = ids.long()
        ids[rows % 4 == 0, 0] = -(2**20)
        ids[rows % 4 == 1, 1] = 2**20
    elif name == "int64_ids_beyond_int32":  # known wrong (cast to int32) but must stay in bounds
        t["topk_ids"] = ids = ids.long()
        ids[rows % 4 == 0, 0] = 2**32 + 1
        ids[rows % 4 == 1, 2] = -(2**40)
        return t, kw, False
    elif name == "garbage_expert_map":
        emap = torch.full((GLOBAL_E,), -1, dtype=torch.int32)
        emap[[0, 2, 3, 5, 7, 8, 10, 12]] = torch.arange(E, dtype=torch.int32)
        emap[1], emap[4], emap[6], emap[9] = E, -5, I32_MAX, I32_MIN
        kw.update(expert_map=emap.to(DEV), global_num_experts=GLOBAL_E)
        g = torch.Generator().manual_seed(M)
        t["topk_ids"] = torch.randint(-4, GLOBAL_E + 4, (M, K), generator=g, dtype=torch.int32).to(DEV)
    elif name == "nan_logits":
        logits = torch.randn(M, E, device=DEV)
        logits[rows % 4 == 0] = float("nan")
        logits[rows % 4 == 1, 2] = float("inf")
        logits[rows % 4 == 2] = -float("inf")
        for scoring in ("softmax", "sigmoid", "softmax_topk"):
            w, i = route(logits.bfloat16(), K, scoring=scoring)
            torch.cuda.synchronize()
            if not bool(((i >= 0) & (i < E)).all()):
                fail(f"route({scoring}) gave out-of-range ids for non-finite logits (M={M})")
        t["topk_weights"], t["topk_ids"] = route(logits, K)
    elif name == "nan_hidden":
        x[rows % 3 == 0] = float("nan")
        x[rows % 5 == 1, 7] = float("inf")
    elif name == "nan_weights":
        tw[rows % 3 == 0, 1] = float("nan")
        tw[rows % 5 == 1, 0] = float("inf")
    else:
        raise AssertionError(name)
    # a NaN activation poisons a dynamic per-tensor scale, hence every row: only memory safety is checked there
    return t, kw, not (name == "nan_hidden" and quant == "fp8_tensor")


def dirty_rows(t: dict) -> torch.Tensor:
    return ~torch.isfinite(t["hidden_states"].float()).all(1) | ~torch.isfinite(t["topk_weights"]).all(1)


def reference(t: dict, kw: dict) -> torch.Tensor:
    """The float64 reference of the call; fp8 weights in decode-sized blocks run weight-only (w8a16), so their
    reference is the float one on the dequantized weights."""
    q = kw.get("quant")
    if q is not None and q.kernel_mode == "mxfp4_mma":  # the same weights in the checkpoint layout
        w1, s1 = from_mma_layout(t["w1"], kw["w1_scale"], H, gated=True)
        w2, s2 = from_mma_layout(t["w2"], kw["w2_scale"], I, gated=False)
        checkpoint = {**kw, "quant": "mxfp4", "w1_scale": s1, "w2_scale": s2}  # (expert_map and the rest as given)
        return fused_moe_reference(t["hidden_states"], w1, w2, t["topk_weights"], t["topk_ids"], **checkpoint)
    if q is None or not q.fp8 or (BLOCK_M[0] or 16) >= 16:
        return fused_moe_reference(*t.values(), **kw)
    w1, w2 = (dequantize_weight(t[w], kw[f"{w}_scale"], q) for w in ("w1", "w2"))
    return fused_moe_reference(t["hidden_states"], w1, w2, t["topk_weights"], t["topk_ids"])


def check(label: str, out: torch.Tensor, t: dict, kw: dict, checkable: bool, quant) -> None:
    if not checkable:
        return
    ref = reference(t, kw)
    clean = ~dirty_rows(t)
    if not bool(torch.isfinite(out[clean].float()).all()):
        fail(f"{label}: NaN/inf in rows whose inputs are finite")
        return
    tol = 6e-2 if quant else 2e-2
    err = relative_error(out[clean], ref[clean])
    if not err < tol:
        fail(f"{label}: relative error {err:.3g} >= {tol}")


def guarded(nbytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    buf = torch.randint(0, 256, (PAD + nbytes + PAD,), dtype=torch.uint8, device=DEV)
    return buf, buf[PAD : PAD + nbytes], buf.clone()


def run(name: str, M: int, quant: str | None, mgr: WorkspaceManager) -> None:
    label = f"{name} M={M} {quant or 'bf16'}"
    t, kw, checkable = scenario(name, M, quant)
    out = fused_moe(**t, **kw, backend="triton", workspace=mgr)
    torch.cuda.synchronize()
    check(label + " [manager]", out, t, kw, checkable, quant)
    opts = dict(
        activation="silu",
        apply_router_weight_on_input=False,
        expert_map=None,
        global_num_experts=None,
        quant=None,
        w1_scale=None,
        w2_scale=None,
        a1_scale=None,
        a2_scale=None,
    )
    opts.update(kw)
    plan = get_kernel("triton").plan(check_fused_moe_args(*t.values(), **opts))
    b13, ws13, ref13 = guarded(plan.region_nbytes["13"])
    b2, ws2, ref2 = guarded(plan.region_nbytes["2"])
    out = fused_moe(**t, **kw, backend="triton", workspace13=ws13, workspace2=ws2)
    torch.cuda.synchronize()
    for buf, ref, n, what in ((b13, ref13, ws13.numel(), "workspace13"), (b2, ref2, ws2.numel(), "workspace2")):
        if not (torch.equal(buf[:PAD], ref[:PAD]) and torch.equal(buf[PAD + n :], ref[PAD + n :])):
            fail(f"{label}: canary bytes around {what} overwritten")
    check(label + " [caller]", out, t, kw, checkable, quant)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="bf16 and fp8_token only, two batch sizes")
    ap.add_argument(
        "--quant", default=None, help="comma-separated subset of: bf16, " + ", ".join(q for q in QUANTS if q)
    )
    ap.add_argument("--sizes", default=None, help="comma-separated batch sizes (default 1,7,300,1500)")
    ap.add_argument("--block-m", type=int, default=None, help="pin every call's tiles to BLOCK_M rows (1-8: FMA loops)")
    opts = ap.parse_args()
    BLOCK_M[0] = opts.block_m
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    names = [
        "negative_ids",
        "too_large_ids",
        "all_ids_invalid",
        "int64_ids",
        "int64_ids_beyond_int32",
        "garbage_expert_map",
        "nan_logits",
        "nan_hidden",
        "nan_weights",
    ]
    sizes = [1, 300] if opts.quick else [1, 7, 300, 1500]  # 1500 x 3 slots: the multi-program alignment
    quants = [None, "fp8_token"] if opts.quick else QUANTS
    if opts.sizes:
        sizes = [int(m) for m in opts.sizes.split(",")]
    if opts.quant:
        quants = [None if q == "bf16" else q for q in opts.quant.split(",")]
        unknown = [q for q in quants if q not in QUANTS]
        if unknown:
            ap.error(f"--quant: unknown modes {unknown}")
    mgr = WorkspaceManager(DEV, poison=True)
    n = 0
    for quant in quants:
        for M in sizes:
            for name in names:
                pin = MoEConfig.simple(opts.block_m, 32, 64) if opts.block_m else None
                try:
                    with pinned_config(pin):
                        run(name, M, quant, mgr)
                except Exception:
                    fail(f"{name} M={M} {quant}: exception\n{traceback.format_exc()}")
                n += 1
    print(f"{n} scenarios, {len(FAILURES)} failures", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
