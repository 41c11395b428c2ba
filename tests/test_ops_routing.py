"""The one-launch Triton routing kernel against the torch route() it replaces on CUDA (interpreter on CPU)."""

import os

import pytest
import torch

from fusedmoe.ops.routing import kernel_supports, route_fused
from fusedmoe.routing import route

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="needs Triton"
)

CASES = {
    "qwen3": dict(E=64, k=8, scoring="softmax", renormalize=True),
    "deepseek-v2-lite": dict(E=64, k=6, scoring="softmax", renormalize=False),
    "deepseek-v3": dict(E=64, k=8, scoring="sigmoid", renormalize=True, num_expert_groups=8, topk_groups=4,
                        bias=True, routed_scaling_factor=2.5),
    "deepseek-v2-groups": dict(E=64, k=6, scoring="softmax", renormalize=False, num_expert_groups=8,
                               topk_groups=3, routed_scaling_factor=16.0),
    "gpt-oss": dict(E=32, k=4, scoring="softmax_topk", renormalize=True),
    "non-pow2-E": dict(E=60, k=4, scoring="softmax", renormalize=False),
    "k-equals-E": dict(E=8, k=8, scoring="softmax", renormalize=True),
    "groups-of-one": dict(E=8, k=2, scoring="sigmoid", renormalize=True, num_expert_groups=8, topk_groups=3,
                          bias=True),
}


def _kwargs(case):
    kw = {k: v for k, v in case.items() if k not in ("E", "k", "bias")}
    kw.setdefault("num_expert_groups", None)
    kw.setdefault("topk_groups", None)
    kw.setdefault("routed_scaling_factor", 1.0)
    return kw


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("M", [1, 37])
def test_kernel_matches_torch_route(name, M, device):
    """Same ids (random logits have no ties) and weights within float32 rounding, for every scoring mode."""
    case = CASES[name]
    E, k = case["E"], case["k"]
    logits = torch.randn(M, E, device=device) * 3
    bias = torch.randn(E, device=device) * 0.5 if case.get("bias") else None
    kw = _kwargs(case)
    assert kernel_supports(E, k, kw["num_expert_groups"])
    w_ref, ids_ref = route(logits, k, correction_bias=bias, **kw)
    w, ids = route_fused(logits, k, correction_bias=bias, **kw)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.sort(dim=1).values, ids_ref.sort(dim=1).values)
    order, order_ref = ids.argsort(dim=1), ids_ref.argsort(dim=1)
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), rtol=1e-5, atol=1e-6)


def test_kernel_nan_logits_give_in_range_ids(device):
    """NaN or -inf rows must still produce ids inside [0, E) (downstream kernels index with them)."""
    logits = torch.full((3, 16), float("nan"), device=device)
    logits[1] = float("-inf")
    _, ids = route_fused(logits, 4, scoring="softmax", renormalize=True, num_expert_groups=None,
                         topk_groups=None, correction_bias=None, routed_scaling_factor=1.0)
    assert int(ids.min()) >= 0 and int(ids.max()) < 16


def test_kernel_zero_rows(device):
    w, ids = route_fused(torch.randn(0, 16, device=device), 2, scoring="softmax", renormalize=True,
                         num_expert_groups=None, topk_groups=None, correction_bias=None, routed_scaling_factor=1.0)
    assert w.shape == (0, 2) and ids.shape == (0, 2)
