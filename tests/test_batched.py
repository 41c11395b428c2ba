"""Batched layout on one rank with the torch batched experts: vs the float64 reference, poison equality (NaN in
every workspace byte, padded rows included, gives bit-identical output) on the CPU and on CUDA, capacity caps,
edge cases."""

import pytest
import torch
from devices import tolerance

from fusedmoe.experts.base import ExpertsInputs
from fusedmoe.experts.batched_torch_experts import BatchedTorchExperts
from fusedmoe.kernel import MoEKernel
from fusedmoe.layer import FusedMoE
from fusedmoe.prepare_finalize.batched import BatchedCapacityError, BatchedPrepareFinalize
from fusedmoe.problem import Layout, MoEProblem
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.steps import Call
from fusedmoe.workspace.manager import WorkspaceManager


def _case(M, H, I, E, k, *, gE=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    gE = gE or E
    x = torch.randn(M, H, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    ids = (
        torch.stack([torch.randperm(gE, generator=g)[:k] for _ in range(M)]).int()
        if M
        else torch.empty(0, k, dtype=torch.int32)
    )
    tw = torch.rand(M, k, generator=g) + 0.1
    return x, w1, w2, tw, ids


def _run(x, w1, w2, tw, ids, *, activation="silu", on_input=False, emap=None, cap=None, poison=False, check=None):
    M, H = x.shape
    E, two_i, _ = w1.shape
    gE = emap.numel() if emap is not None else E
    p = MoEProblem(M, H, two_i // 2, E, gE, ids.shape[1], x.dtype, w1.dtype, activation, on_input, emap is not None)
    pf = BatchedPrepareFinalize(cap, check_capacity=check)
    kernel = MoEKernel(pf, BatchedTorchExperts())
    assert kernel.plan(p).zero_nbytes == 0
    mgr = WorkspaceManager(x.device, poison=poison)
    out = kernel(ExpertsInputs(x, w1, w2, tw, ids, expert_map=emap), p, manager=mgr)
    assert mgr.stats.bytes_zeroed == 0
    return out, pf


def _ref(x, w1, w2, tw, ids, **kw):
    return fused_moe_reference(x, w1, w2, tw, ids, **kw)


CASES = [
    (13, 40, 24, 4, 2, "silu", False),
    (9, 32, 16, 8, 3, "gelu", False),
    (7, 40, 24, 4, 1, "silu", True),  # router weight on the input
    (1, 32, 32, 4, 4, "silu", False),  # M=1, top_k=E
    (6, 32, 16, 1, 1, "gelu", False),  # one expert
    (5, 16, 16, 8, 1, "silu", False),  # experts with no tokens
]
#: (device, dtype, case): the small cases in float32 on the CPU, a model-sized one in bf16 on CUDA
DEVICE_CASES = [
    pytest.param("cpu", torch.float32, c, id=f"cpu-M{c[0]}-{c[5]}-{'in' if c[6] else 'out'}") for c in CASES
]
DEVICE_CASES.append(
    pytest.param(
        "cuda", torch.bfloat16, (64, 1024, 512, 16, 4, "silu", False), marks=pytest.mark.gpu, id="cuda-bf16-M64"
    )
)


@pytest.mark.parametrize("device,dtype,case", DEVICE_CASES)
def test_batched_torch_vs_reference_and_poison(device, dtype, case):
    M, H, I, E, k, activation, on_input = case
    x, w1, w2, tw, ids = (t.to(device) for t in _case(M, H, I, E, k, seed=M))
    x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
    out, _ = _run(x, w1, w2, tw, ids, activation=activation, on_input=on_input)
    assert out.dtype == dtype and out.device.type == device
    ref = _ref(x, w1, w2, tw, ids, activation=activation, apply_router_weight_on_input=on_input)
    assert relative_error(out, ref) < tolerance(dtype)
    poisoned, _ = _run(x, w1, w2, tw, ids, activation=activation, on_input=on_input, poison=True)
    assert torch.equal(out, poisoned)


def test_all_tokens_on_one_expert():
    x, w1, w2, tw, ids = _case(11, 32, 16, 4, 2, seed=3)
    ids[:, 0], ids[:, 1] = 2, 0  # every token on experts 2 and 0; experts 1 and 3 get none
    out, _ = _run(x, w1, w2, tw, ids, poison=True)
    assert relative_error(out, _ref(x, w1, w2, tw, ids)) < 1e-5


def test_expert_map_with_non_local_experts():
    E, gE = 4, 8
    x, w1, w2, tw, ids = _case(10, 32, 16, E, 3, gE=gE, seed=5)
    emap = torch.full((gE,), -1, dtype=torch.int32)
    emap[torch.tensor([6, 1, 3, 4])] = torch.arange(E, dtype=torch.int32)
    ids[0, 0] = -1  # out of range ids contribute nothing
    ids[1, 1] = gE + 3
    out, _ = _run(x, w1, w2, tw, ids, emap=emap, poison=True)
    ref = _ref(x, w1, w2, tw, ids, expert_map=emap, global_num_experts=gE)
    assert relative_error(out, ref) < 1e-5
    # a token whose experts are all elsewhere gets an exact zero row (written, not pre-filled)
    ids2 = ids.clone()
    ids2[2] = torch.tensor([0, 2, 5], dtype=torch.int32)
    out2, _ = _run(x, w1, w2, tw, ids2, emap=emap, poison=True)
    assert torch.equal(out2[2], torch.zeros(32))


def test_counts_and_padded_rows_untouched():
    M, H, I, E, k = 9, 16, 16, 4, 2
    x, w1, w2, tw, ids = _case(M, H, I, E, k, seed=7)
    p = MoEProblem(M, H, I, E, E, k, x.dtype, w1.dtype)
    pf = BatchedPrepareFinalize()
    kernel = MoEKernel(pf, BatchedTorchExperts())
    ws = WorkspaceManager("cpu", poison=True).acquire(kernel.plan(p))
    c = Call(p, None, ExpertsInputs(x, w1, w2, tw, ids), torch.empty(M, H), pf)
    kernel.program(p)[0].run(0, c, ws.views)  # prepare's steps alone
    prepared = c.prepared
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E).int()
    assert torch.equal(prepared.expert_num_tokens, counts)
    a = prepared.hidden_states
    T = pf.tokens_per_expert(M)
    assert a.shape == (E, T, H)
    for e in range(E):
        c = int(counts[e])
        tok = torch.nonzero((ids == e).any(dim=1)).flatten()  # token order within an expert
        assert torch.equal(a[e, :c], x[tok])
        assert torch.isnan(a[e, c:]).all()  # padded rows were never written


def test_cap_respected_and_exceeded():
    M, H, I, E, k = 12, 16, 16, 4, 2
    x, w1, w2, tw, ids = _case(M, H, I, E, k, seed=11)
    worst = int(torch.bincount(ids.reshape(-1).long(), minlength=E).max())
    out, pf = _run(x, w1, w2, tw, ids, cap=worst, poison=True)
    assert relative_error(out, _ref(x, w1, w2, tw, ids)) < 1e-5
    assert int(pf.max_count("cpu")) == worst
    with pytest.raises(BatchedCapacityError, match=f"received {worst} tokens but max_tokens_per_expert is"):
        _run(x, w1, w2, tw, ids, cap=worst - 1)
    # without the eager check the excess is dropped and reported on the device
    out, pf = _run(x, w1, w2, tw, ids, cap=worst - 1, check=False, poison=True)
    assert torch.isfinite(out).all() and int(pf.max_count("cpu")) == worst
    with pytest.raises(ValueError, match="max_tokens_per_expert"):
        BatchedPrepareFinalize(0)


def test_empty_batch():
    x, w1, w2, tw, ids = _case(0, 16, 16, 4, 2)
    out, _ = _run(x, w1, w2, tw, ids)
    assert out.shape == (0, 16)


def test_layer_batched_layout_matches_standard():
    torch.manual_seed(0)
    std = FusedMoE(8, 2, 32, 16, backend="torch")
    bat = FusedMoE(8, 2, 32, 16, backend="torch", layout="batched", workspace=WorkspaceManager("cpu", poison=True))
    bat.load_weights(std.w1.data, std.w2.data, std.gate.data)
    assert bat.expert_map is None
    x = torch.randn(2, 5, 32)
    assert relative_error(bat(x), std(x)) < 1e-5
    assert bat.plan(10).zero_nbytes == 0
    assert any(b.name == "b_a_batched" for b in bat.plan(10).buffers)
    with pytest.raises(ValueError, match="layout"):
        FusedMoE(8, 2, 32, 16, layout="ragged")
    assert Layout.BATCHED.value == "batched"


def test_matrix_products_never_see_the_unwritten_padded_rows(monkeypatch):
    """Padded rows of the batched input are unwritten (NaN when poisoned), and a bmm need not keep a NaN row to
    its own output row (torch 2.11's CPU bf16 bmm spreads it). So every matrix the experts multiply is finite."""
    seen = []
    bmm = torch.bmm

    def checked_bmm(a, b, **kw):
        seen.append(bool(torch.isfinite(a).all()))
        return bmm(a, b, **kw)

    monkeypatch.setattr(torch, "bmm", checked_bmm)
    x, w1, w2, tw, ids = _case(5, 16, 16, 8, 1)  # 5 tokens over 8 experts: most rows are padding
    out, _ = _run(x, w1, w2, tw, ids, poison=True)
    assert seen and all(seen), seen
    assert relative_error(out, _ref(x, w1, w2, tw, ids)) < 1e-5
