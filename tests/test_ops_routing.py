"""The one-launch Triton routing kernel against the torch definition of route() (on the CPU): route() on CUDA
takes the kernel, on the CPU the interpreter runs it directly."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from devices import TRITON_DEVICE_DTYPES, TRITON_DEVICES, interpreter

from fusedmoe.ops.routing import kernel_supports, route_fused, router_gemm_applies
from fusedmoe.routing import ROUTING_PRESETS, route

CASES = {
    "qwen3": dict(E=64, k=8, scoring="softmax", renormalize=True),
    "deepseek-v2-lite": dict(E=64, k=6, scoring="softmax", renormalize=False),
    "deepseek-v3": dict(
        E=64,
        k=8,
        scoring="sigmoid",
        renormalize=True,
        num_expert_groups=8,
        topk_groups=4,
        bias=True,
        routed_scaling_factor=2.5,
    ),
    "deepseek-v2-groups": dict(
        E=64, k=6, scoring="softmax", renormalize=False, num_expert_groups=8, topk_groups=3, routed_scaling_factor=16.0
    ),
    "gpt-oss": dict(E=32, k=4, scoring="softmax_topk", renormalize=True),
    "non-pow2-E": dict(E=60, k=4, scoring="softmax", renormalize=False),
    "k-equals-E": dict(E=8, k=8, scoring="softmax", renormalize=True),
    "groups-of-one": dict(E=8, k=2, scoring="sigmoid", renormalize=True, num_expert_groups=8, topk_groups=3, bias=True),
}


#: every model family at its full size (E, k) with its preset (CUDA: route() falls back to torch where the kernel
#: does not apply, e.g. DeepSeek-V2's 160 experts in 8 groups)
SIZES = {
    "qwen3-moe": (128, 8),
    "mixtral": (8, 2),
    "deepseek-v2-lite": (64, 6),
    "deepseek-v3": (256, 8),
    "deepseek-v2": (160, 6),
    "gpt-oss": (32, 4),
}
FAMILIES = {
    f"{name}-full": dict(E=E, k=k, bias=name == "deepseek-v3", **ROUTING_PRESETS[name])
    for name, (E, k) in SIZES.items()
}


def _kwargs(case):
    kw = {k: v for k, v in case.items() if k not in ("E", "k", "bias")}
    kw.setdefault("num_expert_groups", None)
    kw.setdefault("topk_groups", None)
    kw.setdefault("routed_scaling_factor", 1.0)
    return kw


ROUTE_CASES = [
    pytest.param("cpu", name, M, marks=interpreter, id=f"cpu-{name}-M{M}") for name in sorted(CASES) for M in (1, 37)
]
ROUTE_CASES += [
    pytest.param("cuda", name, M, marks=pytest.mark.gpu, id=f"cuda-{name}-M{M}")
    for name in sorted(CASES) + sorted(FAMILIES)
    for M in (1, 77, 4096)
]


@pytest.mark.parametrize("device,name,M", ROUTE_CASES)
def test_kernel_matches_torch_route(device, name, M):
    """Same ids and weights within float32 rounding as the torch definition on the CPU, for every scoring mode and
    every family's size. Random logits have no ties, but float32 near-ties may flip one choice in a rare row of
    a large batch."""
    case = {**CASES, **FAMILIES}[name]
    E, k = case["E"], case["k"]
    logits = torch.randn(M, E, device=device) * 3
    bias = torch.randn(E, device=device) * 0.5 if case.get("bias") else None
    kw = _kwargs(case)
    if device == "cpu":  # route() on the CPU is the torch definition: run the kernel itself
        assert kernel_supports(E, k, kw["num_expert_groups"])
        w, ids = route_fused(logits, k, correction_bias=bias, **kw)
    else:
        w, ids = route(logits, k, correction_bias=bias, **kw)
    w_ref, ids_ref = route(logits.cpu(), k, correction_bias=None if bias is None else bias.cpu(), **kw)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.device == w.device == logits.device
    _assert_routes_alike(w.cpu(), ids.cpu(), w_ref, ids_ref, rows=0.999)  # every row at M < 1000


def _assert_routes_alike(w, ids, w_ref, ids_ref, rows: float):
    """More than ``rows`` of the rows (all of them for 1.0) pick the same experts, in any order, and those rows'
    weights match within float32 rounding."""
    same = (ids.sort(dim=1).values == ids_ref.sort(dim=1).values).all(dim=1)
    assert same.all() if rows == 1.0 else same.float().mean() > rows
    order, order_ref = ids[same].argsort(dim=1), ids_ref[same].argsort(dim=1)
    torch.testing.assert_close(w[same].gather(1, order), w_ref[same].gather(1, order_ref), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_kernel_nan_logits_give_in_range_ids(device):
    """NaN or -inf rows must still produce ids inside [0, E) (downstream kernels index with them)."""
    logits = torch.full((3, 16), float("nan"), device=device)
    logits[1] = float("-inf")
    _, ids = route_fused(
        logits,
        4,
        scoring="softmax",
        renormalize=True,
        num_expert_groups=None,
        topk_groups=None,
        correction_bias=None,
        routed_scaling_factor=1.0,
    )
    assert int(ids.min()) >= 0 and int(ids.max()) < 16


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("from_gate", [False, True], ids=["logits", "router-gemm"])
def test_kernel_zero_rows(device, from_gate):
    if from_gate:  # the hidden rows and the router's weight instead of logits
        hidden, gate = torch.randn(0, 32, device=device), torch.randn(16, 32, device=device)
        given = dict(router_logits=None, hidden=hidden, gate=gate)
    else:
        given = dict(router_logits=torch.randn(0, 16, device=device))
    w, ids = route_fused(
        top_k=2,
        scoring="softmax",
        renormalize=True,
        num_expert_groups=None,
        topk_groups=None,
        correction_bias=None,
        routed_scaling_factor=1.0,
        **given,
    )
    assert w.shape == (0, 2) and ids.shape == (0, 2)


#: case -> H: H off BLOCK_H multiples, E padded to 16 columns, non-pow2 E, groups, gpt-oss' router bias
GEMM_CASES = {"qwen3": 200, "k-equals-E": 48, "non-pow2-E": 64, "deepseek-v3": 96, "gpt-oss": 130}


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize("name", sorted(GEMM_CASES))
@pytest.mark.parametrize("M", [1, 17])
def test_kernel_router_gemm_matches_linear_then_route(device, dtype, name, M, router_gemm_to_64):
    """Given the hidden rows and the router's weight (and bias) instead of logits, the launch routes as route() does
    on ``F.linear``'s logits: same ids, weights within float32 rounding. bf16 logits round to few values, so an
    equal pair may tie differently in a rare row."""
    case, H = CASES[name], GEMM_CASES[name]
    E, k, kw = case["E"], case["k"], _kwargs(case)
    assert router_gemm_applies(M, E, H, kw["num_expert_groups"], dtype)
    x = torch.randn(M, H, device=device).to(dtype)
    gate = (torch.randn(E, H, device=device) * 3 / H**0.5).to(dtype)
    gate_bias = torch.randn(E, device=device).to(dtype) if name == "gpt-oss" else None
    bias = torch.randn(E, device=device) * 0.5 if case.get("bias") else None
    w, ids = route_fused(None, k, correction_bias=bias, hidden=x, gate=gate, gate_bias=gate_bias, **kw)
    w_ref, ids_ref = route(F.linear(x, gate, gate_bias), k, correction_bias=bias, **kw)
    _assert_routes_alike(w, ids, w_ref, ids_ref, rows=1.0 if dtype == torch.float32 else 0.9)


def test_router_gemm_applies_to_decode_sizes_and_small_gates_only(router_gemm_to_64):
    assert router_gemm_applies(1, 128, 2048, None, torch.bfloat16)  # qwen3-30b-a3b
    assert router_gemm_applies(64, 256, 1024, 8, torch.bfloat16)
    assert not router_gemm_applies(65, 128, 2048, None, torch.bfloat16)
    assert not router_gemm_applies(1, 256, 7168, 8, torch.bfloat16)  # DeepSeek-V3's gate: one program reads 3.7 MB
    assert not router_gemm_applies(1, 128, 2048, None, torch.float32)  # the same gate in float32: 1 MiB
    assert not router_gemm_applies(1, 512, 64, None, torch.bfloat16)  # the 16-row tile's logits outgrow registers
    assert not router_gemm_applies(1, 8, 64, 4, torch.bfloat16)  # padding 8 experts to 16 would move the groups
    assert router_gemm_applies(1, 8, 64, None, torch.float32)
    assert not router_gemm_applies(1, 128, 64, None, torch.float64)


def test_router_gemm_takes_decode_sizes_by_default_and_the_environment_turns_it_off():
    """The default (measured: ROUTER_GEMM_MAX_M's comment) takes qwen3-30b-a3b's gate from 1 to 256 rows, not 257;
    ``FUSEDMOE_ROUTER_GEMM_MAX_M=0``, read at import, turns the fused router GEMM off; a value that is not a number
    is refused at import, naming the variable."""
    code = (
        "import torch; from fusedmoe.ops.routing import router_gemm_applies as a; "
        "print(*(a(m, 128, 2048, None, torch.bfloat16) for m in (1, 256, 257)))"
    )
    env = {k: v for k, v in os.environ.items() if k != "FUSEDMOE_ROUTER_GEMM_MAX_M"}
    for setting, want in ((None, "True True False"), ("0", "False False False")):
        run_env = env if setting is None else {**env, "FUSEDMOE_ROUTER_GEMM_MAX_M": setting}
        got = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True)
        assert got.stdout.split() == want.split()
    bad = subprocess.run(
        [sys.executable, "-c", code], env={**env, "FUSEDMOE_ROUTER_GEMM_MAX_M": "all"}, capture_output=True, text=True
    )
    assert bad.returncode != 0 and "ValueError: FUSEDMOE_ROUTER_GEMM_MAX_M must be a whole number" in bad.stderr
