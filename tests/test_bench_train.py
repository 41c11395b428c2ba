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
    """fusedmoe's run and transformers' from the same weights on the same batches (float32, CPU): equal at step 0,
    both losses fall, the curves stay together step by step, every reported figure is finite."""
    lines = []
    result = train_demo.run(steps=40, batch=4, seq=32, log_every=10, progress=lines.append)
    ours, theirs = result["fusedmoe"], result["transformers"]
    assert ours["implementation"] == "fusedmoe" and theirs["implementation"] not in ("fusedmoe", None)
    assert len(ours["losses"]) == len(theirs["losses"]) == 40
    assert all(math.isfinite(v) for v in (*ours["losses"], *theirs["losses"]))
    assert ours["losses"][0] == pytest.approx(theirs["losses"][0], rel=1e-5)  # fusedmoe's experts = transformers'
    window = train_demo.window_size(40)
    for losses in (ours["losses"], theirs["losses"]):
        assert train_demo.loss_fell(losses, window), losses
        assert losses[-1] < losses[0] - 0.5, losses
    c = result["comparison"]
    assert c["agree"] and c["window_gap_rel"] <= train_demo.AGREE_RTOL
    assert c["max_gap_rel"] < 1e-3, c  # float32: the two trajectories stay together at every step, not only on average
    assert result["ok"] and result["reason"] is None and result["loss_fell"]
    assert result["loss_floor"] == pytest.approx(math.log(train_demo.BRANCHING))
    assert min(ours["losses"] + theirs["losses"]) > result["loss_floor"] - 0.05  # nothing learns below the entropy
    for run in (ours, theirs):
        assert len(run["step_seconds"]) == 40 and all(s > 0 for s in run["step_seconds"])
        assert _finite(run["tokens_per_s"]) and run["tokens_per_s"] > 0
        assert run["peak_mb"] is None  # per-implementation peaks are the GPU allocator's
    assert _finite(result["speedup"]) and result["speedup"] > 0
    assert _finite(result["peak_mb"]) and result["peak_mb"] > 0 and "RSS" in result["peak_measure"]
    assert result["arena_bytes"] >= result["plan_peak_bytes"] > 0
    assert result["dtype"] == "torch.float32" and result["device"] == "cpu"
    assert lines[-1].startswith("result   OK")
    assert sum(line.startswith("step ") for line in lines) == 5  # steps 0, 10, 20, 30 and the last


def test_demo_train_cli():
    assert cli.main(["demo", "--train", "--steps", "40", "--batch", "4", "--seq", "32", "--log-every", "10"]) == 0


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


def test_demo_train_cli_fails_when_the_loss_does_not_fall(capsys):
    """lr 0: the weights never move, the loss cannot fall, the exit status says so."""
    assert cli.main(["demo", "--train", "--steps", "5", "--batch", "2", "--seq", "16", "--lr", "0"]) == 1
    assert "FAILED: fusedmoe's loss did not fall" in capsys.readouterr().out


def test_demo_train_batch_default(monkeypatch):
    """``--batch`` left out: --train uses its own default, generation keeps 1; a given --batch (even 1) is used."""
    seen = {}
    monkeypatch.setattr(train_demo, "run", lambda **kw: seen.update(kw) or {"ok": True})
    parser = cli.build_parser()
    assert train_demo.main(parser.parse_args(["demo", "--train"])) == 0
    assert (seen["batch"], seen["steps"], seen["seq"]) == (train_demo.BATCH, train_demo.STEPS, train_demo.SEQ)
    assert train_demo.main(parser.parse_args(["demo", "--train", "--batch", "1"])) == 0 and seen["batch"] == 1
    assert parser.parse_args(["demo"]).batch is None  # generation: demo.main takes 1


def test_demo_compare_curves_tells_diverging_curves_from_agreeing_ones():
    falling = [5.5 * 0.98**i + 1.4 for i in range(100)]
    same = train_demo.compare_curves(falling, list(falling), window=10)
    assert same["agree"] and same["max_gap"] == same["final_gap"] == same["window_gap_rel"] == 0
    noisy = [v * (1 + 0.02 * (-1) ** i) for i, v in enumerate(falling)]  # 2 % step-to-step noise averages out
    assert train_demo.compare_curves(noisy, falling, window=10)["agree"]
    drifting = [v * (1 + 0.002 * i) for i, v in enumerate(falling)]  # ends 20 % above
    c = train_demo.compare_curves(drifting, falling, window=10)
    assert not c["agree"] and c["window_gap_rel"] > train_demo.AGREE_RTOL
    assert c["max_gap_step"] == 99 and c["final_gap_rel"] == pytest.approx(0.198)
    assert not train_demo.compare_curves([*falling[:-1], math.nan], falling, window=10)["agree"]
    with pytest.raises(ValueError):
        train_demo.compare_curves(falling, falling[:-1], window=10)
    assert train_demo.loss_fell(falling, window=10)
    assert not train_demo.loss_fell([5.5] * 100, window=10)
    assert not train_demo.loss_fell([*falling[:-1], math.inf], window=10)


def test_demo_markov_chain_data():
    """The generated data follows its chain: every step a listed successor, the same chain and batch per seed."""
    import torch

    chain = train_demo.MarkovChain.random(vocab=64, branching=3, seed=5)
    assert chain.successors.shape == (64, 3)
    assert all(len(set(row.tolist())) == 3 for row in chain.successors)
    assert torch.equal(chain.successors, train_demo.MarkovChain.random(64, 3, seed=5).successors)
    ids = chain.sample(8, 20, torch.Generator().manual_seed(0))
    assert ids.shape == (8, 20) and ids.dtype == torch.long
    for row in ids.tolist():
        assert all(b in chain.successors[a].tolist() for a, b in zip(row, row[1:]))
    assert torch.equal(ids, chain.sample(8, 20, torch.Generator().manual_seed(0)))
    assert chain.entropy == pytest.approx(math.log(3))
