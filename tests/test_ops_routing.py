"""The one-launch Triton routing kernel against the torch definition of route() (on the CPU): route() on CUDA
takes the kernel, on the CPU the interpreter runs it directly."""

import pytest
import torch
from devices import TRITON_DEVICES, interpreter

from fusedmoe.ops.routing import kernel_supports, route_fused
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
    ids, w = ids.cpu(), w.cpu()
    same = (ids.sort(dim=1).values == ids_ref.sort(dim=1).values).all(dim=1)
    assert same.float().mean() > 0.999  # every row at M < 1000
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
def test_kernel_zero_rows(device):
    w, ids = route_fused(
        torch.randn(0, 16, device=device),
        2,
        scoring="softmax",
        renormalize=True,
        num_expert_groups=None,
        topk_groups=None,
        correction_bias=None,
        routed_scaling_factor=1.0,
    )
    assert w.shape == (0, 2) and ids.shape == (0, 2)
