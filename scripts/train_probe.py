"""Quick GPU probe of the training path: fwd+bwd time per shape and the backward's kernels (torch profiler)."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from fusedmoe import fused_moe
from fusedmoe.routing import route
from fusedmoe.tools.bench.floors import _median_ms

SHAPES = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336), "dsv2lite": (64, 6, 2048, 1408)}


def case(name, M, dtype=torch.bfloat16):
    E, k, H, I = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, H, device="cuda", dtype=dtype, generator=g)
    w1 = (torch.randn(E, 2 * I, H, device="cuda", dtype=dtype, generator=g) / H**0.5).requires_grad_()
    w2 = (torch.randn(E, H, I, device="cuda", dtype=dtype, generator=g) / I**0.5).requires_grad_()
    logits = torch.randn(M, E, device="cuda", generator=g)
    tw, ids = route(logits, k)
    return x.requires_grad_(), w1, w2, tw.requires_grad_(), ids


def step(x, w1, w2, tw, ids, gout, recompute=False):
    out = fused_moe(x, w1, w2, tw, ids, recompute=recompute)
    torch.autograd.grad(out, (x, w1, w2, tw), gout)


def grouped_mm_ref(x, w1, w2, tw, ids):
    """fwd+bwd of the same layer with torch._grouped_mm (transformers' default) for a side-by-side number."""
    M, k = ids.shape
    flat = ids.reshape(-1).long()
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=w1.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs)
    I = h.shape[1] // 2
    a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    y = y * tw.reshape(-1)[order, None].to(y.dtype)
    out = torch.zeros_like(x).index_add(0, order // k, y)
    return out


def main():
    which = sys.argv[1:] or ["qwen3:4096", "mixtral:4096", "dsv2lite:4096", "qwen3:16384"]
    for spec in which:
        name, M = spec.split(":")
        M = int(M)
        x, w1, w2, tw, ids = case(name, M)
        gout = torch.randn_like(x)
        t_fb = _median_ms(lambda: step(x, w1, w2, tw, ids, gout))
        t_rc = _median_ms(lambda: step(x, w1, w2, tw, ids, gout, recompute=True))
        with torch.no_grad():
            t_f = _median_ms(lambda: fused_moe(x, w1, w2, tw, ids))

        def ref_step():
            return torch.autograd.grad(grouped_mm_ref(x, w1, w2, tw, ids), (x, w1, w2, tw), gout)

        t_ref = _median_ms(ref_step)
        E, k, H, I = SHAPES[name]
        flops = 3 * 2 * M * k * H * 3 * I
        # gradient agreement with the grouped_mm reference
        ours = [t.float() for t in torch.autograd.grad(fused_moe(x, w1, w2, tw, ids), (x, w1, w2, tw), gout)]
        refs = [t.float() for t in ref_step()]
        errs = [((a - b).norm() / b.norm()).item() for a, b in zip(ours, refs)]
        print(
            f"{name} M={M}: fwd {t_f:.3f} ms, fwd+bwd {t_fb:.3f} ms ({flops / t_fb / 1e9:.0f} TFLOP/s), "
            f"with recompute {t_rc:.3f} ms, "
            f"grouped_mm fwd+bwd {t_ref:.3f} ms; grad rel err x/w1/w2/tw vs grouped_mm "
            + " ".join(f"{e:.2e}" for e in errs),
            flush=True,
        )
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(x, w1, w2, tw, ids, gout)
            torch.cuda.synchronize()
        rows = {}
        for ev in prof.key_averages():
            if ev.device_type.name == "CUDA" or getattr(ev, "device_time_total", 0):
                rows[ev.key] = getattr(ev, "device_time_total", 0) / 1000
        for key, ms in sorted(rows.items(), key=lambda kv: -kv[1])[:10]:
            print(f"    {ms:8.3f} ms  {key[:90]}")
        del x, w1, w2, tw, ids, gout
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
