"""Routing, alignment and the top-k reduce as registered torch ops (``torch.ops.fusedmoe.*``): same results as the
functions, valid schemas and fake implementations (opcheck), and composable under torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch

from fusedmoe import route
from fusedmoe.op import moe_align_op, moe_reduce_op, route_op
from fusedmoe.ops.align import align_reference, local_expert_reference

OPCHECK_TESTS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def _logits(M=6, E=8, seed=0):
    return torch.randn(M, E, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(
            scoring="sigmoid",
            num_expert_groups=4,
            topk_groups=2,
            routed_scaling_factor=2.5,
            correction_bias=torch.linspace(0, 1, 8),
        ),
        dict(scoring="softmax_topk"),
    ],
    ids=["softmax", "grouped", "softmax_topk"],
)
def test_route_op(kw):
    x = _logits()
    w, ids = route_op(x, 3, **kw)
    w2, ids2 = route(x, 3, **kw)
    assert torch.equal(w, w2) and torch.equal(ids, ids2)
    args = (
        x,
        3,
        kw.get("scoring", "softmax"),
        True,
        kw.get("num_expert_groups", -1),
        kw.get("topk_groups", -1),
        kw.get("correction_bias"),
        float(kw.get("routed_scaling_factor", 1.0)),
    )
    torch.library.opcheck(torch.ops.fusedmoe.route.default, args, test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("emap", [False, True])
def test_align_op(emap):
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(9)]).int()
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3, -1, -1], dtype=torch.int32) if emap else None
    E = 4 if emap else 8
    s, b, n = moe_align_op(ids, E, 4, expert_map=expert_map)
    rs, rb, rn = align_reference(ids, E, 4, expert_map=expert_map)
    assert int(n) == int(rn) and torch.equal(b, rb) and torch.equal(s[: int(n)], rs[: int(n)])
    assert (s[int(n) :] == ids.numel()).all()  # the tail holds the sentinel: every element is determined
    torch.library.opcheck(torch.ops.fusedmoe.moe_align.default, (ids, E, 4, expert_map, -1), test_utils=OPCHECK_TESTS)


def test_reduce_op():
    g = torch.Generator().manual_seed(2)
    M, k, H, E = 5, 3, 16, 4
    ids = torch.tensor([[0, 1, 9], [2, 3, 0], [1, -1, 2], [3, 0, 1], [2, 1, 3]], dtype=torch.int32)
    y = torch.randn(M * k, H, generator=g)
    local = local_expert_reference(ids, E) >= 0
    y[~local.reshape(-1)] = float("nan")  # rows of non-local slots are never read
    out = moe_reduce_op(y, ids, E, out_dtype=torch.float16)
    ref = torch.where(local[..., None], y.view(M, k, H), 0.0).sum(1)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    torch.library.opcheck(
        torch.ops.fusedmoe.moe_reduce.default, (y, ids, E, torch.float32, None, -1), test_utils=OPCHECK_TESTS
    )


def test_compose_under_compile():
    """route -> align -> reduce, compiled with fullgraph=True: no graph break, same results as eager."""

    def fn(logits, y):
        w, ids = route_op(logits, 2)
        sorted_ids, block_expert, num_padded = moe_align_op(ids, 8, 16)
        return moe_reduce_op(y * 1.0, ids, 8), num_padded, w

    logits = _logits(M=7)
    y = torch.randn(14, 32)
    eager = fn(logits, y)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(logits, y)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)
