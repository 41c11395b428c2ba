"""Expert-parallel training over gloo (CPU, torch.multiprocessing spawn): one forward + backward of an
expert-parallel FusedMoE at worlds 2 and 4 gives the single-process layer's gradients, rank by rank, within
float32 tolerance: each rank's input gradient is its rows of the reference's, each rank's expert gradients are
its shard of the reference's, and the router gate's gradients summed over the ranks are the reference's (each
rank routes its own tokens). Uneven token counts, a rank with no tokens and an expert no token picks are in every
case; the torch experts, the Triton experts (interpreter) and the router weight on the input are covered."""

import os

import pytest
import torch
import torch.distributed as dist
from gloo_world import run_ranks

E, H, I = 8, 32, 32
TOKENS = [5, 0, 7, 3]  # tokens per rank: rank 1 has none
IDLE = 6  # the expert no token picks (its router bias is pushed far down)


def _layers(rank, world, backend, top_k, on_input, seed):
    """(single-process reference layer, this rank's expert-parallel layer with the same weights), both training."""
    from fusedmoe.layer import FusedMoE
    from fusedmoe.workspace.manager import WorkspaceManager

    torch.manual_seed(seed)
    kw = dict(backend=backend, apply_router_weight_on_input=on_input, router_bias=True)
    full = FusedMoE(E, top_k, H, I, **kw)
    with torch.no_grad():
        full.gate_bias.copy_(torch.randn(E) * 0.1)
        full.gate_bias[IDLE] = -1e4
    ep = FusedMoE(E, top_k, H, I, ep_group=dist.group.WORLD, workspace=WorkspaceManager("cpu", poison=True), **kw)
    ep.load_weights(full.w1.data, full.w2.data, full.gate.data)
    with torch.no_grad():
        ep.gate_bias.copy_(full.gate_bias)
    return full.requires_grad_(True), ep.requires_grad_(True)


def _grads(layer, x, probe):
    """Gradients of ``(layer(x) * probe).sum()`` for x, w1, w2 and gate, and how many plans the backward took from
    the layer's workspace manager (None without one)."""
    x = x.clone().requires_grad_(True)
    out = layer(x)
    stats = layer.workspace.stats if layer.workspace is not None else None
    calls = stats.calls if stats is not None else None
    (out * probe).sum().backward()
    backward_plans = stats.calls - calls if stats is not None else None
    return out.detach(), x.grad, layer.w1.grad, layer.w2.grad, layer.gate.grad, backward_plans


def _worker(rank, world, cases):
    from fusedmoe.ops.configs import MoEConfig, pin_config
    from fusedmoe.reference import relative_error

    pin_config(MoEConfig.simple(16, 32, 16))
    results = []
    for backend, top_k, on_input, seed, *compiled in cases:
        full, ep = _layers(rank, world, backend, top_k, on_input, seed)
        if compiled:  # the exchange runs outside the graph (a graph break), the rest compiled
            torch._dynamo.reset()
            ep = torch.compile(ep, backend="aot_eager")
        g = torch.Generator().manual_seed(seed + 1)
        counts = TOKENS[:world]
        xs = [torch.randn(m, H, generator=g) for m in counts]
        probes = [torch.randn(m, H, generator=g) for m in counts]
        ref = _grads(full, torch.cat(xs), torch.cat(probes))
        got = _grads(ep, xs[rank], probes[rank])
        gate = got[4].clone()
        dist.all_reduce(gate)  # each rank's router saw its own tokens: the reference's is the sum
        lo = sum(counts[:rank])
        El = E // world
        mine = slice(rank * El, (rank + 1) * El)
        pairs = {
            "out": (got[0], ref[0][lo : lo + counts[rank]]),
            "x": (got[1], ref[1][lo : lo + counts[rank]]),
            "w1": (got[2], ref[2][mine]),
            "w2": (got[3], ref[3][mine]),
            "gate": (gate, ref[4]),
        }
        errs = {}
        for name, (a, b) in pairs.items():
            if a is None or a.shape != b.shape:
                errs[name] = f"shape {None if a is None else tuple(a.shape)} against {tuple(b.shape)}"
            elif b.numel() == 0 or b.abs().max() == 0:
                errs[name] = float(a.abs().max()) if a.numel() else 0.0  # must be exactly zero too
            else:
                errs[name] = relative_error(a, b)
        idle = IDLE // El == rank and float(ep.w1.grad[IDLE % El].abs().max() + ep.w2.grad[IDLE % El].abs().max())
        if backend == "triton":  # the local experts' backward scratch came from the layer's manager
            errs["backward plans"] = 0.0 if got[5] >= 1 else f"{got[5]} plans from the layer's manager"
        results.append(((backend, top_k, on_input), errs, idle))
    return results


def _run(world, cases):
    out = run_ranks(_worker, world, cases)
    for rank, res in out.items():
        for tag, errs, idle in res:
            for name, err in errs.items():
                assert not isinstance(err, str), f"rank {rank} {tag} {name}: {err}"
                assert err < 2e-5, f"rank {rank} {tag}: {name} differs from the single-process layer by {err}"
            assert idle is False or idle == 0.0, f"rank {rank} {tag}: the expert no token picked got a gradient"
    return out


@pytest.mark.slow
def test_ep_training_world2():
    cases = [("torch", 2, False, 0), ("torch", 1, True, 1), ("torch", 2, False, 5, "compiled")]
    if os.environ.get("TRITON_INTERPRET") == "1":
        cases.append(("triton", 2, False, 2))
    _run(2, cases)


@pytest.mark.slow
def test_ep_training_world4():
    _run(4, [("torch", 2, False, 3)])


def _mismatch_worker(rank, world):
    """A negative control of the comparison: the expert shards swapped between the ranks must change the
    gradients (so a gradient that reached the wrong rank's experts would be caught)."""
    from fusedmoe.reference import relative_error

    full, ep = _layers(rank, world, "torch", 2, False, 4)
    El = E // world
    ep.load_weights(torch.roll(full.w1.data, El, 0), torch.roll(full.w2.data, El, 0), full.gate.data)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(m, H, generator=g) for m in TOKENS[:world]]
    probes = [torch.randn(m, H, generator=g) for m in TOKENS[:world]]
    ref = _grads(full, torch.cat(xs), torch.cat(probes))
    got = _grads(ep, xs[rank], probes[rank])
    lo = sum(TOKENS[:rank])
    b = ref[1][lo : lo + TOKENS[rank]]
    return relative_error(got[1], b) if b.numel() else None


@pytest.mark.slow
def test_ep_training_catches_swapped_shards():
    errs = run_ranks(_mismatch_worker, 2)
    assert errs[0] > 1e-2, f"swapped expert shards left rank 0's input gradient unchanged ({errs[0]})"


def test_exchange_backward_is_the_reverse_exchange():
    """Exchange over a loopback transport of one rank: the forward copies the rows, the backward returns the
    gradient unchanged, and the splits are what the transport sees, reversed in the backward."""
    from fusedmoe.training.expert_parallel import Exchange

    calls = []

    class Loopback:
        rank, world_size = 0, 1

        def all_to_all(self, output, input, send, recv):
            calls.append((list(send), list(recv)))
            output.copy_(input)

    rows = torch.randn(3, 4, requires_grad=True)
    out = Exchange.apply(rows, Loopback(), [3], [3])
    assert torch.equal(out, rows.detach())
    grad = torch.randn(3, 4)
    out.backward(grad)
    assert torch.equal(rows.grad, grad)
    assert calls == [([3], [3]), ([3], [3])]
