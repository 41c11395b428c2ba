"""Hardening, part 3: property tests (hypothesis) against the float64 reference.

Random problems (M including 0, E, top-k, H, I, activation, router weight on the input, expert biases, an
expert_map with remote experts, ids from ``route`` or raw ids with duplicates and out-of-range values, workspace
strategy including caller-provided buffers, standard or batched layout, dtype, poison) through the kernels and
the managers that serve them; every result must match ``fused_moe_reference`` (fp32 < 1e-5, fp16/bf16 < 2e-2,
fp8 < 6e-2) and, in poison mode, be bit-identical to a clean ``alloc_zeros`` run. Managers are shared across
examples, so each arena is reused by problems of every shape.

CPU (CI): 300 examples of the torch experts and 120 of the Triton experts under the interpreter (float32, tiny
shapes). GPU (``-m gpu``): 1,000 bf16 and 1,000 fp8 examples of the Triton experts with one pinned config and
two fixed (H, I) shapes, so kernels compile once per variant (scale with FUSEDMOE_HYPOTHESIS_GPU_EXAMPLES).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusedmoe import MoEKernel, WorkspaceManager, get_kernel
from fusedmoe.checks import check_fused_moe_args
from fusedmoe.experts.base import ExpertsInputs
from fusedmoe.ops.configs import MoEConfig, pinned_config
from fusedmoe.problem import ACTIVATIONS
from fusedmoe.quant import QuantConfig, quantize_weights
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.workspace.manager import STRATEGIES

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}
FP8_TOL = 6e-2
CALLER = ("caller13", "caller13+2")
COMMON = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

_KERNELS: dict[tuple[str, str], MoEKernel] = {}
_MANAGERS: dict[tuple, WorkspaceManager] = {}


def kernel(backend: str, layout: str) -> MoEKernel:
    if layout == "standard":
        return get_kernel(backend)
    key = (backend, layout)
    if key not in _KERNELS:
        from fusedmoe.prepare_finalize.batched import BatchedPrepareFinalize

        if backend == "torch":
            from fusedmoe.experts.batched_torch_experts import BatchedTorchExperts as Ex
        else:
            from fusedmoe.experts.batched_triton_experts import BatchedTritonExperts as Ex
        _KERNELS[key] = MoEKernel(BatchedPrepareFinalize(), Ex())
    return _KERNELS[key]


def manager(device: str, strategy: str, poison: bool) -> WorkspaceManager:
    key = (device, strategy, poison)
    if key not in _MANAGERS:
        _MANAGERS[key] = WorkspaceManager(device, strategy=strategy, poison=poison)
    return _MANAGERS[key]


# ---- problems ------------------------------------------------------------------------------------------------
@st.composite
def problems(draw, backend: str, device: str = "cpu", quant_modes=(None,), shapes=None, max_m=24):
    if shapes is None:
        H = draw(st.sampled_from([8, 16, 40, 64]))
        I = draw(st.sampled_from([8, 24, 32]))
    else:
        H, I = draw(st.sampled_from(shapes))
    quant = draw(st.sampled_from(quant_modes))
    if device == "cuda":
        dtype = torch.bfloat16
    elif backend == "torch":
        dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    else:
        dtype = torch.float32
    layout = draw(st.sampled_from(["standard", "standard", "batched"])) if quant is None else "standard"
    M = draw(st.integers(0, max_m))
    E = draw(st.integers(1, 8))
    use_map = draw(st.booleans())
    global_E = E + draw(st.integers(0, 4)) if use_map else E
    k = draw(st.integers(1, min(global_E, 4 if device == "cpu" else 8)))
    raw_ids = layout == "standard" and draw(st.booleans())
    return dict(
        backend=backend,
        device=device,
        H=H,
        I=I,
        M=M,
        E=E,
        global_E=global_E,
        k=k,
        dtype=dtype,
        quant=quant,
        layout=layout,
        use_map=use_map,
        raw_ids=raw_ids,
        activation=draw(st.sampled_from(ACTIVATIONS)),
        on_input=draw(st.booleans()),
        bias=layout == "standard" and quant is None and draw(st.integers(0, 3)) == 0,
        strategy=draw(st.sampled_from(STRATEGIES + CALLER)),
        poison=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def materialize(c: dict) -> tuple[dict, dict]:
    """Tensors and options of a drawn problem (on c['device'])."""
    g = torch.Generator().manual_seed(c["seed"])
    M, H, I, E, gE, k, dt = c["M"], c["H"], c["I"], c["E"], c["global_E"], c["k"], c["dtype"]
    x = torch.randn(M, H, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    if c["raw_ids"]:  # duplicates, negatives and ids >= global_E (checks are off)
        ids = torch.randint(-2, gE + 2, (M, k), generator=g, dtype=torch.int32)
    else:
        ids = (torch.rand(M, gE, generator=g).argsort(dim=1)[:, :k] if M else torch.empty(0, k)).to(torch.int32)
    weights = torch.rand(M, k, generator=g) + 0.05
    kw: dict = {"activation": c["activation"], "apply_router_weight_on_input": c["on_input"]}
    if c["use_map"]:
        emap = torch.full((gE,), -1, dtype=torch.int32)
        emap[torch.randperm(gE, generator=g)[:E]] = torch.randperm(E, generator=g).to(torch.int32)
        kw.update(expert_map=emap, global_num_experts=gE)
    if c["bias"]:
        kw.update(w1_bias=torch.randn(E, 2 * I, generator=g) * 0.1, w2_bias=torch.randn(E, H, generator=g) * 0.1)
    if c["quant"] is not None:
        q = QuantConfig.parse(c["quant"])
        w1, w2, s1, s2 = quantize_weights(w1, w2, q)
        kw.update(quant=q, w1_scale=s1, w2_scale=s2)
        if q.static_activation_scale:
            kw.update(a1_scale=torch.tensor([4.0 / 448]), a2_scale=torch.tensor([0.5 / 448]))
    else:
        w1, w2 = w1.to(dt), w2.to(dt)
    t = {"hidden_states": x.to(dt), "w1": w1, "w2": w2, "topk_weights": weights, "topk_ids": ids}
    dev = torch.device(c["device"])
    t = {n: v.to(dev) for n, v in t.items()}
    kw = {n: (v.to(dev) if isinstance(v, torch.Tensor) else v) for n, v in kw.items()}
    if "w1_bias" in kw:
        kw["w1_bias"], kw["w2_bias"] = kw["w1_bias"].to(dt), kw["w2_bias"].to(dt)
    return t, kw


def run(c: dict, t: dict, kw: dict, strategy: str, poison: bool) -> torch.Tensor:
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
        w1_bias=None,
        w2_bias=None,
    )
    opts.update(kw)
    p = check_fused_moe_args(*t.values(), **opts)
    kern = kernel(c["backend"], c["layout"])
    reason = kern.experts.supports(kern.prepare_finalize.problem(p))
    assert reason is None, reason
    x = ExpertsInputs(
        *t.values(),
        expert_map=opts["expert_map"],
        w1_scale=opts["w1_scale"],
        w2_scale=opts["w2_scale"],
        a1_scale=opts["a1_scale"],
        a2_scale=opts["a2_scale"],
        w1_bias=opts["w1_bias"],
        w2_bias=opts["w2_bias"],
    )
    dev = t["hidden_states"].device
    if strategy in CALLER:
        plan = kern.plan(p)
        fill = 0x7F if poison else 0
        ws13 = torch.full(
            (plan.nbytes if strategy == "caller13" else plan.region_nbytes["13"],), fill, dtype=torch.uint8, device=dev
        )
        ws2 = (
            torch.full((plan.region_nbytes["2"],), fill, dtype=torch.uint8, device=dev)
            if strategy == "caller13+2"
            else None
        )
        return kern(x, p, manager=manager(c["device"], "shared", False), workspace13=ws13, workspace2=ws2)
    mgr = manager(c["device"], strategy, poison)
    calls = mgr.stats.calls
    out = kern(x, p, manager=mgr, owner=("layer", c["E"], c["H"]))
    assert mgr.stats.calls == calls + 1
    return out


def check(c: dict) -> None:
    t, kw = materialize(c)
    out = run(c, t, kw, c["strategy"], c["poison"])
    assert out.shape == (c["M"], c["H"]) and out.dtype == c["dtype"] and out.device == t["hidden_states"].device
    ref = fused_moe_reference(*t.values(), **kw)
    tol = FP8_TOL if c["quant"] is not None else TOL[c["dtype"]]
    err = relative_error(out, ref)
    assert err < tol, f"relative error {err} >= {tol} for {c}"
    if c["poison"]:
        clean = run(c, t, kw, "alloc_zeros", False)
        assert torch.equal(out.view(torch.uint8), clean.view(torch.uint8)), "poison changed the output"


# ---- CPU profile (CI) ----------------------------------------------------------------------------------------
@settings(max_examples=300, **COMMON)
@given(c=problems("torch"))
def test_torch_experts_match_reference(c):
    check(c)


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRETING, reason="the Triton interpreter profile runs on CPU")
@settings(max_examples=120, **COMMON)
@given(c=problems("triton", shapes=[(32, 16), (40, 24)], max_m=10))
def test_triton_experts_match_reference_interpreter(c):
    with pinned_config(MoEConfig.simple(16, 32, 32)):
        check(c)


# ---- GPU profile ---------------------------------------------------------------------------------------------
GPU_EXAMPLES = int(os.environ.get("FUSEDMOE_HYPOTHESIS_GPU_EXAMPLES", "1000"))
GPU_SHAPES = [(256, 128), (384, 192)]
GPU_PIN = MoEConfig.simple(16, 64, 64)
M_GPU = 1100  # up to 8,800 slots: the multi-program alignment path too


@pytest.mark.gpu
@settings(max_examples=GPU_EXAMPLES, **COMMON)
@given(c=problems("triton", device="cuda", shapes=GPU_SHAPES, max_m=M_GPU))
def test_gpu_bf16_matches_reference(c):
    with pinned_config(GPU_PIN):
        check(c)


@pytest.mark.gpu
@settings(max_examples=GPU_EXAMPLES, **COMMON)
@given(
    c=problems(
        "triton",
        device="cuda",
        shapes=GPU_SHAPES,
        max_m=M_GPU,
        quant_modes=("fp8_tensor", "fp8_tensor_static", "fp8_token", "fp8_block"),
    )
)
def test_gpu_fp8_matches_reference(c):
    with pinned_config(GPU_PIN):
        check(c)
