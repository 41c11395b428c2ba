"""Where do fp8 128x128-block errors at K = 7168 come from: our kernel, or the comparison's rounding?

On vLLM's block-fp8 MoE test grid (bf16 inputs / 10, softmax top-k routing without renormalization), with either
of vLLM's two weight recipes (``--weights randn``: bf16 randn / 15 quantized per 128x128 block, as its current test
helper does; ``uniform``: e4m3 values over the whole range with random 1e-2 block scales, its older test), four
results are compared:

- ``ours``: fusedmoe's Triton fp8_block path;
- ``vref``: a reference with vLLM's rounding points (fp32 block GEMMs whose outputs are rounded to bf16, the
  SiLU-and-mul in bf16 ops, per-token-group fp8 quantization, bf16 weighted products summed in bf16);
- ``f64``: fusedmoe.reference in float64 on the same fp8 weights and activation quantization rule (GEMM1's
  activation quantized from its float64 value);
- ``k64``: float64 with the kernel's rounding points (the activation rounded to bf16 before it is quantized):
  what ``ours`` would be with exact GEMM arithmetic, so ``ours`` vs ``k64`` isolates the kernel's own error.

For each case it prints relative Frobenius errors against ``f64``, how many elements break vLLM's tolerance
(atol = rtol = 0.035, 0.039 from M = 8192) for each pair, and percentiles of the error in units of that
tolerance. JSON to ``--json``. GPU only.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fusedmoe import fused_moe
from fusedmoe.quant import FP8_DTYPE, QuantConfig, quantize_weights
from fusedmoe.reference import fused_moe_reference

FP8_MAX = 448.0


def group_quant(x: torch.Tensor, group: int = 128):
    """Per-token, per-128-column fp8 quantization (amax / 448 scales), as vLLM's native reference does it."""
    M, K = x.shape
    g = x.float().view(M, K // group, group)
    s = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    q = (g / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(M, K), s.squeeze(-1)


def block_matmul(aq, a_s, w, w_s, out_dtype, block=128):
    """A [M, K] fp8 with [M, K/128] scales times W [N, K] fp8 with [N/128, K/128] scales, fp32 math."""
    a = aq.float() * a_s.repeat_interleave(block, dim=1)
    ws = w_s.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)[: w.shape[0], : w.shape[1]]
    return (a @ (w.float() * ws).T).to(out_dtype)


def vref(x, w1, w2, s1, s2, tw, ids):
    """vLLM's rounding points (see module docstring)."""
    M, k = ids.shape
    a = x.repeat_interleave(k, dim=0)
    aq, a_s = group_quant(a)
    out = torch.zeros(M * k, w2.shape[1], dtype=x.dtype, device=x.device)
    flat = ids.reshape(-1)
    for e in range(w1.shape[0]):
        m = flat == e
        if m.any():
            h = block_matmul(aq[m], a_s[m], w1[e], s1[e], x.dtype)
            I = h.shape[1] // 2
            act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
            q2, s2a = group_quant(act)
            out[m] = block_matmul(q2, s2a, w2[e], s2[e], x.dtype)
    return (out.view(M, k, -1) * tw.view(M, k, 1).to(x.dtype)).sum(dim=1)


def case(M, N, K, E, k, weights: str, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(M, K, device="cuda", generator=g) / 10).to(torch.bfloat16)
    if weights == "randn":
        w1 = (torch.randn(E, 2 * N, K, device="cuda", generator=g) / 15).to(torch.bfloat16)
        w2 = (torch.randn(E, K, N, device="cuda", generator=g) / 15).to(torch.bfloat16)
        w1, w2, s1, s2 = quantize_weights(w1, w2, QuantConfig("fp8_block"))
    else:
        w1 = ((torch.rand(E, 2 * N, K, device="cuda", generator=g) - 0.5) * 2 * FP8_MAX).to(FP8_DTYPE)
        w2 = ((torch.rand(E, K, N, device="cuda", generator=g) - 0.5) * 2 * FP8_MAX).to(FP8_DTYPE)
        s1 = torch.rand(E, -(-2 * N // 128), -(-K // 128), device="cuda", generator=g) * 1e-2
        s2 = torch.rand(E, -(-K // 128), -(-N // 128), device="cuda", generator=g) * 1e-2
    score = torch.randn(M, E, device="cuda", generator=g).to(torch.bfloat16)
    tw, ids = torch.topk(torch.softmax(score.float(), dim=-1), k)
    return x, w1, w2, s1, s2, tw, ids.to(torch.int32)


def k64(x, w1, w2, s1, s2, tw, ids, q):
    """float64 math with the kernel's rounding points (see module docstring)."""
    from fusedmoe.quant import dequantize_weight, fake_quantize_activation
    from fusedmoe.reference import activation_reference

    xq = fake_quantize_activation(x.double(), q).double()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    for e in range(w1.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel():
            h = activation_reference(xq[tok] @ dequantize_weight(w1[e : e + 1], s1[e : e + 1], q)[0].double().T, "silu")
            h = fake_quantize_activation(h.to(x.dtype).double(), q).double()
            y = h @ dequantize_weight(w2[e : e + 1], s2[e : e + 1], q)[0].double().T
            out.index_add_(0, tok, y * tw[tok, slot, None].double())
    return out


def breaks(a, b, tol):
    """Elements where |a - b| > tol + tol * |b|, and the error in units of that bound."""
    units = (a.double() - b.double()).abs() / (tol + tol * b.double().abs())
    return int((units > 1).sum()), units


def rel(t: torch.Tensor, ref: torch.Tensor) -> float:
    return ((t.double() - ref).norm() / ref.norm()).item()


def pct(units: torch.Tensor) -> list[float]:
    """50th, 99th, 99.99th percentile and max (over at most ~4M sampled elements)."""
    u = units.flatten()[:: max(1, units.numel() // 4_000_000)].float()
    return [round(float(v), 4) for v in torch.quantile(u, torch.tensor([0.5, 0.99, 0.9999, 1.0], device=u.device))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="8192x4608x7168x16x6,8192x1024x7168x8x2,83x4608x7168x8x2")
    ap.add_argument("--weights", default="randn,uniform", help="vLLM's weight recipes to run: randn, uniform")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    q = QuantConfig("fp8_block")
    rows = []
    for weights, spec in ((w, s) for w in args.weights.split(",") for s in args.cases.split(",")):
        M, N, K, E, k = map(int, spec.split("x"))
        t0 = time.time()
        x, w1, w2, s1, s2, tw, ids = case(M, N, K, E, k, weights)
        ours = fused_moe(x, w1, w2, tw, ids, quant=q, w1_scale=s1, w2_scale=s2, backend="triton")
        ref_v = vref(x, w1, w2, s1, s2, tw, ids)
        f64 = fused_moe_reference(x, w1, w2, tw, ids, quant=q, w1_scale=s1, w2_scale=s2)
        ref_k = k64(x, w1, w2, s1, s2, tw, ids, q)
        tol = 0.039 if M >= 8192 else 0.035
        n_ov, _ = breaks(ours, ref_v, tol)
        n_of, u_of = breaks(ours, f64, tol)
        n_vf, u_vf = breaks(ref_v, f64, tol)
        n_ok, u_ok = breaks(ours, ref_k, tol)
        row = dict(
            weights=weights,
            M=M,
            N=N,
            K=K,
            E=E,
            topk=k,
            tol=tol,
            elements=ours.numel(),
            rel_err_ours=rel(ours, f64),
            rel_err_vref=rel(ref_v, f64),
            rel_err_k64=rel(ref_k, f64),
            rel_ours_vs_k64=rel(ours, ref_k),
            break_ours_vs_vref=n_ov,
            break_ours_vs_f64=n_of,
            break_vref_vs_f64=n_vf,
            break_ours_vs_k64=n_ok,
            units_ours_vs_k64_p50_p99_p9999_max=pct(u_ok),
            units_ours_vs_f64_p50_p99_p9999_max=pct(u_of),
            units_vref_vs_f64_p50_p99_p9999_max=pct(u_vf),
            seconds=round(time.time() - t0, 1),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
        del x, w1, w2, ours, ref_v, f64, ref_k
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
