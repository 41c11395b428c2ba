"""Alignment op (CPU interpreter): invariants and exact agreement with the torch reference."""

import pytest
import torch

from fusedmoe.ops.align import align_params, align_reference, local_expert_reference, moe_align


def _ids(kind, M, k, gE):
    if M == 0:
        return torch.empty(0, k, dtype=torch.int32)
    if kind == "random":
        return torch.stack([torch.randperm(gE)[:k] for _ in range(M)]).int()
    if kind == "one":
        return torch.full((M, k), gE - 1, dtype=torch.int32)
    if kind == "few":  # experts without tokens
        return torch.randint(0, 2, (M, k), dtype=torch.int32)
    if kind == "invalid":  # out-of-range ids on both sides
        return torch.randint(-4, gE + 4, (M, k), dtype=torch.int32)
    raise ValueError(kind)


def _check(ids, E, bm, emap=None, gE=None):
    sorted_ids, block_expert, num_padded = moe_align(ids, E, bm, expert_map=emap, global_num_experts=gE)
    n = ids.numel()
    p = align_params(n, E, bm)
    npad = int(num_padded)
    assert npad % bm == 0 and npad <= p.max_padded
    live = sorted_ids[:npad]
    # every local slot exactly once, nothing else
    loc = local_expert_reference(ids.reshape(-1), E, emap, gE)
    real = live[live != n]
    assert torch.equal(real.sort().values.long(), torch.nonzero(loc >= 0).flatten())
    assert ((live >= 0) & (live <= n)).all()
    # one expert per block, matching the slots' local expert; -1 from num_padded on
    assert block_expert.numel() == p.max_blocks
    assert (block_expert[npad // bm :] == -1).all()
    for b in range(npad // bm):
        e = int(block_expert[b])
        assert 0 <= e < E
        rows = live[b * bm : (b + 1) * bm]
        rows = rows[rows != n].long()
        assert (loc[rows] == e).all()
    # deterministic: equal to the reference order
    rs, rb, rn = align_reference(ids, E, bm, expert_map=emap, global_num_experts=gE)
    assert int(rn) == npad and torch.equal(block_expert, rb) and torch.equal(live, rs[:npad])


@pytest.mark.parametrize(
    "M,k,E,bm,kind",
    [
        (7, 3, 8, 16, "random"),
        (1, 1, 1, 16, "random"),  # E=1
        (1, 4, 4, 16, "random"),  # top_k = E
        (20, 4, 4, 32, "one"),  # all tokens on one expert
        (20, 2, 16, 16, "few"),  # experts without tokens
        (130, 8, 64, 16, "random"),  # multi-program path (> FUSED_MAX_SLOTS)
        (300, 4, 8, 64, "few"),
        (40, 2, 256, 16, "random"),  # wide E
    ],
)
def test_align_invariants(M, k, E, bm, kind):
    _check(_ids(kind, M, k, E), E, bm)


def test_align_empty():
    ids = torch.empty(0, 2, dtype=torch.int32)
    sorted_ids, block_expert, num_padded = moe_align(ids, 4, 16)
    assert int(num_padded) == 0 and (block_expert == -1).all()


@pytest.mark.parametrize("M,k", [(9, 3), (200, 4)])
def test_align_expert_map_and_invalid_ids(M, k):
    gE, E = 8, 4
    emap = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)
    _check(_ids("invalid", M, k, gE), E, 16, emap=emap, gE=gE)
    _check(_ids("random", M, k, gE), E, 16, emap=emap, gE=gE)
    # without a map, ids in [E, global_E) are non-local too
    _check(_ids("invalid", M, k, gE), E, 16, gE=gE)


def test_align_int64_ids_and_prefilled_garbage():
    ids = _ids("random", 30, 3, 8).long()
    p = align_params(ids.numel(), 8, 16)
    poison = dict(
        sorted_ids=torch.full((p.max_padded,), 0x7F7F7F7F, dtype=torch.int32),
        block_expert=torch.full((p.max_blocks,), 0x7F7F7F7F, dtype=torch.int32),
        num_padded=torch.full((1,), 0x7F7F7F7F, dtype=torch.int32),
    )
    s, b, n = moe_align(ids, 8, 16, **poison)
    rs, rb, rn = align_reference(ids, 8, 16)
    assert int(n) == int(rn) and torch.equal(b, rb) and torch.equal(s[: int(n)], rs[: int(n)])
