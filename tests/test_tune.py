"""The tuner's search reports every failed candidate and stops when a whole class fails; tiles are fitted to the
element size so float32 problems do not ask for more shared memory than a Hopper GPU has."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fusedmoe.ops.configs import (
    DEFAULT_SMEM,
    PACKAGED_DIR,
    GemmConfig,
    MoEConfig,
    fit_smem,
    pick_key,
    smem_bytes,
    table_to_json,
)
from fusedmoe.tools.tune import (
    _GEMM1,
    _GEMM2,
    Failure,
    TuneError,
    block_m_options,
    candidates,
    describe_failures,
    measure_switches,
    switch_point,
    switch_probes,
    tune_m,
)


def _space(bm):
    return candidates(_GEMM1, bm, False, 768, 2048, None, False), candidates(_GEMM2, bm, False, 2048, 768, None, False)


def _search(time_config, fits=lambda g, gemm: None, block_ms=(16, 32)):
    failures: list[Failure] = []
    base = GemmConfig(16, 64, 64)
    best = tune_m(
        8,
        block_ms,
        lambda bm: _space(bm)[0],
        lambda bm: _space(bm)[1],
        lambda bm: replace(base, block_m=bm),
        time_config,
        fits,
        failures,
    )
    return best, failures


def test_every_block_m_is_really_tried():
    """The second BLOCK_M option wins when it is faster (before the launch-keyed plans, every BLOCK_M after the
    first failed and was scored as infinitely slow)."""
    (t, cfg), failures = _search(lambda c: 10.0 if c.block_m == 32 else 20.0)
    assert cfg.block_m == 32 and t == 10.0 and not failures


def test_failures_are_recorded_with_their_reason(capsys):
    def time_config(c):
        if c.gemm1.block_n == 64:
            raise RuntimeError("out of resources: shared memory, Required: 300000\nmore detail")
        return float(c.gemm1.block_n + c.gemm2.block_n)

    (t, cfg), failures = _search(time_config)
    assert failures and all(
        f.reason == "RuntimeError: out of resources: shared memory, Required: 300000" for f in failures
    )
    assert all(f.config["BLOCK_SIZE_N"] == 64 and f.gemm == "gemm1" for f in failures)
    assert cfg.gemm1.block_n != 64
    assert "failed: M=8 gemm1" in capsys.readouterr().out
    text = describe_failures(failures)
    assert text.startswith(f"{len(failures)} candidates failed") and "RuntimeError" in text


def test_a_whole_class_failing_stops_the_search():
    def time_config(c):
        if c.block_m == 32:
            raise ValueError("scratch buffer must be contiguous int32 with >= (268,) elements")
        return 1.0

    with pytest.raises(TuneError, match=r"M=8: all \d+ gemm1 candidates with BLOCK_M=32 failed: \d+x ValueError"):
        _search(time_config)


def test_candidates_ruled_out_by_shared_memory_are_reported():
    def fits(g, gemm):
        return "skipped: shared memory" if g.block_k == 128 else None

    (_, cfg), failures = _search(lambda c: 1.0, fits)
    assert cfg.gemm1.block_k != 128 and failures and all(f.reason == "skipped: shared memory" for f in failures)
    with pytest.raises(TuneError, match="skipped: shared memory"):
        _search(lambda c: 1.0, lambda g, gemm: "skipped: shared memory")


def test_table_records_failures():
    f = Failure(8, "gemm1", 16, GemmConfig(16, 64, 128).to_dict(), "RuntimeError: boom")
    body = json.loads(
        table_to_json({8: MoEConfig.simple(16, 32, 64)}, "src; " + describe_failures([f]), failures=[vars(f)])
    )
    assert body["_source"].endswith("1 candidates failed (1x RuntimeError: boom)")
    assert body["_failures"][0]["reason"] == "RuntimeError: boom" and "8" in body


def test_block_m_options_cover_the_grid():
    assert block_m_options(1, 8, 128) == [16] and block_m_options(4096, 8, 128) == [128]
    assert block_m_options(4096, 8, 128, scaled_k_tiles=True) == [64, 128]  # fp8_block: 128-row tiles spill
    assert block_m_options(64, 8, 128) == [16, 32]  # 4 rows per expert: two plausible tiles
    # quantized dtypes also try the multiply-add loops' decode-sized blocks, up to TUNE_DECODE_ROWS rows per expert
    assert block_m_options(1, 4, 32, decode_rows=4) == [1, 16] == block_m_options(8, 4, 32, decode_rows=4)
    assert block_m_options(32, 4, 32, decode_rows=4) == [1, 16]  # 4 rows per expert: still one-row blocks
    assert 1 not in block_m_options(64, 4, 32, decode_rows=4) and block_m_options(1, 4, 32) == [16]


def test_mxfp4_search_space():
    """gpt-oss-20b in MXFP4: decode-sized candidates at small M, K tiles of whole scale groups and not doubled
    (the activations are bf16, not fp8)."""
    from fusedmoe.tools.tune import DTYPES, Target

    assert "mxfp4" in DTYPES
    t = Target.of("gpt-oss-20b", "mxfp4")
    assert t.quant.mode == "mxfp4" and t.block_shape is None
    space = t.search_space([1, 4096], quick=False)
    bms, c1, c2 = space[1]
    assert bms == [1, 16] and [g.block_k for g in c1[1]] == [bk for _, bk, *_ in _GEMM1[1]]
    assert all(g.block_m == 1 and g.block_k % 32 == 0 for g in c1[1] + c2[1])
    assert space[4096][0] == [128]
    assert Target.of("qwen3-30b-a3b", "fp8_block").search_space([1], quick=True)[1][0] == [1, 16]
    # bf16 tries one-row blocks (the two-launch slot-order GEMMs) up to one row per expert: qwen3's M = 16
    bf16 = Target.of("qwen3-30b-a3b", "bf16").search_space([1, 16, 32], quick=True)
    assert bf16[1][0] == [1, 16] == bf16[16][0] and 1 not in bf16[32][0]
    assert 1 not in Target.of("gpt-oss-20b", "mxfp4_mma").search_space([1], quick=True)[1][0]


# ---- tiles fitted to the element size ------------------------------------------------------------------------
def _shipped_configs():
    for path in sorted(Path(PACKAGED_DIR).glob("*.json")):
        for key, val in json.loads(path.read_text()).items():
            if not key.startswith("_"):
                yield path.name, key, MoEConfig.from_dict(val)


def test_float32_tiles_fit_in_shared_memory():
    """Every shipped config, applied to float32 operands, is shrunk to fit; BLOCK_M (which sizes the plan) stays."""
    n = 0
    for name, key, cfg in _shipped_configs():
        fitted = fit_smem(cfg, 4)
        assert fitted.block_m == cfg.block_m, (name, key)
        assert smem_bytes(fitted.gemm1, 4, True) <= DEFAULT_SMEM and smem_bytes(fitted.gemm2, 4, False) <= DEFAULT_SMEM
        n += 1
    assert n > 50


def test_configs_that_fit_are_left_alone():
    """Shipped 2-byte / fp8 / mma-layout MXFP4 configs already fit and come back unchanged."""
    for name, key, cfg in _shipped_configs():
        elem = 1 if "fp8" in name else 2
        w_bytes = 0.5 + 1 / 32 if "layout=mma" in name else None  # packed codes and a scale byte per 32
        assert fit_smem(cfg, elem, w_bytes=w_bytes) == cfg, (name, key)


def test_fit_smem_order():
    """BLOCK_K halves first, then stages drop, then BLOCK_N halves."""
    cfg = MoEConfig.simple(128, 128, 128, num_stages=4)
    f = fit_smem(cfg, 4, limit=2 * (128 * 32 + 2 * 32 * 128) * 4)
    assert (f.gemm1.block_k, f.gemm1.num_stages, f.gemm1.block_n) == (32, 2, 128)


def test_fit_smem_counts_the_output_tile_of_a_flattened_persistent_grid():
    """On a flattened persistent grid the output tile goes through shared memory while the next tile's loads
    are in flight: it adds to the stages instead of reusing them, in the output's element size."""
    g = GemmConfig(128, 256, 64, 16, 8, 3, persistent=2)
    stages = 3 * (128 * 64 + 64 * 256) * 2
    assert smem_bytes(g, 2, False) == stages + 128 * 256 * 2
    assert smem_bytes(g, 1, False, out_bytes=2) == stages // 2 + 128 * 256 * 2
    assert smem_bytes(replace(g, persistent=0), 2, False) == stages
    # float32 operands and output: BLOCK_K halves, then the stages drop, until it fits
    f = fit_smem(MoEConfig(replace(g, block_n=128, interleave=True), g), 4)
    assert smem_bytes(f.gemm2, 4, False) <= DEFAULT_SMEM and smem_bytes(f.gemm1, 4, True) <= DEFAULT_SMEM
    assert (f.gemm2.block_k, f.gemm2.num_stages, f.gemm2.block_n) == (32, 2, 256)


def test_compile_chunks_cover_every_candidate_once():
    """The precompile work compiles every GEMM1 and every GEMM2 candidate that fits, of every target, in about
    2 x jobs chunks, on small-E copies of the targets."""
    from fusedmoe.tools.tune import DEFAULT_M, Target, compile_chunks

    targets = [Target.of("qwen3-30b-a3b", "bf16"), Target.of("mixtral-8x7b", "fp8_block")]
    fits = lambda t, g, gemm: None if g.block_k < 256 else "skipped"  # noqa: E731
    chunks = compile_chunks(targets, DEFAULT_M, False, 0, fits, jobs=14)
    assert 14 <= len(chunks) <= 40 and all(c[0].E <= 8 for c in chunks)
    for t in targets:
        g1 = {MoEConfig.from_dict(cfg).gemm1 for c in chunks if c[0].preset == t.preset for _, cfg in c[2]}
        g2 = {MoEConfig.from_dict(cfg).gemm2 for c in chunks if c[0].preset == t.preset for _, cfg in c[2]}
        want1 = {
            g
            for M, (bms, c1, _) in t.search_space(DEFAULT_M, False).items()
            for bm in bms
            for g in c1[bm]
            if fits(t, g, "gemm1") is None
        }
        want2 = {
            g
            for M, (bms, _, c2) in t.search_space(DEFAULT_M, False).items()
            for bm in bms
            for g in c2[bm]
            if fits(t, g, "gemm2") is None
        }
        assert g1 == want1 and g2 == want2


def test_merge_keeps_the_token_counts_not_retuned(tmp_path):
    """`tune --merge`: a re-tune of some M replaces those entries of the existing file and keeps the others."""
    from fusedmoe.tools.tune import merged_table

    path = tmp_path / "E=8,N=64,device_name=X.json"
    old = {1: MoEConfig.simple(16, 32, 64), 64: MoEConfig.simple(32, 64, 64), 4096: MoEConfig.simple(128, 128, 64)}
    path.write_text(table_to_json(old, "first run"))
    new = {1: MoEConfig.simple(1, 16, 256), 8: MoEConfig.simple(1, 16, 128)}
    table, source = merged_table(path, new, "second run")
    assert table == {1: new[1], 8: new[8], 64: old[64], 4096: old[4096]}
    assert source == "second run; M=1,8 merged into: first run"
    assert merged_table(tmp_path / "absent.json", new, "s") == (new, "s")
    # a device without a file of its own merges into its stand-in's table (an H100 re-tuning the H200's)
    table, source = merged_table(tmp_path / "absent.json", new, "third run", [tmp_path / "none.json", path])
    assert table == {1: new[1], 8: new[8], 64: old[64], 4096: old[4096]}
    assert source == "third run; M=1,8 merged into: first run"


def test_an_h100_reads_the_h200_tables_without_its_own(tmp_path):
    """The H100 reads the H200's tables where it has none of its own; its own file wins where there is one; other
    devices take no stand-in."""
    from fusedmoe.ops.configs import find_table, table_devices

    assert table_devices("NVIDIA_H100_80GB_HBM3") == ["NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"]
    assert table_devices("NVIDIA_H200") == ["NVIDIA_H200"] and table_devices("cpu") == ["cpu"]
    shipped = find_table(128, 1536, "NVIDIA_H200")
    assert shipped is not None and find_table(128, 1536, "NVIDIA_H100_80GB_HBM3") == shipped
    assert find_table(128, 1536, "NVIDIA_A100-SXM4-80GB") is None
    # qwen3-30b-a3b bf16 ships an H100 table of its own
    assert find_table(128, 768, "NVIDIA_H100_80GB_HBM3") != find_table(128, 768, "NVIDIA_H200")
    own = {1: MoEConfig.simple(1, 16, 128), 64: MoEConfig.simple(16, 64, 64)}
    (tmp_path / "E=128,N=1536,device_name=NVIDIA_H100_80GB_HBM3.json").write_text(table_to_json(own, "h100 run"))
    assert find_table(128, 1536, "NVIDIA_H100_80GB_HBM3", config_dir=str(tmp_path)).entries == own


# ---- between table entries: measured switch points ----------------------------------------------------------
def test_switch_probes_lie_strictly_between_and_ascend():
    assert switch_probes(512, 1024) == [609, 724, 861]
    assert switch_probes(2, 4) == [3]
    assert switch_probes(1, 2) == []
    for a, b in [(1, 2), (16, 24), (128, 256), (4096, 8192), (8192, 16384)]:
        ps = switch_probes(a, b)
        assert ps == sorted(set(ps)) and all(a < m < b for m in ps)


@pytest.mark.parametrize(
    "wins,want",
    [
        ([False, False, False], 1024),  # the lower config wins everywhere: b's config only from b
        ([True, True, True], 609),  # b's wins everywhere measured: from the first probe
        ([False, True, True], 724),
        ([True, False, True], 861),  # only the trailing run of wins counts
        ([True, True, False], 1024),
    ],
)
def test_switch_point_is_where_the_upper_config_keeps_winning(wins, want):
    assert switch_point(1024, [609, 724, 861], wins) == want


def test_measure_switches_times_both_neighbours_at_each_probe(capsys):
    small, big = MoEConfig.simple(64, 64, 64), MoEConfig.simple(128, 128, 64)
    table = {256: small, 512: small, 1024: big, 2048: big}
    timed = []

    def time_at(M, cfg):
        timed.append((M, cfg.gemm1.block_m))
        if cfg is big and M == 609:
            raise RuntimeError("out of resources: shared memory")
        return M * (1.0 if cfg is small else 0.9 if M > 700 else 1.1)  # the big tile pays from ~700 tokens

    switches = measure_switches(table, time_at)
    assert switches == {1024: 724}  # pairs with equal configs need no switch
    assert sorted(timed) == sorted((m, bm) for m in (609, 724, 861) for bm in (64, 128))
    assert "M=609: the config of M=1024 failed" in capsys.readouterr().out


def test_switches_round_trip_through_the_file_and_steer_the_lookup(tmp_path, monkeypatch):
    """A written ``_switch`` decides between neighbouring entries; without one the nearer key serves."""
    from fusedmoe.ops import configs

    small, big = MoEConfig.simple(64, 64, 64), MoEConfig.simple(128, 128, 64)
    table = {16: MoEConfig.simple(16, 64, 64), 512: small, 1024: big}
    name = configs.config_file_name(8, 64, "X")

    def lookup(M, switches):
        (tmp_path / name).write_text(table_to_json(table, "test", switches=switches))
        configs.clear_cache()
        return configs.get_config(M, 8, 64, 64, 2, device="X")

    monkeypatch.setenv(configs.ENV_DIR, str(tmp_path))
    try:
        assert lookup(899, {1024: 900}) == small and lookup(900, {1024: 900}) == big
        assert json.loads((tmp_path / name).read_text())["_switch"] == {"1024": 900}
        assert lookup(800, {}) == big and lookup(700, {}) == small  # nearest key, as vLLM's files are read
        assert lookup(768, {}) == small  # a tie goes to the smaller key
        assert lookup(5000, {1024: 900}) == big and lookup(1, {1024: 900}) == table[16]
        # malformed switches are ignored like malformed entries (the nearer key serves, where a switch that was
        # honoured would pick the other): outside (512, 1024], not an int
        for bad, M in (({1024: 512}, 700), ({1024: 2000}, 899), ({1024: "900"}, 899), ({1024: True}, 700)):
            assert lookup(M, bad) == (small if M == 700 else big), bad
    finally:
        monkeypatch.delenv(configs.ENV_DIR)
        configs.clear_cache()


def test_pick_key_edges():
    keys = [1, 2, 4, 1024]
    assert [pick_key(keys, {}, m) for m in (1, 3, 4, 0, 5000)] == [1, 2, 4, 1, 1024]
    assert pick_key(keys, {1024: 5}, 5) == 1024 and pick_key(keys, {1024: 6}, 5) == 4
    assert pick_key([64], {}, 1) == 64


def _fake_gpu(monkeypatch):
    """What ``fusedmoe tune``'s main needs from a GPU, faked: a call takes M x (1.1 below 700 tokens, else 0.9) µs
    with 128-row tiles and M µs with any other (so 128-row tiles pay from ~700 tokens)."""
    import torch

    import fusedmoe.experts.triton_experts as te
    import fusedmoe.ops.configs as configs
    import fusedmoe.tools.bench.timing as timing
    import fusedmoe.tools.tune as tune
    import fusedmoe.workspace.manager as manager

    class Data:
        def __init__(self, t, seed):
            pass

        def calls(self, M, n, mgr):
            return [M] * n

    def graph_time_us(calls, **kw):
        M, bm = calls[0], configs.source_key()[0].gemm1.block_m
        return M * ((1.1 if M < 700 else 0.9) if bm == 128 else 1.0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(te, "_smem_limit", lambda i: DEFAULT_SMEM)
    monkeypatch.setattr(configs, "device_name", lambda *a: "Fake_GPU")
    cpu_manager = manager.WorkspaceManager
    monkeypatch.setattr(manager, "WorkspaceManager", lambda *a, **k: cpu_manager("cpu"))
    monkeypatch.setattr(tune, "_Data", Data)
    monkeypatch.setattr(timing, "graph_time_us", graph_time_us)


def test_tune_writes_measured_switch_points(tmp_path, monkeypatch, capsys):
    """``fusedmoe tune`` (GPU faked): the search's table gets the switch points measured between its entries, and
    ``--switches`` measures them again for a written table, replacing its earlier note."""
    from fusedmoe.ops.configs import config_file_name
    from fusedmoe.tools.tune import main

    _fake_gpu(monkeypatch)
    path = tmp_path / config_file_name(128, 768, "Fake_GPU")
    assert main(["--preset", "qwen3-30b-a3b", "--m", "512,1024", "--quick", "--out", str(tmp_path)]) == 0
    written = json.loads(path.read_text())
    assert written["512"]["gemm1"]["BLOCK_SIZE_M"] < 128 and written["1024"]["gemm1"]["BLOCK_SIZE_M"] == 128
    assert written["_switch"] == {"1024": 724}  # probes 609, 724, 861; 128-row tiles win from 700
    path.write_text(table_to_json({m: MoEConfig.from_dict(written[str(m)]) for m in (512, 1024)}, "hand-made"))
    for _ in range(2):
        assert main(["--preset", "qwen3-30b-a3b", "--switches", "--out", str(tmp_path)]) == 0
    again = json.loads(path.read_text())
    assert again["_switch"] == {"1024": 724}
    assert again["_source"] == "hand-made; switch points measured by fusedmoe tune --switches on Fake GPU"
    assert main(["--preset", "mixtral-8x7b", "--switches", "--out", str(tmp_path)]) == 1  # no table to measure
    assert "holds no table" in capsys.readouterr().err


def test_shipped_tables_record_a_switch_point_between_every_pair_of_different_entries():
    """Each shipped table was measured by ``fusedmoe tune --switches``: every switch point it records is valid (none
    is dropped on loading), and every pair of neighbouring keys with different configs and a token count between
    them has one, so no lookup between entries falls back to the nearest-key rule."""
    import json

    from fusedmoe.ops.configs import _load_file

    paths = sorted(PACKAGED_DIR.glob("*.json"))
    assert paths
    for path in paths:
        raw = json.loads(path.read_text())
        table = _load_file(str(path))
        assert table.switches == {int(b): m for b, m in raw["_switch"].items()}, path.name
        keys = sorted(table.entries)
        for a, b in zip(keys, keys[1:]):
            if table.entries[a] == table.entries[b] or b - a < 2:
                continue
            m = table.switches[b]  # KeyError: a pair of different configs with no measured switch
            assert pick_key(keys, table.switches, m) == b and pick_key(keys, table.switches, m - 1) == a
