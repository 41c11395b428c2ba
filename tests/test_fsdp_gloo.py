"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over fusedmoe's experts, worlds 2 and 4 over gloo on the CPU.

- A tiny transformers MoE model whose experts run through fusedmoe (the experts interface and ``patch_model``),
  every decoder layer and the root sharded: one training step gives, on each rank, the loss of an unsharded model
  on transformers' own experts for that rank's batch, and the full (gathered) gradients of the average of the
  ranks' losses, with activation checkpointing and with each layer compiled too.
- FSDP2 for the dense parts and expert parallelism for the experts in one model: ``fully_shard(...,
  ignored_params=<the experts>)`` with ``FusedMoE(..., ep_group=...)``, against the same model in one process;
  and at world 4, two expert-parallel groups of two whose expert shards are replicated across the groups.

The GPU variant (world 1, NCCL, bf16) is in tests/test_gpu_fsdp.py."""

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
from gloo_world import run_ranks

from fusedmoe.reference import relative_error

pytest.importorskip("transformers")
WORLD = 2


def _full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _hf_worker(rank, world, cases):
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(__file__))
    from hf_tiny import fully_shard_through_fusedmoe, prompt, tiny_model

    results = []
    for mode, extra in cases:
        ref = tiny_model("qwen3_moe").train()
        model = copy.deepcopy(ref)
        handle = fully_shard_through_fusedmoe(model, mode, extra)
        batches = [prompt(batch=2, length=12, seed=r) for r in range(world)]
        calls = handle.stats.calls if mode == "interface" else None
        loss = model(input_ids=batches[rank], labels=batches[rank]).loss
        loss.backward()
        ran = calls is None or handle.stats.calls > calls
        ref_losses = [ref(input_ids=b, labels=b).loss for b in batches]
        (sum(ref_losses) / world).backward()  # FSDP averages the ranks' gradients
        errs = {"loss": abs(float(loss.detach()) - float(ref_losses[rank].detach()))}
        errs |= _grad_errors(model, ref)
        results.append(((mode, extra), ran, errs))
    return results


def _check_hf(out):
    for rank, res in out.items():
        for tag, ran, errs in res:
            assert ran, f"rank {rank} {tag}: fusedmoe did not compute the experts"
            worst = max(errs.items(), key=lambda kv: kv[1])
            assert worst[1] < 1e-4, f"rank {rank} {tag}: {worst[0]} differs from the unsharded model by {worst[1]}"


@pytest.mark.slow
def test_fsdp2_transformers_model():
    _check_hf(run_ranks(_hf_worker, WORLD, [("interface", ()), ("patch", ()), ("interface", ("checkpointing",))]))


@pytest.mark.slow
def test_fsdp2_transformers_model_compiled():
    _check_hf(run_ranks(_hf_worker, WORLD, [("interface", ("compile",)), ("patch", ("compile", "checkpointing"))]))


E, K, H, I = 8, 2, 32, 32


class _Block(torch.nn.Module):
    """A dense projection, then an MoE layer, then a dense head: the dense parts go to FSDP, the experts to EP."""

    def __init__(self, ep_group=None):
        from fusedmoe.layer import FusedMoE

        super().__init__()
        self.up = torch.nn.Linear(H, H)
        self.moe = FusedMoE(E, K, H, I, ep_group=ep_group, backend="torch")
        self.head = torch.nn.Linear(H, 4)

    def forward(self, x):
        return self.head(torch.relu(self.up(x)) + self.moe(x))

    def experts(self):
        return [self.moe.w1, self.moe.w2]


def _blocks(ep_group):
    """(a one-process :class:`_Block`, training; the same weights as a block whose experts are this rank's shard
    over ``ep_group``, FSDP-sharded with the experts left out)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = _Block()
    ref.moe.requires_grad_(True)
    model = _Block(ep_group=ep_group)
    model.load_state_dict({n: t for n, t in ref.state_dict().items() if not n.startswith("moe.")}, strict=False)
    model.moe.load_weights(ref.moe.w1.data, ref.moe.w2.data, ref.moe.gate.data)
    model.moe.requires_grad_(True)
    fully_shard(model, ignored_params=set(model.experts()))
    return ref, model


def _grad_errors(model, ref, experts: slice | None = None) -> dict[str, float]:
    """Relative error of each (gathered) gradient of ``model`` against ``ref``'s, the experts' against the
    ``experts`` slice of the reference's when given."""
    errs = {}
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        want = q.grad[experts] if experts is not None and name in ("moe.w1", "moe.w2") else q.grad
        errs[name] = relative_error(_full(p.grad), want)
    return errs


def _ep_worker(rank, world):
    ref, model = _blocks(dist.group.WORLD)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(m, H, generator=g) for m in (6, 3)]
    ys = [torch.randn(m, 4, generator=g) for m in (6, 3)]
    loss = torch.nn.functional.mse_loss(model(xs[rank]), ys[rank])
    loss.backward()
    for p in model.experts():  # EP sums the ranks' losses into the experts; FSDP averages: match it
        p.grad /= world
    ref_losses = [torch.nn.functional.mse_loss(ref(x), y) for x, y in zip(xs, ys)]
    (sum(ref_losses) / world).backward()
    El = E // world
    mine = slice(rank * El, (rank + 1) * El)
    errs = {"loss": abs(float(loss.detach()) - float(ref_losses[rank].detach()))}
    errs |= _grad_errors(model, ref, mine)
    sharded = [n for n, p in model.named_parameters() if hasattr(p, "full_tensor")]
    return (errs, sharded)


@pytest.mark.slow
def test_fsdp2_dense_with_expert_parallel_experts():
    for rank, (errs, sharded) in run_ranks(_ep_worker, WORLD).items():
        assert "moe.w1" not in sharded and "moe.w2" not in sharded, f"rank {rank}: FSDP sharded the EP experts"
        assert "up.weight" in sharded and "moe.gate" in sharded, f"rank {rank}: dense parameters not sharded"
        worst = max(errs.items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, f"rank {rank}: {worst[0]} differs from the one-process model by {worst[1]}"


def _ep_replicas_worker(rank, world):
    """World 4 as 2 expert-parallel groups of 2 ({0, 1}, {2, 3}): ranks r and r + 2 hold the same expert shard
    (replicas). FSDP shards the dense parts over all 4; the experts' gradients are summed over each replica pair
    and divided by 4 (the ranks FSDP averages over), the recipe of docs/training.md."""
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep_size = 2
    ref, model = _blocks(ep_groups[rank // ep_size])
    g = torch.Generator().manual_seed(1)
    counts = (5, 0, 4, 3)  # rank 1 has no tokens
    xs = [torch.randn(m, H, generator=g) for m in counts]
    ys = [torch.randn(m, 4, generator=g) for m in counts]
    # a rank without tokens contributes 0 to the sum (mse_loss of nothing is nan)
    loss_of = lambda out, y: torch.nn.functional.mse_loss(out, y, reduction="sum") / 4  # noqa: E731
    loss = loss_of(model(xs[rank]), ys[rank])
    loss.backward()
    for p in model.experts():
        dist.all_reduce(p.grad, group=replica_groups[rank % ep_size])
        p.grad /= world
    (sum(loss_of(ref(x), y) for x, y in zip(xs, ys)) / world).backward()
    El = E // ep_size
    mine = slice((rank % ep_size) * El, (rank % ep_size + 1) * El)
    return _grad_errors(model, ref, mine)


@pytest.mark.slow
def test_fsdp2_over_expert_parallel_groups_with_replicas():
    for rank, errs in run_ranks(_ep_replicas_worker, 4).items():
        worst = max(errs.items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, f"rank {rank}: {worst[0]} differs from the one-process model by {worst[1]}"
