"""`fusedmoe bench train` and `fusedmoe demo --train` on the CPU: tiny shapes, the properties the GPU run reports."""

import json
import math
import os

import pytest

from fusedmoe.tools import cli, train_demo
from fusedmoe.tools.bench import train

pytest.importorskip("transformers")

ROW_FIELDS = {"shape", "E", "k", "H", "I", "tokens", "impl", "ms", "pct_of_peak", "floor_ms", "note"}


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    """One tiny CPU run of every system on the mixtral shape (E=8, k=2), written as JSON by the CLI."""
    os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")  # where liger_kernel is installed: no interpreted autotune
    path = tmp_path_factory.mktemp("bench") / "train.json"
    argv = ["bench", "train", "--cpu", "--tiny", "--shapes", "mixtral-8x7b", "--tokens", "16,24", "--repeats", "1"]
    assert cli.main([*argv, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def test_cpu_tiny_bench_json_has_every_system_with_finite_numbers(bench_json):
    assert bench_json["device"] == "cpu" and bench_json["tiny"] and _finite(bench_json["peak_tflops"])
    rows = bench_json["rows"]
    assert [(r["tokens"], r["impl"]) for r in rows] == [(M, impl) for M in (16, 24) for impl in (*train.IMPLS, "floor")]
    for r in rows:
        assert ROW_FIELDS <= set(r)
        assert (r["E"], r["k"], r["H"], r["I"]) == (8, 2, train.TINY_H, train.TINY_I)
        assert _finite(r["floor_ms"]) and r["floor_ms"] > 0
        if r["impl"] == "liger" and r["ms"] is None:  # liger_kernel is optional: a row that says why
            assert "not installed" in r["note"] or "GPU" in r["note"]
            continue
        assert _finite(r["ms"]) and r["ms"] > 0, r
        assert _finite(r["pct_of_peak"]) and r["pct_of_peak"] > 0
        if r["impl"] == "floor":
            continue
        assert r["note"] is None, r["note"]
        assert r["peak_mb"] is None  # no allocator statistics on the CPU
        assert _finite(r["grads_mb"]) and r["grads_mb"] > 0
        for errs in r["rel_err"].values():
            assert set(errs) == {"out", *train.GRADS} and all(_finite(e) for e in errs.values())
    fused = [r for r in rows if r["impl"] == "fusedmoe"]
    assert all(_finite(r["arena_mb"]) and _finite(r["plan_mb"]) for r in fused)
    assert all(set(r["rel_err"]) == {"grouped_mm", "eager"} for r in fused)


def test_fusedmoe_gradients_match_the_eager_row(bench_json):
    """The bench's fusedmoe row against transformers' eager loop (float32): output and all four gradients."""
    for r in bench_json["rows"]:
        if r["impl"] in ("fusedmoe", "grouped_mm"):
            errs = r["rel_err"]["eager"]
            assert max(errs.values()) < 1e-5, (r["impl"], errs)


def test_bench_rejects_unknown_names():
    with pytest.raises(SystemExit):
        cli.main(["bench", "train", "--cpu", "--tiny", "--impls", "fusedmoe,nope"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "train", "--cpu", "--tiny", "--shapes", "nope"])


def test_train_demo_loss_decreases():
    result = train_demo.run(steps=5, batch=1, seq=32, progress=lambda _: None)
    losses = result["losses"]
    assert len(losses) == 5 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.1, losses
    assert losses[0] == pytest.approx(result["loss_transformers"], rel=1e-5)  # fusedmoe's experts = transformers'
    assert result["tokens_per_s"] > 0 and result["peak_mb"] > 0


def test_demo_train_cli():
    assert cli.main(["demo", "--train", "--steps", "3", "--seq", "16"]) == 0


@pytest.mark.slow
def test_bench_train_ep_reports_the_exchange_beside_one_process(tmp_path):
    """`bench train --ep 2`: a one-process row on all rows, then the world-2 row on half of them per rank, whose
    step time holds the time inside the exchange (a gloo all-to-all takes some time; compute is the rest)."""
    path = tmp_path / "ep.json"
    argv = ["bench", "train", "--ep", "2", "--shapes", "mixtral-8x7b", "--tokens", "6", "--repeats", "2"]
    assert cli.main([*argv, "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["ep"]
    assert [(r["world"], r["tokens"]) for r in rows] == [(1, 12), (2, 6)]
    single, ep = rows
    assert single["exchange_ms"] == 0 and _finite(single["ms"]) and single["ms"] > 0
    assert 0 < ep["exchange_ms"] < ep["ms"] and ep["single_ms"] == single["ms"]
    with pytest.raises(SystemExit, match="world sizes must be >= 2"):
        cli.main(["bench", "train", "--ep", "1"])
