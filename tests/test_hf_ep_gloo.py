"""transformers' own expert parallelism over fusedmoe's experts implementation (gloo, world 2, CPU).

transformers shards each experts module (``apply_expert_parallelism`` with the model's ``ep_plan``: the weights
``Shard(0)``, ``num_experts`` the local count) and reaches the local experts through an ``EPImplementation``
that calls the experts' forward, here ``experts_implementation="fusedmoe"``:

- ``all_to_all``: each rank sends its (token, expert) pairs to the experts' ranks; fusedmoe computes the rows it
  receives on local expert ids;
- ``all_reduce``: every rank holds the same batch and computes its own experts on all of it, the slots of other
  ranks' experts marked with the local id ``E_local`` and weight 0 (fusedmoe maps that id to no expert).

One training step of the tiny Qwen3-MoE gives each rank the loss of the unsharded model on transformers' own
experts, the same gradients for the dense parameters, and this rank's shard of the experts' gradients (summed over
the ranks whose tokens reached them), within float32 tolerance, with fusedmoe's value checks on; fusedmoe computed
the experts (its manager counted the calls) and transformers' fallback never ran (no warning). ``patch_model``,
which would bypass the forward transformers installed, refuses such a model."""

import copy
import os
import sys
import warnings

import pytest
import torch
from devices import interpreter
from gloo_world import run_ranks

from fusedmoe.reference import relative_error

pytest.importorskip("transformers")
pytest.importorskip("transformers.distributed.expert_parallel", reason="this transformers has no expert parallelism")
WORLD = 2


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _worker(rank, world, implementation, backend):
    os.environ["FUSEDMOE_CHECKS"] = "full"  # the value checks too: every id in range, finite weights
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(__file__))
    from hf_tiny import prompt, tiny_model
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    from fusedmoe.integrations import hf

    ref = tiny_model("qwen3_moe").train()
    model = copy.deepcopy(ref)
    hf.register()
    model.set_experts_implementation("fusedmoe")
    manager = hf.attach_workspace(model, backend=backend)
    if implementation == "all_reduce":  # the EP group shares one batch: it is the "TP" group too
        ep_mesh = tp_mesh = init_device_mesh("cpu", (world,))
        batches = [prompt(batch=2, length=12, seed=0)] * world
    else:
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "tp"))
        ep_mesh, tp_mesh = mesh["ep"], mesh["tp"]
        batches = [prompt(batch=2, length=12, seed=r) for r in range(world)]
    plan = model._expand_parallel_plan(model.ep_plan)
    apply_expert_parallelism(model, ep_mesh, tp_mesh, plan, ep_implementation=implementation)
    experts = model.model.layers[0].mlp.experts
    try:  # patch_model would bypass the EP forward transformers installed: it refuses, changing nothing
        hf.patch_model(model)
        refusal = None
    except NotImplementedError as err:
        refusal = str(err)
    sharded = experts.num_experts == ref.model.layers[0].mlp.experts.num_experts // world
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = model(input_ids=batches[rank], labels=batches[rank]).loss
        loss.backward()
    fallbacks = [str(w.message) for w in caught if "runs transformers' eager experts" in str(w.message)]
    ref_losses = [ref(input_ids=b, labels=b).loss for b in batches]
    if implementation == "all_reduce":
        ref_losses[rank].backward()  # one shared batch: every rank's gradients are those of its loss
    else:
        sum(ref_losses).backward()  # experts: every rank's tokens; the rest is compared per rank below
    own = {}
    if implementation != "all_reduce":
        own_ref = copy.deepcopy(ref)
        own_ref.zero_grad()
        own_ref(input_ids=batches[rank], labels=batches[rank]).loss.backward()
        own = {n: p.grad for n, p in own_ref.named_parameters()}
    El = experts.num_experts
    mine = slice(rank * El, (rank + 1) * El)
    errs = {"loss": abs(float(loss.detach()) - float(ref_losses[rank].detach()))}
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if ".experts." in name:
            errs[name] = relative_error(_local(p.grad), q.grad[mine])
        else:
            errs[name] = relative_error(p.grad, own.get(name, q.grad))
    return (errs, sharded, manager.stats.calls, fallbacks, refusal)


TRITON = pytest.param("triton", marks=interpreter, id="triton")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", TRITON])
@pytest.mark.parametrize("implementation", ["all_to_all", "all_reduce"])
def test_transformers_expert_parallelism_trains_through_fusedmoe(implementation, backend):
    out = run_ranks(_worker, WORLD, implementation, backend)
    for rank, res in out.items():
        errs, sharded, calls, fallbacks, refusal = res
        assert sharded, f"rank {rank}: transformers did not shard the experts"
        assert refusal is not None and "expert parallelism" in refusal, f"rank {rank}: patch_model did not refuse"
        assert calls > 0 and not fallbacks, f"rank {rank}: fusedmoe did not compute the experts ({fallbacks})"
        worst = max(errs.items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, f"rank {rank}: {worst[0]} differs from the unsharded model by {worst[1]}"
