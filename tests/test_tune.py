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
    assert block_m_options(1, 4, 32, decode_blocks=True) == [1, 16] == block_m_options(8, 4, 32, decode_blocks=True)
    assert block_m_options(32, 4, 32, decode_blocks=True) == [1, 16]  # 4 rows per expert: still one-row blocks
    assert 1 not in block_m_options(64, 4, 32, decode_blocks=True) and block_m_options(1, 4, 32) == [16]


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
    assert Target.of("qwen3-30b-a3b", "bf16").search_space([1], quick=True)[1][0] == [16]


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
    """Shipped 2-byte / fp8 configs already fit and come back unchanged."""
    for name, key, cfg in _shipped_configs():
        elem = 1 if "fp8" in name else 2
        assert fit_smem(cfg, elem) == cfg, (name, key)


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
