"""route() with NaN and ±Inf router logits (CUDA-graph padding rows carry them in real serving).

Contract, in every routing mode and on both paths (torch ops, the Triton routing kernel): ids are distinct and in
[0, E); weights are finite; +inf behaves as the largest finite float32; NaN is never chosen over a real logit;
a row without any logit above -inf gets ids 0..k-1 with weight 0.
"""

from __future__ import annotations

import pytest
import torch
from devices import TRITON_DEVICES

from fusedmoe import route

FMAX = torch.finfo(torch.float32).max
E, K = 16, 4

MODES = {
    "softmax": dict(scoring="softmax"),
    "softmax-norenorm": dict(scoring="softmax", renormalize=False, routed_scaling_factor=2.0),
    "sigmoid": dict(scoring="sigmoid"),
    "sigmoid-bias-groups": dict(
        scoring="sigmoid", num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5, correction_bias=True
    ),
    "softmax-groups": dict(scoring="softmax", renormalize=False, num_expert_groups=4, topk_groups=2),
    "softmax-bias": dict(scoring="softmax", correction_bias=True),
    "softmax_topk": dict(scoring="softmax_topk"),
}


def _logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, E, generator=g)
    x[0] = float("nan")  # all NaN
    x[1, 3] = float("nan")  # one NaN among finite logits
    x[2, 5] = float("inf")  # one +inf
    x[3, [2, 9]] = float("inf")  # two +inf
    x[4] = float("-inf")  # nothing to choose
    x[5, : E - 2] = float("nan")  # fewer real candidates than k: fillers behind them
    x[6, 1] = float("-inf")
    x[7, [0, 7]] = float("nan")
    x[7, 11] = float("inf")
    return x


def _kw(mode: str) -> dict:
    kw = dict(MODES[mode])
    if kw.pop("correction_bias", False):
        kw["correction_bias"] = torch.linspace(-0.1, 0.1, E)
    return kw


def _check(w: torch.Tensor, ids: torch.Tensor, x: torch.Tensor, mode: str) -> None:
    assert torch.isfinite(w).all(), mode
    assert ((ids >= 0) & (ids < E)).all(), mode
    assert all(len(set(r.tolist())) == K for r in ids), f"{mode}: duplicate ids"
    dead = ~(torch.nan_to_num(x, nan=float("-inf")) > float("-inf")).any(dim=1)
    for r in torch.nonzero(dead).flatten().tolist():
        assert ids[r].tolist() == list(range(K)) and (w[r] == 0).all(), f"{mode}: row {r}"
    # NaN is never chosen with a positive weight, and real candidates come first
    nan = torch.isnan(x)
    for r in range(x.shape[0]):
        for j in range(K):
            if nan[r, ids[r, j]]:
                assert w[r, j] == 0, f"{mode}: NaN expert weighted in row {r}"
    # +inf behaves as the largest finite value: same result as with FMAX written in
    w2, ids2 = route(torch.nan_to_num(x, nan=float("-inf"), posinf=FMAX, neginf=float("-inf")), K, **_kw(mode))
    for r in torch.nonzero(~dead).flatten().tolist():  # same weighted choices (tied picks may come in any order)
        a = sorted(zip(ids[r].tolist(), w[r].tolist()))
        b = sorted(zip(ids2[r].tolist(), w2[r].tolist()))
        assert [i for i, v in a if v > 0] == [i for i, v in b if v > 0], (mode, r)
        torch.testing.assert_close(torch.tensor([v for _, v in a if v > 0]), torch.tensor([v for _, v in b if v > 0]))


@pytest.mark.parametrize("mode", list(MODES))
def test_torch_path(mode):
    x = _logits()
    w, ids = route(x, K, **_kw(mode))
    _check(w, ids, x, mode)


@pytest.mark.parametrize("mode", list(MODES))
def test_low_precision_logits(mode):
    """bf16 / fp16 logits with ±inf and NaN: same contract."""
    for dt in (torch.bfloat16, torch.float16):
        x = _logits().to(dt)
        w, ids = route(x, K, **_kw(mode))
        _check(w, ids, x.float(), mode)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
def test_triton_kernel(mode, device):
    """The routing kernel keeps the same contract and agrees with the torch path on every weighted choice: on CUDA
    through route(), which takes it there; on the CPU called directly under the interpreter."""
    from fusedmoe.ops.routing import kernel_supports, route_fused

    kw = _kw(mode)
    assert kernel_supports(E, K, kw.get("num_expert_groups"))
    x = _logits()
    if device == "cpu":
        full = dict(
            renormalize=True, num_expert_groups=None, topk_groups=None, correction_bias=None, routed_scaling_factor=1.0
        )
        full.update(kw)
        w, ids = route_fused(x, K, **full)
    else:
        on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        w, ids = route(x.to(device), K, **on_device)
        assert w.device.type == ids.device.type == device
        w, ids = w.cpu(), ids.cpu()
    _check(w, ids, x, mode)
    wt, idt = route(x, K, **kw)
    torch.testing.assert_close(w.sort(dim=1).values, wt.sort(dim=1).values)
    for r in range(x.shape[0]):
        assert set(ids[r][w[r] > 0].tolist()) == set(idt[r][wt[r] > 0].tolist()), (mode, r)
