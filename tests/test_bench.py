"""The benchmark code paths on CPU: tiny shapes, asserting the properties the H200 tables report."""

import json

import pytest
import torch

from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.routing import route
from fusedmoe.tools.bench import call_path, decode, floors, strategies
from fusedmoe.tools.bench.baselines import hf_experts
from fusedmoe.tools.presets import Preset


def test_step_sizes_mix_decode_and_prefill():
    """A decode run is mostly M in [1, 256] with at least one prefill chunk, and is reproducible."""
    sizes = decode.step_sizes(48, seed=3)
    assert sizes == decode.step_sizes(48, seed=3)
    assert any(m >= 2048 for m in sizes) and sum(m <= 256 for m in sizes) >= 40
    assert all(1 <= m <= 8192 for m in sizes)


@pytest.mark.slow
def test_decode_bench_properties_cpu():
    """shared holds exactly the largest single-layer plan, per_layer the sum over layers; after warm-up
    neither allocates; alloc_* allocate once per layer call; every eager strategy gives the same output."""
    cfg = Preset("tiny", 8, 2, 32, 16, 3)
    res = decode.run(cfg, steps=6, device=torch.device("cpu"), dtype=torch.float32, backend="torch", progress=False)
    rows = {r["strategy"]: r for r in res["strategies"]}
    assert set(rows) == {"alloc_zeros", "alloc_empty", "per_layer", "shared"}
    assert rows["shared"]["arena_bytes"] == rows["shared"]["largest_plan_bytes"]
    assert rows["per_layer"]["arena_bytes"] == cfg.num_layers * rows["shared"]["arena_bytes"]
    for s in ("shared", "per_layer"):
        assert rows[s]["manager_allocs_per_step"] == 0 and rows[s]["growths"] == 0
        assert rows[s]["bytes_zeroed_per_step"] == 0
    assert rows["alloc_zeros"]["manager_allocs_per_step"] == cfg.num_layers
    assert rows["alloc_zeros"]["bytes_zeroed_per_step"] > 0 and rows["alloc_empty"]["bytes_zeroed_per_step"] == 0
    assert res["eager_outputs_bit_identical"]
    assert res["stack"] == dict(
        name="tiny", num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, num_layers=3, routing=cfg.routing
    )


def test_strategy_table_cpu():
    """The CPU `make bench` table: one row per strategy (caller buffers included), all bit-identical."""
    shape = Preset("tiny", 8, 2, 32, 16, 2)
    res = strategies.run(shape, [1, 5], steps=2, device=torch.device("cpu"), dtype=torch.float32, backend="torch")
    assert [r["strategy"] for r in res] == ["alloc_zeros", "alloc_empty", "per_layer", "shared", "caller"]
    assert all(r["bit_identical"] in (None, True) for r in res)
    assert res[0]["zeroed_bytes_per_call"] > 0 and res[3]["allocs_per_call"] == 0


def test_call_path_table_cpu():
    """Both call paths (direct and registered op) run the same problem to the same bits; the table has them."""
    r = call_path.measure("cpu", calls=3, repeats=1, M=3)
    assert r["identical"] and r["direct_us"] > 0 and r["op_us"] > 0
    assert r["op_extra_us"] == r["op_us"] - r["direct_us"]
    assert call_path.table_rows(r)[0][-1] == "yes"


def test_floor_is_the_larger_of_memory_and_compute():
    c = floors.Ceilings(copy_tb_s=4.0, read_tb_s=4.0, bf16_tflops=800.0)
    us, nbytes, bound = floors.layer_floor_us(8, 1, 8, 2048, 768, 2, c)
    assert bound == "memory" and nbytes == 8 * 3 * 2048 * 768 * 2 + 2 * 2048 * 2
    assert us == pytest.approx(nbytes / 4e12 * 1e6)
    us, _, bound = floors.layer_floor_us(128, 16384, 8, 2048, 768, 2, c)
    assert bound == "compute" and us == pytest.approx(2 * 16384 * 8 * 3 * 2048 * 768 / 800e12 * 1e6)


def test_fp8_rows_take_the_measured_fp8_rate():
    """The compute floor of an fp8 row is its FLOPs at the measured fp8 matmul rate, or at twice the bf16 rate where
    it was not measured (the summary line says which, and why); bf16 rows keep the bf16 rate. MXFP4 is weight-only
    (bf16 GEMMs), so the bench asks for the fp8 floor for the w8a8 modes only."""
    from fusedmoe.quant import QUANT_MODES, QuantConfig

    flops = 2 * 16384 * 8 * 3 * 2048 * 768
    measured = floors.Ceilings(copy_tb_s=4.0, read_tb_s=4.0, bf16_tflops=800.0, fp8_tflops=1200.0)
    us, _, bound = floors.layer_floor_us(128, 16384, 8, 2048, 768, 1, measured, fp8=True)
    assert bound == "compute" and us == pytest.approx(flops / 1200e12 * 1e6)
    us, _, _ = floors.layer_floor_us(128, 16384, 8, 2048, 768, 2, measured)
    assert us == pytest.approx(flops / 800e12 * 1e6)
    assert measured.summary().endswith("bf16 matmul 800 TFLOP/s, fp8 matmul 1200 TFLOP/s (torch._scaled_mm)")
    assumed = floors.Ceilings(copy_tb_s=4.0, read_tb_s=4.0, bf16_tflops=800.0, fp8_error="RuntimeError: no fp8")
    us, _, _ = floors.layer_floor_us(128, 16384, 8, 2048, 768, 1, assumed, fp8=True)
    assert assumed.fp8_rate_tflops == 1600.0 and us == pytest.approx(flops / 1600e12 * 1e6)
    assert (
        "fp8 matmul not measured (RuntimeError: no fp8): fp8 floors take 2 x bf16 = 1600 TFLOP/s" in assumed.summary()
    )
    assert [m for m in QUANT_MODES if QuantConfig.parse(m).fp8] == ["fp8_tensor", "fp8_token", "fp8_block"]


def test_ceilings_json_keeps_its_keys_and_adds_fp8():
    """The JSON of the ceilings has the old keys and the fp8 rate (null, with the reason, where not measured); a
    file written before the fp8 rate was measured still reads back."""
    c = floors.Ceilings(copy_tb_s=4.2, read_tb_s=4.1, bf16_tflops=790.0, fp8_tflops=1310.0)
    saved = json.loads(json.dumps(c.as_dict()))
    assert saved == {"copy_tb_s": 4.2, "read_tb_s": 4.1, "bf16_tflops": 790.0, "fp8_tflops": 1310.0, "fp8_error": None}
    assert floors.Ceilings(**saved) == c
    old = floors.Ceilings(**{"copy_tb_s": 4.2, "read_tb_s": 4.1, "bf16_tflops": 790.0})
    assert old.fp8_tflops is None and old.fp8_rate_tflops == 1580.0


def test_fp8_ceiling_falls_back_with_its_reason(monkeypatch):
    """Where torch._scaled_mm fails (a GPU without fp8 tensor cores) or is missing, the fp8 rate is None with the
    reason, and the floors fall back to 2x bf16."""

    def fails(device):
        raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0")

    monkeypatch.setattr(floors, "_fp8_matmul_rate", fails)
    rate, why = floors.fp8_ceiling(torch.device("cpu"))
    assert rate is None and why.startswith("RuntimeError: torch._scaled_mm is only supported")
    monkeypatch.delattr(torch, "_scaled_mm")
    assert floors.fp8_ceiling(torch.device("cpu")) == (None, f"torch {torch.__version__} has no torch._scaled_mm")


@pytest.mark.gpu
def test_fp8_ceiling_is_measured_on_the_gpu():
    """On a GPU with fp8 tensor cores (sm89+) the fp8 8192^3 matmul rate is measured, and above the bf16 one."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    rate, why = floors.fp8_ceiling(torch.device("cuda"))
    assert why is None and rate > floors._matmul_rate(torch.device("cuda"))


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_transformers_baseline_computes_the_layer(impl):
    """The transformers experts baseline of the kernel bench runs our weights correctly."""
    E, H, I, M, k = 8, 40, 24, 9, 2
    w1, w2, x = torch.randn(E, 2 * I, H) / 7, torch.randn(E, H, I) / 5, torch.randn(M, H)
    w, ids = route(torch.randn(M, E), k)
    module = hf_experts(w1, w2, impl)
    if module is None:
        pytest.skip("transformers not installed")
    assert relative_error(module(x, ids.long(), w), fused_moe_reference(x, w1, w2, w, ids)) < 1e-5


def test_bench_host_measures_the_experts_interface_beside_the_bare_call():
    """`bench host`'s interface rows: transformers' experts module ran through fusedmoe (its manager counted the
    call), and each row has the bare fused_moe call and the stages beside it, with a host time."""
    pytest.importorskip("transformers")
    import torch

    from fusedmoe.tools.bench import host

    rows = host.measure(torch.device("cpu"), preset=host.CPU_SHAPE, tokens=[1, 3], dtype=torch.float32,
                        backends=("torch",), calls=3, ep=False)  # fmt: skip
    want = [(p, M) for M in (1, 3) for p in ("experts interface (module call)", "fused_moe on the same inputs")]
    assert [(r["path"], r["M"]) for r in rows if (r["path"], r["M"]) in want] == want
    assert not [r for r in rows if "did not run" in r["path"]]
    for r in rows:
        if r["path"].startswith(("experts interface", "fused_moe on the same", "  fusedmoe_experts_forward")):
            assert r["host_us"] > 0 and r["device_us"] is None


def test_host_us_interleaved_takes_turns_and_switches_before_each_turn():
    """The paths take turns of ``block`` calls (A A B B, A A B B, ...), each turn after its path's switch; every
    path gets ``calls`` timed calls, and a path that takes longer reads longer."""
    import time

    import torch

    from fusedmoe.tools.bench.host import host_us_interleaved

    seen = []
    paths = {
        "fast": (lambda: seen.append("fast"), lambda: seen.append("switch fast")),
        "slow": (lambda: (seen.append("slow"), time.sleep(0.002)), lambda: seen.append("switch slow")),
    }
    us = host_us_interleaved(paths, torch.device("cpu"), calls=6, block=2)
    warm = ["switch fast", "fast", "fast", "fast", "switch slow", "slow", "slow", "slow"]
    turn = ["switch fast", "fast", "fast", "switch slow", "slow", "slow"]
    assert seen == warm + turn * 3
    assert us["slow"] > us["fast"] + 1500
