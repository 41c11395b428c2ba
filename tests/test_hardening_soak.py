"""Hardening, part 4: soak. Many decode steps over a 48-layer stack sharing one arena (``shared`` strategy).

After ``reserve`` (every layer at the largest M) and ``freeze`` (so a growth would raise instead of passing
quietly), a long run of steps with random M in [0, max] must cause zero growths and zero device allocations,
keep the reserved bytes constant, count exactly one call per layer per step, and keep giving the reference's
results at sampled (step, layer) points. On the GPU, ``torch.cuda.memory_allocated`` must also be flat.

CPU (CI): 300 steps x 48 tiny layers (torch experts, poisoned arena, M in [0, 512]), plus a short Triton run
under the interpreter. GPU (``-m gpu``): 10,000 steps x 48 layers of hidden 2048 / intermediate 768 (qwen3-30b's
sizes, 32 experts, top-4, bf16, weights shared by all layers), M in [0, 4096] log-uniform (so most steps are
decode-sized and every scale up to 4096 occurs); FUSEDMOE_SOAK_STEPS scales it.
"""

from __future__ import annotations

import math
import os
import random
import time

import pytest
import torch

from fusedmoe import FusedMoE, WorkspaceManager
from fusedmoe.ops.configs import MoEConfig, pinned_config
from fusedmoe.reference import fused_moe_reference, relative_error

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
LAYERS = 48


@pytest.fixture
def one_thread():
    """Tiny CPU matmuls are slower with intra-op threads on a loaded machine; the soak is about the arena."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + 1e-6).to(x.dtype)


def counters(mgr: WorkspaceManager) -> dict[str, int]:
    s = mgr.stats
    return {"reserved_bytes": s.reserved_bytes, "device_allocations": s.device_allocations, "growths": s.growths}


def check_sample(layer: FusedMoE, h: torch.Tensor, out: torch.Tensor, tol: float) -> None:
    w, ids = layer.route(h)
    ref = fused_moe_reference(h, layer.w1, layer.w2, w, ids, activation=layer.activation)
    err = relative_error(out, ref)
    assert err < tol, f"sampled output off by {err}"


def soak(
    layers, mgr, steps: int, max_m: int, hidden: int, dtype, device, sample_every: int, tol: float, draw_m, on_step=None
) -> int:
    rng = random.Random(1234)
    base = counters(mgr)
    calls = mgr.stats.calls
    samples = 0
    for step in range(steps):
        M = max_m if step == 0 else (0 if step == 1 else draw_m(rng))
        h = torch.randn(M, hidden, dtype=dtype, device=device)
        probe = rng.randrange(len(layers)) if step % sample_every == 0 else -1
        for i, layer in enumerate(layers):
            out = layer(h)
            if i == probe and M:
                check_sample(layer, h, out, tol)
                samples += 1
            h = rms_norm(h + out)
            del out
        if step % sample_every == 0:
            assert torch.isfinite(h).all()
        del h
        assert mgr.stats.calls == calls + len(layers) * (step + 1)
        assert counters(mgr) == base, f"step {step} (M={M}) changed the arena: {counters(mgr)} != {base}"
        if on_step is not None:
            on_step(step)
    return samples


def tiny_stack(mgr: WorkspaceManager, backend: str, H: int, E: int, K: int, sizes, n: int = LAYERS, seed: int = 0):
    torch.manual_seed(seed)
    return [FusedMoE(E, K, H, sizes[i % len(sizes)], workspace=mgr, backend=backend) for i in range(n)]


def reserve_all(mgr: WorkspaceManager, layers, max_m: int) -> None:
    """Size the shared arena once for the largest plan of the stack (one allocation)."""
    mgr.reserve(*[layer.plan(max_m) for layer in layers])


@pytest.mark.slow
def test_cpu_soak_shared_arena_torch_experts(one_thread):
    """300 steps x 48 layers (4 different plans), M in [0, 512], poisoned shared arena, frozen after reserve."""
    mgr = WorkspaceManager("cpu", strategy="shared", poison=True)
    layers = tiny_stack(mgr, "torch", H=32, E=8, K=2, sizes=[16, 24, 8, 32])
    assert len({layer.plan(512).nbytes for layer in layers}) >= 3  # the layers really have different plans
    reserve_all(mgr, layers, 512)
    for layer in layers:  # per-layer reservation after the fact is a no-op
        assert layer.reserve_workspace(512) == mgr.stats.reserved_bytes
    assert mgr.stats.growths == 0 and mgr.stats.device_allocations == 1
    mgr.freeze()
    try:
        samples = soak(
            layers,
            mgr,
            steps=300,
            max_m=512,
            hidden=32,
            dtype=torch.float32,
            device="cpu",
            sample_every=10,
            tol=1e-5,
            draw_m=lambda r: r.randint(0, 512),
        )
    finally:
        mgr.unfreeze()
    assert samples >= 25
    assert mgr.stats.growths == 0 and mgr.stats.device_allocations == 1
    assert mgr.stats.poison_fills == mgr.stats.calls


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRETING, reason="the Triton interpreter version runs on CPU")
def test_cpu_soak_shared_arena_triton_experts(one_thread):
    """The same contract for the Triton experts under the interpreter (kept short: 8 layers x 6 steps)."""
    mgr = WorkspaceManager("cpu", strategy="shared", poison=True)
    with pinned_config(MoEConfig.simple(16, 32, 32)):
        layers = tiny_stack(mgr, "triton", H=32, E=4, K=2, sizes=[16, 24], n=8)
        reserve_all(mgr, layers, 24)
        mgr.freeze()
        try:
            samples = soak(
                layers,
                mgr,
                steps=6,
                max_m=24,
                hidden=32,
                dtype=torch.float32,
                device="cpu",
                sample_every=1,
                tol=1e-5,
                draw_m=lambda r: r.randint(0, 24),
            )
        finally:
            mgr.unfreeze()
    assert samples >= 4 and mgr.stats.growths == 0 and mgr.stats.device_allocations == 1


@pytest.mark.gpu
def test_gpu_soak_10k_steps_48_layers():
    steps = int(os.environ.get("FUSEDMOE_SOAK_STEPS", "10000"))
    dev = torch.device("cuda")
    E, K, H, I, MAX_M = 32, 4, 2048, 768, 4096
    mgr = WorkspaceManager(dev, strategy="shared")
    torch.manual_seed(0)
    first = FusedMoE(E, K, H, I, dtype=torch.bfloat16, device=dev, workspace=mgr, backend="triton")
    layers = [first]
    for _ in range(LAYERS - 1):  # same weights, own layer object (own owner key, own routing state)
        layer = FusedMoE(E, K, H, I, dtype=torch.bfloat16, device="meta", workspace=mgr, backend="triton")
        layer.w1, layer.w2, layer.gate = first.w1, first.w2, first.gate
        layers.append(layer)
    reserve_all(mgr, layers, MAX_M)
    mgr.freeze()
    log_max = math.log(MAX_M + 1)
    draw_m = lambda r: min(MAX_M, int(math.exp(r.uniform(0.0, log_max))) - 1)  # noqa: E731
    # warm-up (compiles every kernel variant the M range needs), then memory must stay flat
    soak(
        layers,
        mgr,
        steps=50,
        max_m=MAX_M,
        hidden=H,
        dtype=torch.bfloat16,
        device=dev,
        sample_every=25,
        tol=2e-2,
        draw_m=draw_m,
    )
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(dev)
    seen = []

    start = time.perf_counter()

    def on_step(step: int) -> None:
        if step % 100 == 0:
            seen.append(torch.cuda.memory_allocated(dev))
        if step % 1000 == 0:  # progress, visible with -s (a 10,000-step soak takes minutes)
            print(f"soak step {step}/{steps}: {time.perf_counter() - start:.0f} s", flush=True)

    try:
        samples = soak(
            layers,
            mgr,
            steps=steps,
            max_m=MAX_M,
            hidden=H,
            dtype=torch.bfloat16,
            device=dev,
            sample_every=250,
            tol=2e-2,
            draw_m=draw_m,
            on_step=on_step,
        )
    finally:
        mgr.unfreeze()
    torch.cuda.synchronize()
    assert samples >= steps // 250 - 2
    assert set(seen) == {baseline}, f"memory_allocated moved: {sorted(set(seen))} vs {baseline}"
    assert torch.cuda.memory_allocated(dev) == baseline
    assert mgr.stats.growths == 0 and mgr.stats.device_allocations == 1
