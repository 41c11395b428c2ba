"""Recorded launch traces and cached validation verdicts (the eager hot path).

A call's launches are recorded once per (program, input signature) and replayed with new pointers; these
tests prove a replay computes what a fresh run computes, for every way the pointers can move (new inputs,
strided views at new offsets, a grown arena, a per-layer arena), that every run a replay could not redo is
refused, and that a cached verdict never skips a check that depends on more than the signature.
Triton kernels run under the CPU interpreter (float32), where a trace replays through ``kernel[grid]`` with
views rebuilt at the recorded offsets.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fusedmoe import FusedMoE, WorkspaceManager, fused_moe, route
from fusedmoe.api import get_kernel
from fusedmoe.kernel import MoEKernel
from fusedmoe.ops import launcher
from fusedmoe.ops.configs import MoEConfig, get_config, pinned_config
from fusedmoe.ops.launcher import Recorder
from fusedmoe.signature import input_signature

pytest.importorskip("triton")

M, E, K, H, I = 5, 4, 2, 32, 16
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: the Triton interpreter (conftest)
TOL = dict(rtol=1e-4, atol=1e-5) if DEV.type == "cpu" else dict(rtol=2e-2, atol=2e-3)  # TF32 on the GPU


def _inputs(seed: int, m: int = M, *, row_stride: int | None = None):
    """Inputs on DEV; with ``row_stride``, hidden_states is a strided view at a seed-dependent, 16-byte
    aligned offset inside a wider buffer."""
    g = torch.Generator().manual_seed(seed)
    if row_stride is None:
        x = torch.randn(m, H, generator=g).to(DEV)
    else:
        base = torch.randn(m + 1, row_stride, generator=g).to(DEV)
        off = 4 * (seed % ((row_stride - H) // 4 + 1))
        x = base[1:, off : off + H]
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DEV)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(DEV)
    tw, ti = route(torch.randn(m, E, generator=g).to(DEV), K)
    return x, w1, w2, tw, ti


def _fresh(*args, **kw) -> torch.Tensor:
    """The same call through the steps (replay switched off)."""
    launcher.set_replay(False)
    try:
        return fused_moe(*args, **kw)
    finally:
        launcher.set_replay(True)


def _trace_key(args):
    kernel = get_kernel("triton")
    x, w1, w2, tw, ti = args
    from fusedmoe.checks import check_fused_moe_args

    p = check_fused_moe_args(
        x,
        w1,
        w2,
        tw,
        ti,
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
    sig = input_signature(x, w1, w2, tw, ti, None, None, None, None, None, None, None)
    return kernel, p, sig


def _no_steps(monkeypatch):
    """From now on a call that runs the steps (instead of replaying) fails the test."""

    def boom(*a, **k):
        raise AssertionError("the steps ran: the call was not replayed")

    monkeypatch.setattr(MoEKernel, "_run", boom)


def test_replay_matches_a_fresh_run_on_new_inputs(monkeypatch):
    mgr = WorkspaceManager(DEV)
    first = _inputs(0)
    out0 = fused_moe(*first, backend="triton", workspace=mgr)
    kernel, p, sig = _trace_key(first)
    assert kernel.replay_reason(p, sig) is None
    expected = [_fresh(*_inputs(s), backend="triton", workspace=mgr) for s in (1, 2)]
    torch.testing.assert_close(out0, _fresh(*first, backend="triton", workspace=mgr), rtol=0, atol=0)
    _no_steps(monkeypatch)
    for s, want in zip((1, 2), expected):
        got = fused_moe(*_inputs(s), backend="triton", workspace=mgr)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_replay_follows_strided_views_at_new_offsets(monkeypatch):
    mgr = WorkspaceManager(DEV)
    fused_moe(*_inputs(0, row_stride=2 * H), backend="triton", workspace=mgr)
    want = [_fresh(*_inputs(s, row_stride=2 * H), backend="triton", workspace=mgr) for s in (3, 7)]
    ref = [fused_moe(*_inputs(s, row_stride=2 * H), backend="torch", workspace=mgr) for s in (3, 7)]
    _no_steps(monkeypatch)
    for s, w, r in zip((3, 7), want, ref):
        got = fused_moe(*_inputs(s, row_stride=2 * H), backend="triton", workspace=mgr)
        torch.testing.assert_close(got, w, rtol=0, atol=0)
        torch.testing.assert_close(got, r, **TOL)


def test_a_recorded_trace_keeps_no_tensor_of_the_call_alive():
    """A cached trace holds where each argument points, not the tensors: a trace per signature that kept its
    call's input and output alive leaked ~3 MB per new token count on the GPU (the 10,000-step soak)."""
    import gc
    import weakref

    mgr = WorkspaceManager(DEV)
    for m in (3, 4):  # a new signature each: each call is recorded
        x, w1, w2, tw, ti = _inputs(m, m)
        out = fused_moe(x, w1, w2, tw, ti, backend="triton", workspace=mgr)
        kernel, p, sig = _trace_key((x, w1, w2, tw, ti))
        assert kernel.replay_reason(p, sig) is None  # recorded and replayable
        refs = [weakref.ref(t) for t in (x, tw, ti, out)]
        del x, tw, ti, out
        gc.collect()
        assert [r() for r in refs] == [None] * 4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_dropped_workspace_manager_is_freed(backend):
    """fused_moe's verdict cache names the caller's manager by identity and holds it weakly: a manager (and its
    arena) the caller drops is freed; a new manager gets a verdict of its own and the same result."""
    import gc
    import weakref

    args = _inputs(5)
    mgr = WorkspaceManager(DEV)
    first = fused_moe(*args, backend=backend, workspace=mgr)
    assert mgr.stats.calls == 1
    ref = weakref.ref(mgr)
    del mgr
    gc.collect()
    assert ref() is None
    other = WorkspaceManager(DEV)
    torch.testing.assert_close(fused_moe(*args, backend=backend, workspace=other), first, rtol=0, atol=0)
    assert other.stats.calls == 1  # ran on the manager it was given


def test_a_new_signature_records_a_new_trace():
    mgr = WorkspaceManager(DEV)
    a, b = _inputs(0), _inputs(1, row_stride=2 * H)
    for args in (a, b, a, b):
        got = fused_moe(*args, backend="triton", workspace=mgr)
        torch.testing.assert_close(got, fused_moe(*args, backend="torch", workspace=mgr), **TOL)
    ka, pa, sa = _trace_key(a)
    kb, pb, sb = _trace_key(b)
    assert sa != sb
    assert ka.replay_reason(pa, sa) is None and kb.replay_reason(pb, sb) is None


@pytest.mark.parametrize("strategy", ["shared", "per_layer"])
def test_replay_after_the_arena_moved(strategy, monkeypatch):
    mgr = WorkspaceManager(DEV, strategy=strategy)
    small = _inputs(0)
    fused_moe(*small, backend="triton", workspace=mgr)
    before = mgr.arena_for(get_kernel("triton").plan(_trace_key(small)[1])).data_ptr()
    mgr.reserve(1 << 20)  # grows (replaces) the arena
    after = mgr.arena_for(get_kernel("triton").plan(_trace_key(small)[1])).data_ptr()
    assert after != before
    want = _fresh(*_inputs(2), backend="triton", workspace=mgr)
    _no_steps(monkeypatch)
    torch.testing.assert_close(fused_moe(*_inputs(2), backend="triton", workspace=mgr), want, rtol=0, atol=0)


def test_torch_experts_are_refused_and_still_run():
    mgr = WorkspaceManager(DEV)
    args = _inputs(0)
    for _ in range(2):
        fused_moe(*args, backend="torch", workspace=mgr)
    kernel = get_kernel("torch")
    p = _trace_key(args)[1]
    reason = kernel.replay_reason(p, input_signature(*args, None, None, None, None, None, None, None))
    assert reason is not None and "torch op" in reason


def test_poisoning_manager_never_replays(monkeypatch):
    args = _inputs(0)
    fused_moe(*args, backend="triton", workspace=WorkspaceManager(DEV))  # a trace exists for this signature
    runs = []
    real = MoEKernel._run
    monkeypatch.setattr(MoEKernel, "_run", lambda self, *a: runs.append(a[-1]) or real(self, *a))
    mgr = WorkspaceManager(DEV, poison=True)
    outs = [fused_moe(*args, backend="triton", workspace=mgr) for _ in range(2)]
    assert runs == [True, True]  # the steps ran each time, with the boundary checks on
    assert mgr.stats.poison_fills == 2
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_recorder_refuses_temporaries_and_ambiguous_roots():
    from fusedmoe.ops.reduce import moe_reduce

    y = torch.randn(M * K, H, device=DEV)
    ids = torch.randint(0, E, (M, K), dtype=torch.int32, device=DEV)
    out = torch.empty(M, H, device=DEV)
    with Recorder((y, ids, out), None) as rec:  # all roots: replayable
        moe_reduce(y, ids, out, E)
    assert rec.trace() is not None and rec.reason is None
    with Recorder((y, out), None) as rec:  # ids is nowhere
        moe_reduce(y, ids, out, E)
    assert rec.trace() is None and "not inside one root" in rec.reason
    with Recorder((y, y, ids, out), None) as rec:  # y could be either root
        moe_reduce(y, ids, out, E)
    assert rec.trace() is None
    with Recorder((y, ids, out), None) as rec:  # a copy inside the call
        moe_reduce(y.clone(), ids, out, E)
    assert rec.trace() is None and "torch op" in rec.reason


def test_full_checks_run_on_every_call():
    mgr = WorkspaceManager(DEV)
    x, w1, w2, tw, ti = _inputs(0)
    fused_moe(x, w1, w2, tw, ti, backend="torch", workspace=mgr, checks="full")
    bad = ti.clone()
    bad[0, 0] = E + 3
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        fused_moe(x, w1, w2, tw, bad, backend="torch", workspace=mgr, checks="full")


def test_cached_verdict_still_builds_the_graph():
    mgr = WorkspaceManager(DEV)
    x, w1, w2, tw, ti = _inputs(0)
    with torch.no_grad():
        want = fused_moe(x, w1, w2, tw, ti, backend="torch", workspace=mgr)
    w1.requires_grad_(True)
    out = fused_moe(x, w1, w2, tw, ti, backend="torch", workspace=mgr)  # the cached verdict's path
    assert out.requires_grad
    out.sum().backward()
    assert w1.grad is not None and w1.grad.abs().sum() > 0
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)


def _layer(**kw) -> FusedMoE:
    torch.manual_seed(0)
    return FusedMoE(E, K, H, I, dtype=torch.float32, device=DEV, workspace=WorkspaceManager(DEV), **kw)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_layer_reuses_its_verdict_and_matches_the_checked_path(backend, monkeypatch):
    layer = _layer(backend=backend)
    xs = [torch.randn(2, 3, H, device=DEV) for _ in range(3)]
    want = [layer(x) for x in xs]  # the first call validates and records
    calls = []
    checked = FusedMoE._forward_checked
    monkeypatch.setattr(FusedMoE, "_forward_checked", lambda self, *a: calls.append(1) or checked(self, *a))
    for x, w in zip(xs, want):
        torch.testing.assert_close(layer(x), w, rtol=0, atol=0)
    assert not calls
    layer(torch.randn(4, H, device=DEV))  # a new signature: validated once more
    assert calls == [1]


def test_layer_settings_and_replaced_weights_are_revalidated():
    layer = _layer()
    x = torch.randn(3, H, device=DEV)
    base = layer(x)
    layer.activation = "gelu"  # a setting is part of the key
    assert not torch.equal(layer(x), base)
    layer.activation = "silu"
    torch.testing.assert_close(layer(x), base, rtol=0, atol=0)
    layer.w1 = torch.nn.Parameter(layer.w1.detach().double(), requires_grad=False)  # a new signature
    with pytest.raises(TypeError, match="w1/w2 dtype|does not match"):
        layer(x)


# ---- GPU: the compiled launcher path ------------------------------------------------------------------------
def _gpu_args(seed, m, quant):
    from fusedmoe.quant import quantize_weights

    g = torch.Generator().manual_seed(seed)
    e, k, h, i = 8, 2, 256, 128
    x = torch.randn(m, h, generator=g).cuda().bfloat16()
    w1 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).cuda().bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).cuda().bfloat16()
    tw, ti = route(torch.randn(m, e, generator=g).cuda(), k)
    kw = {}
    if quant is not None:
        w1, w2, s1, s2 = quantize_weights(w1, w2, quant)
        kw = dict(quant=quant, w1_scale=s1, w2_scale=s2)
    return (x, w1, w2, tw, ti), kw


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "fp8_tensor", "fp8_token", "fp8_block"])
@pytest.mark.parametrize("m", [1, 7, 300])
def test_gpu_replay_is_bitwise_a_fresh_run(quant, m, monkeypatch):
    mgr = WorkspaceManager("cuda")
    with pinned_config(_pointer_loads(m, quant)):  # the config chosen, with pointer loads: replayable
        args, kw = _gpu_args(0, m, quant)
        fused_moe(*args, workspace=mgr, **kw)  # records
        cases = [_gpu_args(s, m, quant) for s in (1, 2, 3)]
        want = [_fresh(*a, workspace=mgr, **k) for a, k in cases]
        _no_steps(monkeypatch)
        for (a, k), w in zip(cases, want):
            torch.testing.assert_close(fused_moe(*a, workspace=mgr, **k), w, rtol=0, atol=0)


def _pointer_loads(m: int, quant: str | None) -> MoEConfig:
    """The config of a _gpu_args problem with TMA weight descriptors off."""
    cfg = get_config(m, 8, 256, 128, 2, quant_mode=quant)
    return MoEConfig(replace(cfg.gemm1, tma=False), replace(cfg.gemm2, tma=False))


@pytest.mark.gpu
def test_gpu_tma_launches_run_unreplayed_and_bitwise_equal():
    """A launch with a TMA descriptor packs the weights' address when it launches, which a trace cannot
    substitute: such calls are recorded as not replayable (the reason says why) and run their steps every time,
    with the same output as a fresh run."""
    m = 300
    tma = _pointer_loads(m, None)
    tma = MoEConfig(replace(tma.gemm1, block_m=64, tma=True), replace(tma.gemm2, block_m=64, tma=True))
    mgr = WorkspaceManager("cuda")
    with pinned_config(tma):
        args, kw = _gpu_args(0, m, None)
        fused_moe(*args, workspace=mgr, **kw)
        kernel = get_kernel("triton")
        assert any("descriptor" in (kernel.traces.reason(key) or "") for key in kernel.traces._traces)
        for seed in (1, 2):
            a, k = _gpu_args(seed, m, None)
            torch.testing.assert_close(
                fused_moe(*a, workspace=mgr, **k), _fresh(*a, workspace=mgr, **k), rtol=0, atol=0
            )


@pytest.mark.gpu
def test_gpu_replayed_calls_capture_in_a_cuda_graph():
    mgr = WorkspaceManager("cuda")
    args, _ = _gpu_args(0, 16, None)
    static = [a.clone() for a in args]
    fused_moe(*static, workspace=mgr)  # records the trace
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(*static, workspace=mgr)  # sizes this stream's slot
    torch.cuda.current_stream().wait_stream(stream)
    mgr.freeze()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fused_moe(*static, workspace=mgr)
    for seed in (1, 2):
        new, _ = _gpu_args(seed, 16, None)
        for s, n in zip(static, new):
            s.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, _fresh(*new, workspace=WorkspaceManager("cuda")), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen3-moe", "deepseek-v3", "gpt-oss"])
def test_gpu_layer_replay_matches_generic_launches(preset, monkeypatch):
    from fusedmoe.routing import ROUTING_PRESETS

    torch.manual_seed(0)
    routing = dict(ROUTING_PRESETS[preset])
    if preset == "deepseek-v3":
        routing["num_expert_groups"], routing["topk_groups"] = 4, 2
    layer = FusedMoE(
        16,
        4,
        256,
        128,
        dtype=torch.bfloat16,
        device="cuda",
        correction_bias=preset == "deepseek-v3",
        router_bias=preset == "gpt-oss",
        expert_bias=preset == "gpt-oss",
        activation="swigluoai" if preset == "gpt-oss" else "silu",
        **routing,
    )
    if preset == "deepseek-v3":
        layer.e_score_correction_bias.normal_()
    xs = [torch.randn(2, 5, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    layer(xs[0])
    launcher.set_replay(False)
    try:
        want = [layer(x) for x in xs]
    finally:
        launcher.set_replay(True)
    _no_steps(monkeypatch)
    for x, w in zip(xs, want):
        torch.testing.assert_close(layer(x), w, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_each_stream_replays_on_its_own_arena():
    mgr = WorkspaceManager("cuda")
    args, _ = _gpu_args(0, 64, None)
    want = _fresh(*args, workspace=WorkspaceManager("cuda"))
    fused_moe(*args, workspace=mgr)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a = fused_moe(*args, workspace=mgr)
    b = fused_moe(*args, workspace=mgr)
    torch.cuda.synchronize()
    torch.testing.assert_close(a, want, rtol=0, atol=0)
    torch.testing.assert_close(b, want, rtol=0, atol=0)
    assert len(mgr._arenas) == 2


@pytest.mark.gpu
def test_gpu_an_installed_launch_hook_sees_every_launch():
    from triton import knobs

    mgr = WorkspaceManager("cuda")
    args, _ = _gpu_args(0, 8, None)
    want = fused_moe(*args, workspace=mgr)  # recorded
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        got = fused_moe(*args, workspace=mgr)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) >= 4  # align, GEMM1, GEMM2, reduce went through Triton's launcher
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_layer_copies_and_pickles_after_calls():
    """Cached verdicts (kernels, managers, closures) stay with the original: copies start empty and work."""
    import copy
    import pickle

    layer = _layer()  # with an explicit workspace manager
    x = torch.randn(3, H, device=DEV)
    want = layer(x)
    assert layer._verdicts
    clone = copy.deepcopy(layer)
    assert not clone._verdicts and clone.workspace is layer.workspace  # a manager is shared, not copied
    torch.testing.assert_close(clone(x), want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="WorkspaceManager holds device arenas"):
        pickle.dumps(layer)
    layer.workspace = None  # the device's default manager
    layer(x)
    clone = pickle.loads(pickle.dumps(layer))
    assert not clone._verdicts
    torch.testing.assert_close(clone(x), want, rtol=0, atol=0)
    assert layer._verdicts  # the original keeps its cache
