"""Alignment op: invariants and exact agreement with the torch reference (CPU interpreter; model-sized batches on
CUDA)."""

import pytest
import torch

import fusedmoe.ops.align as A
from fusedmoe.ops.align import align_launches, align_params, align_reference, local_expert_reference, moe_align

POISON = 0x7F7F7F7F


@pytest.fixture
def small_chunks(monkeypatch):
    """Shrink the regime thresholds and sub-chunks so every path (and its loops) runs on few slots."""
    for name, value in dict(
        PAIRS_MAX_SLOTS=32, SINGLE_MAX_SLOTS=160, MIN_SUB=16, MAX_SUB=32, TARGET_PROGRAMS=4, MAX_PROGRAMS=4
    ).items():
        monkeypatch.setattr(A, name, value)
    align_params.cache_clear()
    yield
    align_params.cache_clear()


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


def _check(ids, E, bm, emap=None, gE=None, poison=True):
    n = ids.numel()
    p = align_params(n, E, bm)
    bufs = {}
    if poison:
        bufs = dict(
            sorted_ids=torch.full((p.max_padded,), POISON, dtype=torch.int32),
            block_expert=torch.full((p.max_blocks,), POISON, dtype=torch.int32),
            num_padded=torch.full((1,), POISON, dtype=torch.int32),
            partial=torch.full(p.partial_shape, POISON, dtype=torch.int32),
        )
    sorted_ids, block_expert, num_padded = moe_align(ids, E, bm, expert_map=emap, global_num_experts=gE, **bufs)
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
    return p


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


def test_align_params_regimes():
    assert align_params(8, 128, 16).mode == "pairs" and align_launches(8, 128, 16) == 1
    assert align_params(A.PAIRS_MAX_SLOTS, 128, 16).mode == "pairs"
    p = align_params(A.PAIRS_MAX_SLOTS + 1, 128, 16)
    assert p.mode == "single" and p.fused and p.partial_shape == (0, 128)
    assert align_params(A.SINGLE_MAX_SLOTS, 128, 16).mode == "single"
    p = align_params(A.SINGLE_MAX_SLOTS + 1, 128, 16)
    assert (
        p.mode == "two"
        and not p.fused
        and p.partial_shape == (p.n_prog, 128)
        and align_launches(A.SINGLE_MAX_SLOTS + 1, 128, 16) == 2
    )
    for n in (129, 512, 2048, 8192, 16384, 131072):
        p = align_params(n, 256, 64)
        assert p.n_prog <= A.MAX_PROGRAMS and p.n_prog * p.span >= n > (p.n_prog - 1) * p.span
        assert p.span % p.sub == 0 and p.sub <= A.MAX_SUB


@pytest.mark.parametrize(
    "M,k,E,bm,kind",
    [
        (1, 8, 128, 16, "random"),  # decode
        (8, 8, 128, 64, "random"),  # 64 slots: largest "pairs"
        (1, 1, 1, 1, "random"),  # E=1, BLOCK_M=1
        (3, 4, 1, 16, "random"),  # E=1
        (2, 8, 8, 16, "random"),  # top_k = E
        (5, 8, 1024, 16, "random"),  # E=1024
        (8, 8, 1024, 128, "invalid"),
        (8, 8, 4, 128, "one"),
        (0, 8, 16, 16, "random"),
    ],
)
def test_align_default_pairs(M, k, E, bm, kind):
    p = _check(_ids(kind, M, k, E), E, bm)
    assert p.mode == "pairs"


@pytest.mark.parametrize(
    "M,k,E,bm,kind,mode",
    [
        (9, 8, 128, 16, "random", "single"),  # 72 slots: just past "pairs"
        (16, 8, 128, 16, "random", "single"),  # 128 slots
        (64, 8, 128, 16, "random", "single"),  # 512 slots
        (70, 8, 16, 16, "random", "single"),
        (130, 8, 128, 64, "few", "single"),
        (512, 8, 128, 16, "random", "single"),  # 4096 slots: largest "single"
        (513, 8, 128, 16, "random", "two"),  # just past "single"
        (600, 8, 256, 64, "invalid", "two"),
    ],
)
def test_align_default_regimes(M, k, E, bm, kind, mode):
    p = _check(_ids(kind, M, k, E), E, bm)
    assert p.mode == mode


@pytest.mark.parametrize(
    "M,k,E,bm,kind",
    [
        (8, 4, 8, 16, "random"),  # 32 slots: last "pairs"
        (11, 3, 8, 16, "random"),  # 33: first "single"
        (40, 4, 16, 16, "random"),  # 160: last "single"
        (23, 7, 16, 16, "invalid"),  # 161: first "two"
        (100, 8, 64, 16, "random"),  # "two", 4 programs x 7 sub-chunks
        (100, 8, 64, 1, "random"),
        (60, 4, 4, 64, "one"),
        (77, 3, 16, 32, "few"),
        (50, 6, 1024, 16, "random"),  # E=1024, more experts than slots
        (37, 5, 1024, 64, "invalid"),
        (30, 8, 256, 16, "random"),
        (90, 2, 1, 16, "random"),  # E=1
        (20, 4, 4, 8, "random"),  # top_k = E
        (150, 2, 2, 128, "random"),
    ],
)
def test_align_small_chunks(small_chunks, M, k, E, bm, kind):
    _check(_ids(kind, M, k, E), E, bm)


@pytest.mark.parametrize("M,k", [(9, 3), (30, 4), (61, 4)])
def test_align_small_chunks_expert_map(small_chunks, M, k):
    gE, E = 8, 4
    emap = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)
    _check(_ids("invalid", M, k, gE), E, 16, emap=emap, gE=gE)
    _check(_ids("random", M, k, gE), E, 16, emap=emap, gE=gE)
    _check(_ids("invalid", M, k, gE), E, 16, gE=gE)
    emap = torch.full((gE,), -1, dtype=torch.int32)  # nothing local
    _check(_ids("random", M, k, gE), E, 16, emap=emap, gE=gE)


def test_align_every_boundary(small_chunks):
    g = torch.Generator().manual_seed(0)
    for n in range(1, 200, 7):
        ids = torch.randint(-1, 17, (n, 1), generator=g, dtype=torch.int32)
        _check(ids, 16, 16)


def test_align_deterministic_across_regimes(monkeypatch):
    ids = _ids("random", 48, 8, 32)
    out = []
    for pairs, single in ((1024, 1024), (0, 1024), (0, 0)):
        monkeypatch.setattr(A, "PAIRS_MAX_SLOTS", pairs)
        monkeypatch.setattr(A, "SINGLE_MAX_SLOTS", single)
        align_params.cache_clear()
        out.append((_check(ids, 32, 16).mode, moe_align(ids, 32, 16)))
    align_params.cache_clear()
    assert [m for m, _ in out] == ["pairs", "single", "two"]
    (_, (s0, b0, n0)), *rest = out
    for _, (s, b, n) in rest:
        assert int(n) == int(n0) and torch.equal(b, b0) and torch.equal(s[: int(n)], s0[: int(n0)])


@pytest.mark.gpu
@pytest.mark.parametrize("M,E,k", [(1, 128, 8), (1024, 128, 8), (4096, 256, 8), (3000, 1024, 4)])
def test_align_large_on_cuda(M, E, k):
    """Model-sized batches on the GPU: the same order as the torch reference, and as many blocks as planned."""
    ids = torch.rand(M, E, device="cuda").argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    s, b, n = moe_align(ids, E, 64)
    rs, rb, rn = align_reference(ids.cpu(), E, 64)
    assert int(n) == int(rn) and torch.equal(b.cpu(), rb) and torch.equal(s[: int(n)].cpu(), rs[: int(n)])
    assert align_params(M * k, E, 64).max_blocks == b.numel()
