"""Where fused_moe's host time goes at M=1 (qwen3 shape, bf16): replay status, per-call time, cProfile top."""

import cProfile
import pstats
import time

import torch

from fusedmoe import fused_moe
from fusedmoe.api import _VERDICTS
from fusedmoe.routing import route

E, k, H, I, M = 128, 8, 2048, 768, 1
x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) / 45
w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) / 28
tw, ids = route(torch.randn(M, E, device="cuda"), k)
for grad in (True, False):
    with torch.set_grad_enabled(grad):
        for _ in range(50):
            fused_moe(x, w1, w2, tw, ids)
        torch.cuda.synchronize()
        ((p, kernel, manager),) = [v for v in _VERDICTS.values()][-1:]

        print("grad", grad, "replay reason:", kernel.replay_reason(p, next(iter(_VERDICTS))[0]))
        n = 2000
        t = time.perf_counter()
        for _ in range(n):
            fused_moe(x, w1, w2, tw, ids)
        dt = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        print(f"grad={grad}: {dt:.1f} us/call")
pr = cProfile.Profile()
pr.enable()
for _ in range(2000):
    fused_moe(x, w1, w2, tw, ids)
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
