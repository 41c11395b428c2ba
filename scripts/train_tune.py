"""GPU sweep of the Triton backward's tiles: full-backward time per candidate, one kernel family varied at a time."""

import sys
import time

import torch

from fusedmoe.checks import check_fused_moe_args
from fusedmoe.ops.configs import GemmConfig
from fusedmoe.routing import route
from fusedmoe.tools.bench.floors import _median_ms
from fusedmoe.training.triton_backward import BackwardInputs, Tiles, TritonBackward, pin_backward_tiles
from fusedmoe.workspace.manager import default_manager

SHAPES = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336), "dsv2lite": (64, 6, 2048, 1408)}
NEEDS = (True,) * 4 + (False, False)


def saved_preact(x, w1, w2, tw, ids):
    """The raw GEMM1 output the training forward saves (what the backward reads unless recompute=True)."""
    from fusedmoe import fused_moe

    out = fused_moe(x.detach().requires_grad_(), w1, w2, tw, ids)
    return out.grad_fn.saved_tensors[-1]


def main():
    t0 = time.time()
    recompute = "--recompute" in sys.argv
    for spec in [a for a in sys.argv[1:] if not a.startswith("--")] or [
        "mixtral:4096",
        "qwen3:4096",
        "dsv2lite:4096",
        "qwen3:16384",
    ]:
        name, M = spec.split(":")
        M = int(M)
        E, k, H, I = SHAPES[name]
        dt = torch.bfloat16
        x = torch.randn(M, H, device="cuda", dtype=dt)
        w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=dt) / H**0.5
        w2 = torch.randn(E, H, I, device="cuda", dtype=dt) / I**0.5
        tw, ids = route(torch.randn(M, E, device="cuda"), k)
        g = torch.randn_like(x)
        p = check_fused_moe_args(
            x,
            w1,
            w2,
            tw,
            ids,
            activation="silu",
            apply_router_weight_on_input=False,
            expert_map=None,
            global_num_experts=None,
            quant=None,
            w1_scale=None,
            w2_scale=None,
            a1_scale=None,
            a2_scale=None,
            checks="basic",
            w1_bias=None,
            w2_bias=None,
        )
        preact = None if recompute else saved_preact(x, w1, w2, tw, ids)
        inputs = BackwardInputs(x, w1, w2, tw, ids, None, None, None, g, preact)
        bwd, mgr = TritonBackward(), default_manager(x.device)
        pin_backward_tiles()
        ref = bwd(inputs, p, NEEDS, mgr)
        base = _median_ms(lambda: bwd(inputs, p, NEEDS, mgr))
        rows = M * k / E
        mode = "recompute" if recompute else "saved GEMM1 output"
        print(f"== {name} M={M} (rows/expert {rows:.0f}, {mode}): default backward {base:.3f} ms", flush=True)
        bms = [64] if rows > 64 else [16, 32, 64]
        cands = []
        for bm in bms:
            cands.append({"block_m": bm})
        if rows > 256:  # 128-row blocks: bwd_act and dX tiles twice as tall, the weight gradients still in 64-row steps
            act_tall = Tiles(128, 64, 8, 4)
            dx_tall = GemmConfig(128, 256, 64, 8, 8, 3)
            cands.append({"block_m": 128, "wgrad_step": 64, "act": act_tall})
            cands.append({"block_m": 128, "wgrad_step": 64, "act": act_tall, "dx": dx_tall})
            cands.append({"block_m": 128, "wgrad_step": 64, "act": Tiles(256, 64, 8, 3), "dx": dx_tall})
        for t in [
            (128, 128, 8, 3),
            (128, 128, 8, 4),
            (128, 64, 4, 3),
            (64, 128, 4, 3),
            (256, 128, 8, 3),
            (128, 256, 8, 3),
            (64, 64, 4, 3),
        ]:
            cands.append({"wgrad": Tiles(*t)})
        for t in [(64, 64, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (256, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)]:
            cands.append({"act": Tiles(*t)})
        for t in [(128, 64, 8, 8, 3), (128, 64, 8, 4, 3), (256, 64, 8, 8, 3), (128, 128, 8, 8, 3), (64, 64, 8, 4, 3)]:
            cands.append({"dx": GemmConfig(0, *t)})
        only = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")]
        cands = [c for c in cands if not only or set(c) & set(only[0].split(","))]
        for c in cands:
            if time.time() - t0 > 480:
                print("time budget reached", flush=True)
                return
            pin_backward_tiles()
            pin_backward_tiles(**c)
            try:
                got = bwd(inputs, p, NEEDS, mgr)
                err = max(
                    ((getattr(got, n).float() - getattr(ref, n).float()).norm() / getattr(ref, n).float().norm()).item()
                    for n in ("hidden_states", "w1", "w2", "topk_weights")
                )
                ms = _median_ms(lambda: bwd(inputs, p, NEEDS, mgr))
                print(f"   {ms:8.3f} ms  err {err:.1e}  {c}", flush=True)
            except Exception as exc:  # a tile that does not fit (shared memory) is a result too
                print(f"   failed {c}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        pin_backward_tiles()
        del x, w1, w2, g, inputs, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
