"""Expert parallelism over gloo (CPU, torch.multiprocessing spawn): worlds of 2 and 4 ranks give the output of
the single-process layer for random routing, ranks with no tokens included, in the standard and batched
layouts, with float and quantized (MXFP4, fp8) experts; each rank keeps exactly its shard of the experts (and
scales); a mis-mapped shard is caught."""

import os

import pytest
import torch
import torch.distributed as dist
from gloo_world import run_ranks

E, K, H, I = 8, 2, 32, 32  # H, I: multiples of MXFP4's 32-element scale groups
TOKENS = [5, 0, 7, 3]  # tokens per rank: rank 1 has none


def _experts(layer):
    """A layer's expert weights dequantized to float32 [E_local, 2I, H] and [E_local, H, I] (any quantized layout)."""
    from fusedmoe.quant import dequantize_weight

    w1 = dequantize_weight(layer.w1, layer.w1_scale, layer.quant, K=layer.hidden_size, gated=True)
    return w1, dequantize_weight(layer.w2, layer.w2_scale, layer.quant, K=layer.intermediate_size)


def _worker(rank, world, configs):
    from fusedmoe.layer import FusedMoE
    from fusedmoe.ops.configs import MoEConfig, pin_config
    from fusedmoe.reference import relative_error
    from fusedmoe.workspace.manager import WorkspaceManager

    pin_config(MoEConfig.simple(16, 32, 16))
    results = []
    for layout, backend, cap, seed, *quant in configs:
        quant = quant[0] if quant else None
        torch.manual_seed(seed)
        full = FusedMoE(E, K, H, I, backend="torch" if quant in (None, "mxfp4") else "triton", quant=quant)
        g = torch.Generator().manual_seed(seed + 1)
        xs = [torch.randn(m, H, generator=g) for m in TOKENS[:world]]
        ref = full(xs[rank])
        ep = FusedMoE(
            E,
            K,
            H,
            I,
            backend=backend,
            ep_group=dist.group.WORLD,
            layout=layout,
            max_tokens_per_rank=cap,
            workspace=WorkspaceManager("cpu", poison=True),
            quant=quant,
        )
        scales = {"w1_scale": full.w1_scale, "w2_scale": full.w2_scale} if quant else {}
        ep.load_weights(full.w1.data, full.w2.data, full.gate.data, **scales)
        El = E // world
        mine = slice(rank * El, (rank + 1) * El)
        if ep.quant is not None and ep.quant.layout != full.quant.layout:
            # MXFP4: the batched layout holds the checkpoint's bytes, the standard one the mma layout
            shard_ok = all(torch.equal(a, b[mine]) for a, b in zip(_experts(ep), _experts(full)))
        else:
            shard_ok = torch.equal(ep.w1, full.w1[mine]) and torch.equal(ep.w2, full.w2[mine])
            shard_ok = shard_ok and all(torch.equal(getattr(ep, n), s[mine]) for n, s in scales.items())
        shard_ok = (
            shard_ok
            and torch.equal(ep.gate, full.gate)
            and ep.expert_map.tolist() == [g_ - rank * El if g_ // El == rank else -1 for g_ in range(E)]
        )
        out = ep(xs[rank])
        err = relative_error(out, ref) if ref.numel() else float(out.abs().sum())
        # negative control: the shard of another rank must change the output (the experts rolled by one
        # shard, so that this rank's slice holds the next rank's)
        shifted = {n: torch.roll(t, -El, dims=0) for n, t in (("w1", full.w1.data), ("w2", full.w2.data))}
        ep.load_weights(shifted["w1"], shifted["w2"], **{n: torch.roll(t, -El, dims=0) for n, t in scales.items()})
        bad = ep(xs[rank])
        bad_err = relative_error(bad, ref) if ref.numel() else 1.0
        tag = (layout, backend, cap, quant)
        results.append((tag, tuple(out.shape) == tuple(xs[rank].shape), shard_ok, err, bad_err))
    return results


def _check(out):
    for rank, res in out.items():
        for (layout, backend, cap, quant), shape_ok, shard_ok, err, bad_err in res:
            tag = f"rank {rank} {layout}/{backend}/cap={cap}/quant={quant}"
            assert shape_ok, tag
            assert shard_ok, f"{tag}: experts or expert_map mis-mapped"
            assert err < 1e-5, f"{tag}: error {err}"
            assert bad_err > 1e-2, f"{tag}: a mis-mapped shard went unnoticed"


@pytest.mark.slow
def test_ep_world2():
    triton = os.environ.get("TRITON_INTERPRET") == "1"
    configs = [("standard", "torch", None, 0), ("batched", "torch", 8, 1)]
    if triton:
        configs += [("standard", "triton", None, 2), ("batched", "triton", None, 3)]
        # quantized experts: MXFP4 (float activations on the wire) and fp8 (e4m3 rows and scales on the wire)
        configs += [("batched", "triton", None, 6, "mxfp4"), ("standard", "triton", None, 7, "fp8_token")]
        # the torch experts on the fp8 rows prepare sends (its quantization is a Triton kernel: interpreter only)
        configs += [("standard", "torch", None, 9, "fp8_token"), ("standard", "torch", None, 10, "fp8_block")]
    configs += [("standard", "torch", None, 8, "mxfp4")]
    _check(run_ranks(_worker, 2, configs))


@pytest.mark.slow
def test_ep_world4():
    _check(run_ranks(_worker, 4, [("standard", "torch", None, 4), ("batched", "torch", None, 5)]))


_RELEASE_SCRIPT = """
import os, sys, tempfile, torch
import torch.distributed as dist
from fusedmoe.layer import FusedMoE

def gloo_threads():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:
            pass
    return [n for n in names if "gloo" in n]

dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/init", rank=0, world_size=1)
during = gloo_threads()
layer = FusedMoE(4, 2, 32, 32, backend="torch", ep_group=dist.group.WORLD)
layer(torch.randn(3, 32))
del layer
dist.destroy_process_group()
print(len(during), len(gloo_threads()), "torch._dynamo" in sys.modules)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_forward_lets_destroy_process_group_release_the_group():
    """An expert-parallel forward leaves nothing that keeps the process group alive: after destroy_process_group
    its gloo threads are gone (a forward that first imported torch._dynamo pinned the group through
    torch.distributed.nn's default arguments, and gloo then aborted at exit in about one run of three)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RELEASE_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    during, after, dynamo = out.stdout.split()
    assert int(during) > 0, "the probe sees no gloo threads at all: it cannot tell a released group"
    assert int(after) == 0, f"{after} gloo threads outlive destroy_process_group"
    assert dynamo == "False", "a forward imported torch._dynamo"


def test_ep_group_validation():
    from fusedmoe.prepare_finalize.all_to_all import contiguous_expert_map

    assert contiguous_expert_map(6, 1, 3).tolist() == [-1, -1, 0, 1, -1, -1]
    with pytest.raises(ValueError, match="divisible"):
        contiguous_expert_map(6, 0, 4)


def _fp8_worker(rank, world, modes):
    """EP with fp8 rows (+ scales) on the wire vs the single-process fused call, Triton experts (interpreter)."""
    from fusedmoe import fused_moe, route
    from fusedmoe.distributed import ExpertParallelKernel, TorchDistributedTransport
    from fusedmoe.experts.base import ExpertsInputs
    from fusedmoe.experts.triton_experts import TritonExperts
    from fusedmoe.ops.configs import MoEConfig, pin_config, pinned_config
    from fusedmoe.prepare_finalize.all_to_all import AllToAllPrepareFinalize
    from fusedmoe.problem import MoEProblem
    from fusedmoe.quant import QuantConfig, dequantize_weight, fake_quantize_activation, quantize_weights
    from fusedmoe.reference import fused_moe_reference, relative_error
    from fusedmoe.workspace.manager import WorkspaceManager

    pin_config(MoEConfig.simple(16, 32, 32))
    results = []
    for mode in modes:
        q = QuantConfig.parse(mode)
        g = torch.Generator().manual_seed(11)
        w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
        w2 = torch.randn(E, H, I, generator=g) / I**0.5
        w1q, w2q, s1, s2 = quantize_weights(w1, w2, q)
        xs = [torch.randn(m, H, generator=g) for m in TOKENS[:world]]
        logits = [torch.randn(m, E, generator=g) for m in TOKENS[:world]]
        w, ids = route(logits[rank], K)
        ref = fused_moe(xs[rank], w1q, w2q, w, ids, quant=q, w1_scale=s1, w2_scale=s2, backend="triton")
        El = E // world
        lo = rank * El
        pf = AllToAllPrepareFinalize(TorchDistributedTransport(), E, max(TOKENS[:world]))
        kernel = ExpertParallelKernel(pf, TritonExperts())
        p = MoEProblem(xs[rank].shape[0], H, I, El, E, K, torch.float32, w1q.dtype, has_expert_map=True, quant=q)
        wire = pf.wire_fp8(p) and any(
            b.name == "ep_send_hidden" and b.dtype == w1q.dtype for b in kernel.plan(p).buffers
        )
        inputs = ExpertsInputs(
            xs[rank],
            w1q[lo : lo + El],
            w2q[lo : lo + El],
            w,
            ids,
            expert_map=pf.expert_map("cpu"),
            w1_scale=s1[lo : lo + El],
            w2_scale=s2[lo : lo + El],
        )
        out = kernel(inputs, p, manager=WorkspaceManager("cpu", poison=True))
        err = relative_error(out, ref) if ref.numel() else float(out.abs().sum())
        with pinned_config(MoEConfig.simple(1, 16, 32)):  # decode-sized blocks: the fp8 rows with their scales
            one_row = kernel(inputs, p, manager=WorkspaceManager("cpu", poison=True))
        # ... weight-only past the wire: GEMM1 on the rows as sent, GEMM2 on its unquantized output
        d1, d2 = dequantize_weight(w1q, s1, q), dequantize_weight(w2q, s2, q)
        sent = fake_quantize_activation(xs[rank], q) if xs[rank].numel() else xs[rank]
        want = fused_moe_reference(sent, d1, d2, w, ids)
        err_one_row = relative_error(one_row, want) if want.numel() else float(one_row.abs().sum())
        results.append((mode, wire, err, err_one_row))
    return results


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton experts on CPU need the interpreter")
def test_ep_world2_fp8_rows_and_scales_on_the_wire():
    """fp8 per-token and 128-block modes send fp8 rows plus their row scales (the plan's send buffer is fp8)
    and give the single-process result, also through 1-row blocks (the multiply-add K loop takes the fp8 rows with
    their scales); a rank with no tokens takes part."""
    out = run_ranks(_fp8_worker, 2, ["fp8_token", "fp8_block"])
    for rank, res in out.items():
        for mode, wire, err, err_one_row in res:
            assert wire, f"rank {rank} {mode}: tokens did not travel as fp8"
            assert err < 1e-5, f"rank {rank} {mode}: error {err}"
            assert err_one_row < 1e-5, f"rank {rank} {mode}: 1-row blocks (multiply-add loop) off by {err_one_row}"
