"""``fusedmoe bench model``: its runner on stand-ins for the model and ``generate`` (order, statistics, failures),
then on tiny transformers models (CPU, float32): what it reports of compilation and CUDA graphs, and ``--isolate``."""

import json
import statistics
import sys
import types

import pytest
import torch

from fusedmoe.tools import cli
from fusedmoe.tools.bench import compile_watch
from fusedmoe.tools.bench import model as model_bench


class _StandInModel:
    """What the runner reads of a model: its vocabulary, its device, and a forward giving next-token logits."""

    def __init__(self, vocab: int):
        self.config = types.SimpleNamespace(vocab_size=vocab)

    def parameters(self):
        return iter([torch.zeros(1)])

    def __call__(self, input_ids, attention_mask, logits_to_keep):
        logits = torch.zeros(input_ids.shape[0], logits_to_keep, self.config.vocab_size)
        logits[..., 1] = 1.0  # token 1, the one _fake_generate appends
        return types.SimpleNamespace(logits=logits)


def _stand_in_model(vocab: int = 50):
    return _StandInModel(vocab)


def _fake_generate(ids, new):
    return torch.cat([ids, torch.ones(ids.shape[0], new, dtype=ids.dtype)], dim=1)


def _quiet(line: str) -> None:
    pass


def _args(*argv):
    return cli.build_parser().parse_args(["bench", "model", *argv])


def test_implementations_are_interleaved_per_repeat_after_one_warm_up_each(monkeypatch):
    switched, calls = [], []  # switched: (mode, batch, impl) per switch; calls: (impl, new) per generate

    def use(model, impl, kept):
        switched.append(impl)
        return lambda: None

    def generate(model, ids, mask, new, compiled):
        calls.append((switched[-1], new, compiled))
        return _fake_generate(ids, new)

    monkeypatch.setattr(model_bench, "_use", use)
    monkeypatch.setattr(model_bench, "_generate", generate)
    impls, repeats, new = ["A", "B", "C"], 3, 5
    rows = model_bench.run(
        _stand_in_model(), impls, [1, 2], ["eager", "compiled"], prompt=4, new=new, repeats=repeats, progress=_quiet
    )
    group = impls + impls * repeats  # warm-up A B C, then A B C per repeat
    assert switched == group * 4  # per (mode, batch): eager 1, eager 2, compiled 1, compiled 2
    per_switch = {"eager": [], "compiled": []}
    for impl, n, compiled in calls:
        per_switch["compiled" if compiled else "eager"].append((impl, n))
    untimed = {"eager": 2, "compiled": new}  # compiled: every decode step, so CUDA graphs record and replay
    for mode, seen in per_switch.items():
        warm_up = [(i, untimed[mode]) for i in impls]
        repeat = [(i, n) for i in impls for n in (untimed[mode], 1, new)]  # untimed, prefill, whole
        assert seen == (warm_up + repeat * repeats) * 2
    assert [(r["mode"], r["batch"], r["impl"]) for r in rows] == [
        (m, b, i) for m in ("eager", "compiled") for b in (1, 2) for i in impls
    ]
    assert all(r["repeats"] == repeats and len(r["decode_ms_runs"]) == repeats for r in rows)


def test_medians_min_and_max_come_from_each_repeat(monkeypatch):
    now = [0.0]
    # seconds per prefill and per decode token of each implementation at each repeat (deliberately unordered)
    prefill_s = {"grouped_mm": [0.30, 0.10, 0.20], "fusedmoe": [0.05, 0.15, 0.10]}
    token_s = {"grouped_mm": [0.04, 0.02, 0.03], "fusedmoe": [0.01, 0.03, 0.02]}
    state = {"impl": None, "timed": {i: 0 for i in prefill_s}}  # timed: how many timed runs each has had

    def use(model, impl, kept):
        state["impl"] = impl
        return lambda: None

    def generate(model, ids, mask, new, compiled):
        impl = state["impl"]
        if new in (1, 7):  # the timed prefill and whole runs (the untimed ones generate 2 tokens in eager mode)
            r = state["timed"][impl] // 2
            now[0] += prefill_s[impl][r] + (new - 1) * token_s[impl][r]
            state["timed"][impl] += 1
        return _fake_generate(ids, new)

    monkeypatch.setattr(model_bench, "_use", use)
    monkeypatch.setattr(model_bench, "_generate", generate)
    rows = model_bench.run(
        _stand_in_model(), list(prefill_s), [1], ["eager"], prompt=3, new=7, repeats=3, progress=_quiet,
        clock=lambda: now[0],
    )  # fmt: skip
    by_impl = {r["impl"]: r for r in rows}
    for impl, row in by_impl.items():
        prefill_ms = [1e3 * s for s in prefill_s[impl]]
        decode_ms = [1e3 * s for s in token_s[impl]]
        assert row["prefill_ms_runs"] == pytest.approx(prefill_ms)
        assert row["decode_ms_runs"] == pytest.approx(decode_ms)
        assert row["prefill_ms"] == pytest.approx(statistics.median(prefill_ms))
        assert row["decode_ms"] == pytest.approx(statistics.median(decode_ms))
        assert (row["decode_ms_min"], row["decode_ms_max"]) == pytest.approx((min(decode_ms), max(decode_ms)))
        assert row["prefill_ms_min"] <= row["prefill_ms"] <= row["prefill_ms_max"]
        assert row["decode_ms_min"] <= row["decode_ms"] <= row["decode_ms_max"]
    # from the medians (30 and 20 ms/token), although fusedmoe's slowest repeat is grouped_mm's fastest
    assert by_impl["fusedmoe"]["vs_best_transformers"] == pytest.approx(20 / 30)
    assert by_impl["grouped_mm"]["vs_best_transformers"] == pytest.approx(1.0)
    table = {row[0]: row for row in model_bench.table_rows(rows)}
    assert table["fusedmoe"][model_bench.COLUMNS.index("decode min-max")] == "10.0-30.0"


def test_a_cell_out_of_memory_is_recorded_and_the_run_goes_on(monkeypatch):
    current = {}

    def use(model, impl, kept):
        current["impl"] = impl
        return lambda: current.pop("impl")

    def generate(model, ids, mask, new, compiled):
        if current["impl"] == "batched_mm":  # transformers' batched_mm gathers a weight copy per slot
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 126.56 GiB.\nmore")
        return _fake_generate(ids, new)

    monkeypatch.setattr(model_bench, "_use", use)
    monkeypatch.setattr(model_bench, "_generate", generate)
    said = []
    impls = ["grouped_mm", "batched_mm", "fusedmoe"]
    rows = model_bench.run(
        _stand_in_model(), impls, [1, 2], ["eager"], prompt=4, new=3, repeats=2, progress=said.append
    )
    assert [(r["impl"], r["batch"]) for r in rows] == [(i, b) for b in (1, 2) for i in impls]
    failed = [r for r in rows if r["impl"] == "batched_mm"]
    assert all(r["decode_ms"] is None and r["error"].startswith("out of memory: CUDA out of memory") for r in failed)
    assert all(r["repeats"] == 0 for r in failed)  # left out of the repeats after its warm-up failed
    ran = [r for r in rows if r["impl"] != "batched_mm"]
    assert all(r["decode_ms"] is not None and r["agreement"] == 1.0 and r["repeats"] == 2 for r in ran)
    assert all(r["vs_best_transformers"] is not None for r in ran)  # against grouped_mm, the one that ran
    assert not current  # every switch undone, the failed cells' too
    assert any("out of memory" in line for line in said)
    table = model_bench.table_rows(rows)
    agreement = model_bench.COLUMNS.index("token agreement")
    assert [row[agreement] for row in table if row[0] == "batched_mm"] == [r["error"] for r in failed]


def test_notes_name_long_verdicts_and_the_rows_that_compiled_after_warm_up():
    rows = [
        dict(model_bench._failed_row("a", "compiled", 1, "-"), cudagraphs="yes", recompiled_after_warm_up=0),
        dict(model_bench._failed_row("b", "compiled", 1, "-"), cudagraphs="skipped: " + "x" * 80,
             recompiled_after_warm_up=2, compiled_while_timed=1, cudagraphs_recorded_while_timed=3),
    ]  # fmt: skip
    for row in rows:
        row["vs_best_transformers"] = None
    lines = model_bench.notes(rows)
    assert lines == [
        "b compiled batch 1: CUDA graphs skipped: " + "x" * 80,
        "b compiled batch 1: 2 graph(s) compiled after the warm-up (1 while timed)",
        "b compiled batch 1: 3 CUDA graph(s) recorded while timed",
    ]
    verdicts = [row[model_bench.COLUMNS.index("CUDA graphs")] for row in model_bench.table_rows(rows)]
    assert verdicts[0] == "yes" and verdicts[1].endswith("...") and len(verdicts[1]) <= 48


def test_the_compile_watch_takes_inductors_cudagraph_skip_reasons():
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    with compile_watch.CompileWatch(compiled=True, on_cuda=False) as watch:
        with watch.during("fusedmoe", "warm-up"):
            log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (2 instances)")
            log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (2 instances)")
        with watch.during("grouped_mm", "warm-up"):
            pass
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to after the watch")  # not attributed
    skipped, clean = watch.tallies["fusedmoe"], watch.tallies["grouped_mm"]
    assert (skipped.skips, skipped.reasons) == (2, ["mutated inputs (2 instances)"])
    assert (clean.skips, clean.reasons) == (0, [])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compile_watch.cudagraph_verdict(cuda, skipped) == "skipped: mutated inputs (2 instances)"
    skipped.replays_per_step = 1.0
    assert compile_watch.cudagraph_verdict(cuda, skipped) == "partial, skipped: mutated inputs (2 instances)"
    assert compile_watch.cudagraph_verdict(cuda, clean).startswith("no: ")
    clean.replays_per_step = 1.0
    assert compile_watch.cudagraph_verdict(cuda, clean) == "yes"
    assert compile_watch.cudagraph_verdict(cpu, skipped) == "n/a (CPU)"


def test_the_compile_watch_counts_cuda_graph_replays_outside_the_timed_runs(monkeypatch):
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: None)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda graph, *a, **k: None)
    with compile_watch.CompileWatch(compiled=False, on_cuda=True) as watch:
        with watch.during("A", "untimed", decode_steps=4):
            for _ in range(8):  # two graphs per decode step
                torch.cuda.CUDAGraph.replay(None)
        with watch.during("A", "timed"):
            torch.cuda.CUDAGraph.capture_begin(None)  # a re-recording while timed
            torch.cuda.CUDAGraph.replay(None)
    tally = watch.tallies["A"]
    assert tally.replays_per_step == 2.0  # the timed replay not counted
    assert tally.recorded_while_timed == 1
    assert torch.cuda.CUDAGraph.replay.__name__ == "<lambda>"  # the methods are back as they were


def test_compare_logits_measures_the_difference_against_the_first_implementations_top_two_gap():
    reference = torch.tensor([[3.0, 0.0, 2.9, 0.0], [0.0, 5.0, 0.0, 1.0]])
    same = model_bench.compare_logits(reference.clone(), reference)
    assert same["rel_diff"] == 0.0 and same["argmax_differs"] == 0 and same["rows"] == 2
    row_gaps = torch.tensor([0.1 / reference[0].norm(), 4.0 / reference[1].norm()])
    assert same["top2_gap"] == pytest.approx(float(row_gaps.median()), rel=1e-5)
    flipped = reference.clone()
    flipped[0, 2] += 0.2  # a near-tie in row 0 goes the other way; row 1 keeps its token
    far = model_bench.compare_logits(flipped, reference)
    assert far["argmax_differs"] == 1
    assert far["rel_diff"] == pytest.approx(0.2 / float(reference.norm()))


def test_notes_say_where_the_next_token_differs_and_how_far_the_logits_are():
    row = {"impl": "fusedmoe", "mode": "eager", "batch": 8}
    row["first_logits"] = {"rel_diff": 0.012, "top2_gap": 0.003, "argmax_differs": 2, "rows": 8}
    assert model_bench.notes([row]) == [
        "fusedmoe eager batch 8: next token differs in 2 of 8 rows; logits 1.2e-02 apart (relative), "
        "the first implementation's top two 3.0e-03 apart (median)"
    ]
    row["first_logits"]["argmax_differs"] = 0
    assert model_bench.notes([row]) == []


# -- tiny transformers models (CPU, float32) ------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(model_bench.MODELS))
def test_every_preset_builds_tiny_generates_and_gives_next_token_logits(preset):
    pytest.importorskip("transformers")
    model = model_bench.build(preset, tiny=True, device="cpu", dtype=torch.float32)
    ids = torch.randint(1, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        out = model_bench._generate(model, ids, mask, 2, compiled=False)
        logits = model_bench._next_token_logits(model, ids, mask)
    assert out.shape == (2, 7)
    assert logits.shape == (2, model.config.vocab_size) and logits.dtype == torch.float32
    assert torch.equal(out[:, 5], logits.argmax(-1))  # the first greedy token is the argmax of these logits


@pytest.fixture
def tiny_qwen3():
    """A tiny Qwen3-MoE, run on one intra-op thread (more only add contention at this size: many times slower on
    a loaded 2-core machine), with dynamo's state fresh (the forward's compiled variants of other tests would count
    against the recompile limit)."""
    pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield model_bench.build("qwen3-30b-a3b", tiny=True, device="cpu", dtype=torch.float32)
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def test_tiny_model_rows_in_both_modes_with_cudagraphs_na_on_cpu(tiny_qwen3):
    from fusedmoe.integrations import hf

    impls = ["grouped_mm", "fusedmoe", "fusedmoe-patch"]
    rows = model_bench.run(tiny_qwen3, impls, [1], ["eager", "compiled"], prompt=4, new=3, repeats=2, progress=_quiet)
    assert [(r["mode"], r["impl"]) for r in rows] == [(m, i) for m in ("eager", "compiled") for i in impls]
    for r in rows:
        assert r["prefill_ms_min"] <= r["prefill_ms"] <= r["prefill_ms_max"]
        assert r["decode_ms_min"] <= r["decode_ms"] <= r["decode_ms_max"]
        assert r["agreement"] == 1.0  # float32: every implementation generates the same tokens
        assert r["first_logits"]["argmax_differs"] == 0 and r["first_logits"]["rel_diff"] < 1e-4
        assert r["first_logits"]["top2_gap"] > 0
        assert r["cudagraphs"] == ("n/a (CPU)" if r["mode"] == "compiled" else None)
        assert r["compiled_while_timed"] == 0
    assert not hf.patched_blocks(tiny_qwen3)  # switched back after fusedmoe-patch's last repeat


def test_fusedmoe_patch_gets_the_same_layers_back_at_each_switch(tiny_qwen3):
    from fusedmoe.integrations import hf

    kept = {}
    undo = model_bench._use(tiny_qwen3, "fusedmoe-patch", kept)
    first = [block.moe for block in hf.patched_blocks(tiny_qwen3)]
    undo()
    assert not hf.patched_blocks(tiny_qwen3)
    model_bench._use(tiny_qwen3, "grouped_mm", kept)()
    undo = model_bench._use(tiny_qwen3, "fusedmoe-patch", kept)
    again = [block.moe for block in hf.patched_blocks(tiny_qwen3)]
    assert len(again) == tiny_qwen3.config.num_hidden_layers
    assert all(a is b for a, b in zip(first, again))  # same layers, same owner keys: no recompilation
    assert tiny_qwen3.config._experts_implementation == hf.EXPERTS_IMPLEMENTATION
    undo()
    assert not hf.patched_blocks(tiny_qwen3)


def test_switching_implementations_back_and_forth_recompiles_nothing(tiny_qwen3, monkeypatch):
    """transformers compiles only on accelerators: here its compiled generate is forced on the CPU (dynamo with the
    eager backend), which is enough to see whether a switch fails dynamo's guards."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True

    def generate(model, ids, mask, new, compiled):
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        if compiled:
            kw.update(cache_implementation="static", compile_config=config)
        return model.generate(ids, attention_mask=mask, **kw)

    monkeypatch.setattr(model_bench, "_generate", generate)
    impls = ["grouped_mm", "fusedmoe", "fusedmoe-patch"]
    graphs, limit = counters["stats"]["unique_graphs"], torch._dynamo.config.recompile_limit
    rows = model_bench.run(tiny_qwen3, impls, [1], ["compiled"], prompt=4, new=3, repeats=2, progress=_quiet)
    assert counters["stats"]["unique_graphs"] - graphs >= len(impls)  # it compiled: one graph per implementation
    assert torch._dynamo.config.recompile_limit == limit  # raised for the run only
    assert [(r["impl"], r["recompiled_after_warm_up"], r["agreement"]) for r in rows] == [(i, 0, 1.0) for i in impls]


# -- main, --isolate ------------------------------------------------------------------------------------------------


def test_isolate_runs_each_mode_in_a_process_and_merges_the_rows(monkeypatch, tmp_path, capsys):
    commands = []

    def run_child(argv, mode):
        commands.append(argv)
        path = argv[argv.index("--json") + 1]
        rows = [dict(model_bench._failed_row(i, mode, 1, "stand-in"), vs_best_transformers=None) for i in ("a", "b")]
        with open(path, "w") as f:
            json.dump({"env": {}, "preset": "mixtral-8x7b", "tiny": True, "layers": 2, "rows": rows}, f)

    monkeypatch.setattr(model_bench, "_run_child", run_child)
    out = tmp_path / "merged.json"
    argv = ["--preset", "mixtral-8x7b", "--tiny", "--cpu", "--layers", "2", "--impls", "a,b", "--batches", "1"]
    argv += ["--modes", "eager,compiled", "--repeats", "2", "--isolate", "--profile", "--json", str(out)]
    assert model_bench.main(_args(*argv)) == 0
    assert [c[c.index("--modes") + 1] for c in commands] == ["eager", "compiled"]
    for command in commands:
        assert command[:5] == [sys.executable, "-m", "fusedmoe", "bench", "model"]
        assert "--isolate" not in command and {"--tiny", "--cpu", "--profile"} <= set(command)
        for option, value in (("--preset", "mixtral-8x7b"), ("--layers", "2"), ("--impls", "a,b"), ("--repeats", "2")):
            assert command[command.index(option) + 1] == value
    merged = json.loads(out.read_text())
    assert [(r["mode"], r["impl"]) for r in merged["rows"]] == [
        ("eager", "a"), ("eager", "b"), ("compiled", "a"), ("compiled", "b")
    ]  # fmt: skip
    assert merged["isolated"] is True and merged["env"]["torch"] == torch.__version__
    assert "one process per mode" in capsys.readouterr().out


def test_a_failed_mode_process_stops_the_run_with_its_stderr_tail():
    script = "import sys; sys.stderr.write(''.join(f'line {i}\\n' for i in range(40))); sys.exit(3)"
    with pytest.raises(SystemExit) as failure:
        model_bench._run_child([sys.executable, "-c", script], "compiled")
    message = str(failure.value)
    assert "--modes compiled" in message and "exited with 3" in message
    assert "line 39" in message and "line 20\n" in message and "line 19\n" not in message  # the last 20 lines


@pytest.mark.slow
def test_isolate_end_to_end_on_a_tiny_model(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the processes' torch: see tiny_qwen3
    out = tmp_path / "model.json"
    argv = ["bench", "model", "--tiny", "--cpu", "--impls", "grouped_mm,fusedmoe", "--batches", "1", "--prompt", "4"]
    argv += ["--new", "3", "--repeats", "2", "--modes", "eager,compiled", "--isolate", "--json", str(out)]
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["impl"]) for r in rows] == [
        ("eager", "grouped_mm"), ("eager", "fusedmoe"), ("compiled", "grouped_mm"), ("compiled", "fusedmoe")
    ]  # fmt: skip
    assert [r["cudagraphs"] for r in rows] == [None, None, "n/a (CPU)", "n/a (CPU)"]


def test_modes_outside_eager_and_compiled_are_refused():
    with pytest.raises(SystemExit, match="--modes must be"):
        model_bench.main(_args("--modes", "eager,graphs"))


def test_the_presets_hold_the_published_configs():
    transformers = pytest.importorskip("transformers")
    assert {"qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b"} <= set(model_bench.MODELS)
    cls_name, kwargs = model_bench.MODELS["gpt-oss-20b"]
    config = getattr(transformers, cls_name)(**kwargs)
    published = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                     num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                     num_experts_per_tok=4, sliding_window=128)  # fmt: skip
    assert {k: getattr(config, k) for k in published} == published
    assert config.layer_types == ["sliding_attention", "full_attention"] * 12
    three = getattr(transformers, cls_name)(**{**kwargs, "num_hidden_layers": 3})  # --layers 3
    assert three.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]


def test_profile_runs_one_prefill_and_one_generate_per_implementation_after_the_repeats(monkeypatch):
    """``--profile``: after the timed repeats each implementation is switched in once more and runs its untimed
    generate, then a prefill and a whole generate under the profiler; the rows carry both profiles (on a CPU: wall
    time and the operators with the most CPU time, no device figures) and the notes name them."""
    switched, calls = [], []

    def use(model, impl, kept):
        switched.append(impl)
        return lambda: None

    def generate(model, ids, mask, new, compiled):
        calls.append((switched[-1], new))
        torch.ones(64, 64) @ torch.ones(64, 64)  # something for the profiler to see
        return _fake_generate(ids, new)

    monkeypatch.setattr(model_bench, "_use", use)
    monkeypatch.setattr(model_bench, "_generate", generate)
    impls, repeats, new = ["A", "B"], 2, 4
    rows = model_bench.run(
        _stand_in_model(), impls, [1], ["eager"], prompt=3, new=new, repeats=repeats, progress=_quiet, profile=True
    )
    assert switched == impls * (1 + repeats + 1)  # warm-up, the repeats, then the profiled round
    assert calls[-6:] == [(i, n) for i in impls for n in (2, 1, new)]  # untimed, profiled prefill, profiled whole
    for r in rows:
        assert r["repeats"] == repeats  # the profiled runs are not among the timed repeats
        for phase in ("prefill", "whole"):
            p = r["profile"][phase]
            assert p["wall_ms"] > 0 and p["device_ms"] is None and p["kernels"] is None
            assert any("mm" in t["name"] for t in p["top"]) and all(t["calls"] >= 1 for t in p["top"])
    lines = model_bench.notes(rows)
    assert sum("profiled prefill" in line for line in lines) == len(impls)
    plain = model_bench.run(_stand_in_model(), impls, [1], ["eager"], prompt=3, new=new, repeats=1, progress=_quiet)
    assert all("profile" not in r for r in plain)


def test_step_profile_ranks_the_operators_by_their_own_cpu_time_on_a_cpu():
    from fusedmoe.tools.bench.profile import step_profile

    a = torch.randn(256, 256)
    p = step_profile(lambda: [a @ a for _ in range(8)] + [a + 1], torch.device("cpu"), top=2)
    assert len(p["top"]) == 2 and p["top"][0]["ms"] >= p["top"][1]["ms"]
    assert any(t["name"] in ("aten::mm", "aten::matmul") and t["calls"] == 8 for t in p["top"])
    assert p["wall_ms"] > 0 and p["device_ms"] is None


def test_running_out_of_memory_while_profiling_keeps_the_timed_figures(monkeypatch):
    """A profiled run that runs out of GPU memory records that under the row's ``profile``; the cell keeps its
    timed medians (and so the other cells' ``vs best transformers``)."""
    rounds = {"A": 0}

    def use(model, impl, kept):
        rounds[impl] = rounds.get(impl, 0) + 1
        return lambda: None

    def generate(model, ids, mask, new, compiled):
        if rounds["A"] > 3:  # warm-up and two repeats done: the profiled round
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return _fake_generate(ids, new)

    monkeypatch.setattr(model_bench, "_use", use)
    monkeypatch.setattr(model_bench, "_generate", generate)
    (row,) = model_bench.run(
        _stand_in_model(), ["A"], [1], ["eager"], prompt=3, new=4, repeats=2, progress=_quiet, profile=True
    )
    assert row["decode_ms"] is not None and row["repeats"] == 2 and "error" not in row
    assert row["profile"]["error"].startswith("out of memory")
    assert any("profile: out of memory" in line for line in model_bench.notes([row]))
