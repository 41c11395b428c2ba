"""``fusedmoe bench host``: host time per call, and where it goes.

Host time is the time the calling thread spends issuing a call (enqueue time): each of ``calls`` calls is
issued after the device went idle and timed until it returns (median), so the device is never the limit.
Reported per path and per M:

- ``FusedMoE.forward`` (routing included) and ``fused_moe`` (routing given), each with trace replay (the
  default) and through Triton's generic launcher (``FUSEDMOE_REPLAY=0``), plus ``fused_moe_op`` (the
  registered op that ``torch.compile`` sees; eager callers pay its dispatch only if they call it);
- ``FusedMoE.forward`` with its router logits computed both ways, whatever the switch
  (:data:`fusedmoe.ops.routing.ROUTER_GEMM_MAX_M`) picks: by the routing launch, and by ``F.linear`` before it,
  timed in turns of 20 calls with the default forward (:func:`host_us_interleaved`), which equals one of the two:
  the difference between those two rows is the run's noise;
- the stages of a forward, each timed alone on the same inputs: the checked validation (what a call costs
  without a cached verdict), the verdict lookup (input signature + dict), the router linear, the plan lookup,
  the workspace arena, the output allocation, and every kernel launch of the layer's recorded trace, routing
  included (``launch <kernel>``: its compiled launcher alone). ``raw launches`` is their sum: the floor of a call that
  makes these launches; ``forward / raw`` is the overhead factor;
- GPU time per call (CUDA graph replay), to set host time against;
- transformers' experts interface: the preset model's experts module called as its MoE block calls it
  (transformers' dispatcher, then fusedmoe), beside the bare ``fused_moe`` on the same inputs and the stages
  between (fusedmoe's experts function without the dispatcher), the three timed call by call in turns;
- the batched layout (``FusedMoE(layout="batched")``) and, with gloo on the CPU, the expert-parallel layer of
  one rank.

Without a GPU the same table runs the torch experts on a small shape (every microsecond is host time there).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...api import fused_moe
from ...checks import check_fused_moe_args
from ...kernel import _roots, _stream
from ...layer import FusedMoE
from ...op import fused_moe_op
from ...ops import launcher
from ...ops import routing as routing_ops
from ...workspace.manager import WorkspaceManager
from ..presets import Preset, get_preset
from . import report
from .timing import graph_time_us, sync

COLUMNS = ["path", "backend", "M", "host us/call", "device us/call", "note"]


def host_us(fn: Callable[[], object], device: torch.device, *, calls: int = 200) -> float:
    """Median host microseconds of one call of ``fn``, each issued after the device went idle (so the launch
    queue never pushes back, whatever the GPU time): :func:`host_us_interleaved` of one path."""
    return host_us_interleaved({"fn": (fn, None)}, device, calls=calls)["fn"]


def host_us_interleaved(
    paths: dict[str, tuple[Callable[[], object], Callable[[], None] | None]],
    device: torch.device,
    *,
    calls: int = 200,
    block: int = 1,
) -> dict[str, float]:
    """Median host microseconds of one call of each path, the paths taking turns (A B C, A B C, ...) so that a slow
    phase of the machine falls on all of them alike. ``paths``: name -> (``fn``, ``switch``); ``switch`` (or None)
    runs, untimed, before each of the path's turns (e.g. a setting and the untimed call it makes redo), and a turn
    is ``block`` timed calls, each issued after the device went idle. ``calls`` per path in all."""
    for fn, switch in paths.values():
        if switch is not None:
            switch()
        for _ in range(3):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(max(1, calls // block)):
        for name, (fn, switch) in paths.items():
            if switch is not None:
                switch()
            for _ in range(block):
                sync(device)
                t0 = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t0) * 1e6)
    sync(device)
    return {name: statistics.median(values) for name, values in samples.items()}


def device_us(fn: Callable[[], object], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return graph_time_us([fn] * 10)


def _without_replay(fn: Callable[[], object]) -> Callable[[], object]:
    def run():
        was = launcher.ENABLED
        launcher.set_replay(False)
        try:
            return fn()
        finally:
            launcher.set_replay(was)

    return run


#: The CPU table's shape (the torch experts; every microsecond is host time).
CPU_SHAPE = Preset("cpu-small", 16, 4, 256, 128, 1)


def measure(
    device: torch.device,
    *,
    preset: str | Preset = "qwen3-30b-a3b",
    tokens=(1, 8, 64),
    dtype=torch.bfloat16,
    backends=("triton",),
    calls: int = 200,
    ep: bool = True,
    interface: bool = True,
) -> list[dict]:
    """Every row of the host table (see the module docstring) as dicts."""
    pr = preset if isinstance(preset, Preset) else get_preset(preset)
    rows: list[dict] = []

    def row(path, backend, M, host, dev=None, note=""):
        rows.append({"path": path, "backend": backend, "M": M, "host_us": host, "device_us": dev, "note": note})

    manager = WorkspaceManager(device)
    for backend in backends:
        torch.manual_seed(0)
        layer = pr.routed_layer(dtype=dtype, device=device, workspace=manager, backend=backend)
        for M in tokens:
            x = torch.randn(M, pr.hidden_size, dtype=dtype, device=device)
            with torch.inference_mode():
                _forward_rows(row, layer, x, backend, M, device, calls)
        del layer
    if device.type == "cuda" and "triton" in backends:
        with torch.inference_mode():
            _batched_rows(row, pr, device, dtype, tokens, calls)
    if interface:
        name = "qwen3-30b-a3b" if pr is CPU_SHAPE else pr.name  # the CPU shape is no transformers model
        with torch.inference_mode():
            _interface_rows(row, name, device, dtype, tokens, backends[0], calls)
    if ep:
        _ep_rows(row, calls)
    return rows


def _interface_rows(row, preset: str, device, dtype, tokens, backend: str, calls) -> None:
    """transformers' experts interface around fusedmoe, stage by stage: the experts module of ``preset``'s
    transformers model (tiny dimensions on the CPU) called as its MoE block calls it, with transformers' int64
    top-k ids and routing weights in the hidden dtype; the bare ``fused_moe`` on the same inputs; and what lies
    between (the dispatcher, fusedmoe's experts function)."""
    try:
        from ...integrations import hf
        from .train import shape_of, transformers_experts

        shape = shape_of(preset, tiny=device.type != "cuda")
        g = torch.Generator(device=device).manual_seed(0)
        E, H, I = shape.num_experts, shape.hidden, shape.inter
        w1 = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=g, device=device, dtype=dtype) / H**0.5, False)
        w2 = torch.nn.Parameter(torch.randn(E, H, I, generator=g, device=device, dtype=dtype) / I**0.5, False)
        experts = transformers_experts(shape, w1, w2)
    except (ImportError, KeyError, ValueError) as err:
        row("experts interface", backend, None, None, None, f"not measured: {type(err).__name__}: {err}"[:120])
        return
    if experts is None:
        row("experts interface", backend, None, None, None, "not measured: transformers not installed")
        return
    hf.register()
    experts.config._experts_implementation = hf.EXPERTS_IMPLEMENTATION
    manager = hf.attach_workspace(experts, WorkspaceManager(device), backend)
    where = f"{type(experts).__name__}, E={E} H={H} I={I}"
    for M in tokens:
        x = torch.randn(M, H, generator=g, device=device, dtype=dtype)
        logits = torch.randn(M, E, generator=g, device=device)
        weights, ids = torch.topk(logits.softmax(-1), shape.top_k, dim=-1)  # int64 ids, as transformers' routers
        weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
        module_call = lambda x=x, i=ids, w=weights: experts(x, i, w)  # noqa: E731
        calls_before = manager.stats.calls
        module_call()
        if manager.stats.calls == calls_before:
            row("experts interface (module call)", backend, M, None, None, where)
            row("  (fusedmoe did not run)", backend, M, None, None, "the module fell back to transformers' code")
            continue
        bare = lambda x=x, i=ids, w=weights: fused_moe(x, w1, w2, w, i, workspace=manager, backend=backend)  # noqa: E731
        fn = lambda x=x, i=ids, w=weights: hf.fusedmoe_experts_forward(experts, x, i, w)  # noqa: E731
        # call by call in turns: the differences between the three are what this measures
        us = host_us_interleaved({"module": (module_call, None), "bare": (bare, None), "fn": (fn, None)}, device,
                                 calls=calls)  # fmt: skip
        row("experts interface (module call)", backend, M, us["module"], device_us(module_call, device), where)
        row(
            "fused_moe on the same inputs",
            backend,
            M,
            us["bare"],
            device_us(bare, device),
            "as transformers passes them",
        )
        row("  fusedmoe_experts_forward (no dispatcher)", backend, M, us["fn"])


#: The two ways to a layer's router logits that ``bench host`` times: (row name, ROUTER_GEMM_MAX_M) with the routing
#: launch computing them at every M measured, and with F.linear before it.
_ROUTER_CHOICES = (("router GEMM in the routing launch", 1 << 30), ("logits by F.linear", -1))


def _switch_router_gemm(layer: FusedMoE, most: int, call: Callable[[], object]) -> Callable[[], None]:
    """What switches ``layer`` to ``ROUTER_GEMM_MAX_M = most`` between turns: the setting, the layer's cached
    verdicts dropped (they hold the choice) and one untimed ``call`` that caches the new one."""

    def switch():
        routing_ops.ROUTER_GEMM_MAX_M = most
        layer._verdicts.clear()
        call()

    return switch


@contextlib.contextmanager
def _router_gemm_max_m(layer: FusedMoE, most: int):
    """The layer's calls with :data:`~fusedmoe.ops.routing.ROUTER_GEMM_MAX_M` set to ``most`` (its cached verdicts,
    which hold the choice, dropped on the way in and out)."""
    was = routing_ops.ROUTER_GEMM_MAX_M
    routing_ops.ROUTER_GEMM_MAX_M = most
    layer._verdicts.clear()
    try:
        yield
    finally:
        routing_ops.ROUTER_GEMM_MAX_M = was
        layer._verdicts.clear()


def _forward_rows(row, layer: FusedMoE, x: torch.Tensor, backend: str, M: int, device, calls) -> None:
    h = lambda fn: host_us(fn, device, calls=calls)  # noqa: E731
    forward = lambda: layer(x)  # noqa: E731
    # the default and both router-logit choices in turns of 20 calls (each turn switches ROUTER_GEMM_MAX_M and
    # makes the checked call again, untimed); the default equals one of the two, which shows the run's noise
    choices = {"FusedMoE.forward": routing_ops.ROUTER_GEMM_MAX_M}
    choices.update({f"FusedMoE.forward ({name})": most for name, most in _ROUTER_CHOICES})
    with _router_gemm_max_m(layer, routing_ops.ROUTER_GEMM_MAX_M):
        paths = {name: (forward, _switch_router_gemm(layer, most, forward)) for name, most in choices.items()}
        us = host_us_interleaved(paths, device, calls=calls, block=20)
    for name, most in choices.items():
        with _router_gemm_max_m(layer, most):
            row(name, backend, M, us[name], device_us(forward, device))
    fwd = us["FusedMoE.forward"]
    row("FusedMoE.forward (generic launches)", backend, M, h(_without_replay(forward)))
    logits = F.linear(x, layer.gate)
    w, ids = layer.route(x, logits)
    args = (x, layer.w1, layer.w2, w, ids)
    call = lambda: fused_moe(*args, workspace=layer.workspace, backend=backend)  # noqa: E731
    row("fused_moe", backend, M, h(call), device_us(call, device))
    row("fused_moe (generic launches)", backend, M, h(_without_replay(call)))
    row(
        "fused_moe_op (registered op)",
        backend,
        M,
        h(lambda: fused_moe_op(*args, workspace=layer.workspace, backend=backend)),
    )

    # stages, each alone on the same inputs
    stage = lambda name, fn, note="": row(f"  {name}", backend, M, h(fn), None, note)  # noqa: E731
    stage(
        "checked validation",
        lambda: check_fused_moe_args(
            *args,
            activation="silu",
            apply_router_weight_on_input=False,
            expert_map=None,
            global_num_experts=None,
            quant=None,
            w1_scale=None,
            w2_scale=None,
            a1_scale=None,
            a2_scale=None,
        ),
        "per call without a verdict",
    )
    key, _ = layer._key(x, None)
    stage("verdict lookup", lambda: layer._verdicts.get(layer._key(x, None)[0]), "input signature + dict")
    stage("router linear", lambda: F.linear(x, layer.gate, layer.gate_bias))
    p, kernel, manager, router, gate_in_kernel, layout = layer._verdicts[key]
    if router is not None:  # routing outside the kernel (parallel layers)
        stage("routing", lambda: router(logits, None))
        inputs = layer._inputs(x, w, ids)
    else:  # the kernel routes (from the logits, or from the router's weight): one of the launches below
        inputs = layer._inputs(x, gate=True) if gate_in_kernel else layer._inputs(x, logits=logits)
    stage("plan lookup", lambda: kernel.program(p))
    plan = kernel.program(p)[0].plan
    stage("workspace arena", lambda: manager.arena_for(plan, layer.owner_key))
    stage("output alloc", lambda: torch.empty((M, x.shape[1]), dtype=x.dtype, device=x.device))
    stage("ExpertsInputs", lambda: layer._inputs(x, gate=gate_in_kernel, logits=None if gate_in_kernel else logits))
    trace = kernel.traces.get((kernel.program(p)[0], layout))
    if isinstance(trace, launcher.Trace):
        out = torch.empty((M, x.shape[1]), dtype=x.dtype, device=x.device)
        arena = manager.arena_for(plan, layer.owner_key)
        roots, stream = (*_roots(inputs), out), _stream(x)
        raw = 0.0
        for name, part in trace.parts():
            us = h(lambda part=part: part(roots, arena, stream))
            raw += us
            row(f"  launch {name}", backend, M, us)
        row("  raw launches (sum)", backend, M, raw, None, f"forward / raw = {fwd / raw:.2f}")
    else:
        row("  launches", backend, M, None, None, kernel.traces.reason((kernel.program(p)[0], layout)) or "")


def _batched_rows(row, pr, device, dtype, tokens, calls) -> None:
    layer = pr.routed_layer(
        dtype=dtype, device=device, backend="triton", layout="batched", max_tokens_per_expert=max(tokens) * pr.top_k
    )
    for M in tokens:
        x = torch.randn(M, pr.hidden_size, dtype=dtype, device=device)
        fn = lambda x=x: layer(x)  # noqa: E731
        row("FusedMoE.forward (batched layout)", "triton", M, host_us(fn, device, calls=calls), device_us(fn, device))


def _ep_rows(row, calls) -> None:
    """The expert-parallel layer of a one-rank gloo group on the CPU (torch experts, the CPU table's shape)."""
    import torch.distributed as dist

    owned = False
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        owned = True
    try:
        cpu, s = torch.device("cpu"), CPU_SHAPE
        layer = s.routed_layer(dtype=torch.float32, device=cpu, backend="torch", ep_group=dist.group.WORLD)
        local = s.routed_layer(dtype=torch.float32, device=cpu, backend="torch")
        shape = f"E={s.num_experts} k={s.top_k} H={s.hidden_size} I={s.intermediate_size}"
        for M in (1, 8, 64):
            x = torch.randn(M, s.hidden_size)
            with torch.inference_mode():
                row(
                    "FusedMoE.forward (EP, gloo, 1 rank)",
                    "torch",
                    M,
                    host_us(lambda x=x: layer(x), cpu, calls=calls),
                    None,
                    f"CPU, {shape}",
                )
                row(
                    "FusedMoE.forward (no EP, same shape)",
                    "torch",
                    M,
                    host_us(lambda x=x: local(x), cpu, calls=calls),
                    None,
                    "CPU",
                )
    finally:
        if owned:
            dist.destroy_process_group()


def table_rows(rows: list[dict]) -> list[list[object]]:
    return [[r["path"], r["backend"], r["M"], r["host_us"], r["device_us"], r["note"]] for r in rows]


def main(args) -> int:
    on_gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if on_gpu else "cpu")
    tokens = args.tokens or [1, 8, 64]
    if on_gpu:
        backends = tuple((args.backends or "triton").split(","))
        rows = measure(device, preset=args.preset or "qwen3-30b-a3b", tokens=tokens, backends=backends)
        title = f"host time per call ({args.preset or 'qwen3-30b-a3b'}, bf16, {torch.cuda.get_device_name()})"
    else:
        rows = measure(device, preset=CPU_SHAPE, tokens=tokens, dtype=torch.float32, backends=("torch",))
        title = "host time per call (CPU: torch experts, small shape, float32)"
    report.print_table(title, COLUMNS, table_rows(rows))
    if args.json:
        report.save_json(args.json, {"env": report.environment(), "host": rows})
        print(f"wrote {args.json}")
    return 0
