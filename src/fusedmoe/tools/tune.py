"""``fusedmoe tune``: search GEMM block configs for model presets on this GPU and write config files.

What is timed is what users run: the whole fused call (alignment, both GEMMs, quantization, reduce) captured
in a CUDA graph, several calls with their own routing per graph, median over replays, with one config pinned.
The search is a coordinate descent over a curated candidate list (Hopper-minded tiles, patterned on tuned
H200 tables): for each M and each plausible BLOCK_M, GEMM1's tile is chosen with GEMM2's held at the
heuristic, then GEMM2's with GEMM1's best; the fastest pair over the BLOCK_M options wins.

Failures are reported, never hidden: every candidate that raises (or that the shared-memory estimate rules out)
is printed with its reason, counted in the table's ``_source`` and listed under ``_failures``; when every
candidate of one class (one GEMM at one BLOCK_M for one M) fails, tuning stops with an error and exit status 1
instead of writing a table that silently holds the survivors.

With ``--jobs N`` the kernels of every candidate are compiled first by N worker processes (Triton's on-disk
cache then serves the timing process), which turns a preset's minutes of serial compilation into seconds.

The result is written as ``E=..,N=..,device_name=..[,dtype=fp8_w8a8[,per_token|,block_shape=[..]]].json`` (MXFP4:
``,dtype=mxfp4_w4a16``) with ``gemm1``/``gemm2`` entries per M.

Between neighbouring token counts a < b whose configs differ, the two configs are then timed at a few counts in
between (:func:`switch_probes`) and the table records, under ``_switch``, from which count b's config is used
(:func:`measure_switches`; the lookup is :func:`fusedmoe.ops.configs.pick_key`). ``--switches`` measures only
those, for tables already written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

DEFAULT_M = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 8192, 16384)
DTYPES = ("bf16", "fp8_tensor", "fp8_token", "fp8_block", "mxfp4", "mxfp4_mma")

# (block_n, block_k, group_m, num_warps, num_stages) per BLOCK_M; GEMM1 tiles cover gate and up (two
# accumulators), so they are half as wide as GEMM2's for the same registers.
# Decode-sized one-row blocks (multiply-adds, no dot; MXFP4 and fp8), the same for both GEMMs: narrow N tiles,
# 8 warps keep registers < 128.
_ONE_ROW = [(16, 256, 8, 8, 2), (32, 256, 8, 8, 2), (16, 512, 8, 8, 2), (16, 128, 8, 4, 2), (16, 256, 1, 8, 2)]
_GEMM1 = {
    1: _ONE_ROW,
    16: [
        (32, 128, 1, 4, 4),
        (64, 128, 1, 4, 3),
        (16, 128, 1, 4, 4),
        (64, 64, 1, 4, 5),
        (32, 256, 1, 4, 3),
        (16, 256, 1, 4, 3),
        (128, 128, 1, 8, 3),
    ],
    32: [(64, 128, 8, 4, 3), (128, 128, 8, 8, 3), (64, 64, 8, 4, 4), (32, 128, 8, 4, 4)],
    64: [(64, 64, 8, 4, 4), (128, 64, 8, 8, 3), (64, 128, 8, 4, 3), (128, 128, 8, 8, 2)],
    128: [(128, 64, 16, 8, 4), (128, 64, 16, 8, 3), (64, 64, 16, 4, 4), (64, 128, 16, 8, 3), (128, 128, 16, 8, 2)],
}
_GEMM2 = {
    1: _ONE_ROW,
    16: [
        (64, 128, 1, 4, 4),
        (128, 128, 1, 4, 3),
        (32, 128, 1, 4, 4),
        (64, 256, 1, 4, 3),
        (128, 64, 1, 4, 4),
        (32, 256, 1, 4, 3),
        (256, 128, 1, 8, 2),
    ],
    32: [(128, 128, 8, 4, 3), (256, 128, 8, 8, 2), (128, 64, 8, 4, 4), (64, 128, 8, 4, 4)],
    64: [(128, 64, 8, 4, 4), (256, 64, 8, 8, 3), (128, 128, 8, 4, 3), (64, 64, 8, 4, 4)],
    128: [(256, 64, 16, 8, 4), (256, 64, 16, 8, 3), (128, 64, 16, 8, 4), (128, 128, 16, 8, 3), (256, 128, 16, 8, 3)],
}


# mma-layout MXFP4 (weights first: a tile's weight rows are the tensor cores' M, its token rows their N), for every
# BLOCK_M: GEMM1's BLOCK_N counts output columns (a tile reads their gate and up rows, 2 x BLOCK_N weight rows); one
# warpgroup per 128 weight rows; BLOCK_K a multiple of 64 (the layout's chunk).
_MMA_GEMM1 = [(64, 128, 8, 4, 4), (128, 128, 8, 8, 4), (32, 128, 8, 4, 4), (64, 256, 8, 4, 3), (128, 128, 8, 8, 3)]
_MMA_GEMM2 = [(128, 128, 8, 4, 4), (256, 128, 8, 8, 4), (64, 128, 8, 4, 4), (128, 256, 8, 4, 3), (256, 128, 8, 8, 3)]


class TuneError(RuntimeError):
    """A whole class of candidates failed: the search cannot tell good tiles from broken ones."""


@dataclass(frozen=True)
class Failure:
    """One candidate that did not produce a time: where, which tile, and why."""

    M: int
    gemm: str
    block_m: int
    config: dict
    reason: str

    def __str__(self) -> str:
        return f"M={self.M} {self.gemm} BLOCK_M={self.block_m} {self.config}: {self.reason}"


def failure_reason(err: BaseException) -> str:
    """One line naming an exception: its type and the first line of its message."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first[:200]}" if first else type(err).__name__


def block_m_options(M: int, top_k: int, E: int, decode_rows: float = 0.0, scaled_k_tiles: bool = False) -> list[int]:
    """Plausible BLOCK_M values for M tokens: by the average rows per expert (up to ``decode_rows`` of them, also
    one-row blocks: the multiply-add K loop over the slots in their own order, two launches instead of four; the
    quantized dtypes offer them up to TUNE_DECODE_ROWS, since their calls at decode read fewer weight bytes than a
    16-row dot tile can use, bf16 up to SLOT_TUNE_ROWS, where one-row blocks read each expert's weights about once;
    ``scaled_k_tiles``: fp8_block, whose per-K-tile scaling keeps a second accumulator live, so 64-row tiles stay
    candidates at every M)."""
    rows = M * top_k / max(E, 1)
    if rows <= decode_rows:
        return [1, 16]  # (4-row blocks exist but convert layouts every K tile: compile_probe)
    if rows <= 2:
        return [16]
    if rows <= 8:
        return [16, 32]
    if rows <= 32:
        return [32, 64]
    if rows <= 128 or scaled_k_tiles:
        return [64, 128]
    return [128]


def candidates(
    table: dict, block_m: int, fp8: bool, n: int, k: int, bk_cap: int | None, quick: bool, quant_mode: str | None = None
):
    """GemmConfigs for one GEMM: the curated tiles, fp8 with doubled BLOCK_K, clipped to the problem."""
    from ..ops.configs import GemmConfig, weight_tma

    seen, out = set(), []
    for bn, bk, g, w, s in table[block_m][: 3 if quick else None]:
        if fp8:
            bk = min(2 * bk, 256)
        if bk_cap is not None:
            while bk > bk_cap or bk_cap % bk:
                bk //= 2
        bn = min(bn, max(16, 1 << (max(n, 1) - 1).bit_length()))
        bk = min(bk, max(16, 1 << (max(k, 1) - 1).bit_length()))
        cfg = GemmConfig(block_m, bn, bk, g, w, s, tma=weight_tma(block_m, quant_mode))
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return out


def tune_m(
    M: int,
    block_ms: Iterable[int],
    gemm1_candidates: Callable[[int], list],
    gemm2_candidates: Callable[[int], list],
    gemm2_base: Callable[[int], object],
    time_config: Callable[[object], float],
    fits: Callable[[object, str], str | None],
    failures: list[Failure],
):
    """Coordinate descent for one M; returns (best us, best MoEConfig).

    ``time_config(cfg)`` times a MoEConfig (raising on failure); ``fits(gemm_config, "gemm1"|"gemm2")`` returns
    why a tile cannot run (None if it can). Every failure is appended to ``failures``.

    Raises:
        TuneError: every candidate of one GEMM at one BLOCK_M failed.
    """
    from ..ops.configs import MoEConfig

    def score(cands, make, gemm, bm):
        scored, lost = [], []
        for g in cands:
            why = fits(g, gemm)
            if why is None:
                try:
                    scored.append((time_config(make(g)), g))
                    continue
                except Exception as err:  # noqa: BLE001 - every failure is recorded and reported
                    why = failure_reason(err)
            f = Failure(M, gemm, bm, g.to_dict(), why)
            lost.append(f)
            print(f"  failed: {f}", flush=True)
        failures.extend(lost)
        if not scored:
            raise TuneError(f"M={M}: all {len(lost)} {gemm} candidates with BLOCK_M={bm} failed: {_tally(lost)}")
        return min(scored, key=lambda s: s[0])

    best = None
    for bm in block_ms:
        g2 = gemm2_base(bm)
        t1, g1 = score(gemm1_candidates(bm), lambda g, g2=g2: MoEConfig(g, g2), "gemm1", bm)
        t2, g2b = score(gemm2_candidates(bm), lambda g, g1=g1: MoEConfig(g1, g), "gemm2", bm)
        t, cfg = (t2, MoEConfig(g1, g2b)) if t2 <= t1 else (t1, MoEConfig(g1, g2))
        if best is None or t < best[0]:
            best = (t, cfg)
    return best


def switch_probes(a: int, b: int, n: int = 3) -> list[int]:
    """Up to ``n`` token counts strictly between ``a`` and ``b``, spaced geometrically, ascending."""
    points = {round(a * (b / a) ** (i / (n + 1))) for i in range(1, n + 1)}
    return sorted(m for m in points if a < m < b)


def switch_point(b: int, probes: list[int], upper_wins: list[bool]) -> int:
    """The first probe from which the upper config (b's) won at every later probe; ``b`` when the lower config won
    at the last probe. Below the first probe the lower config stays (nothing was measured there)."""
    switch = b
    for m, won in zip(reversed(probes), reversed(upper_wins)):
        if not won:
            break
        switch = m
    return switch


def measure_switches(table: dict, time_at: Callable[[int, object], float], n: int = 3) -> dict[int, int]:
    """Switch points of ``table`` (M -> MoEConfig): for neighbouring keys a < b with different configs, b's config
    is timed against a's at :func:`switch_probes` (``time_at(M, cfg)`` in µs; ties go to b). A config that raises
    at a probe loses there (printed); a probe where both raise is left out. Returns {b: first M that takes b}."""
    keys = sorted(table)
    switches = {}
    for a, b in zip(keys, keys[1:]):
        if table[a] == table[b]:
            continue
        probes, wins = [], []
        for m in switch_probes(a, b, n):
            times = []
            for key in (a, b):
                try:
                    times.append(time_at(m, table[key]))
                except Exception as err:  # noqa: BLE001 - reported; the other config wins this probe
                    print(f"  switch probe M={m}: the config of M={key} failed: {failure_reason(err)}", flush=True)
                    times.append(None)
            if times == [None, None]:
                continue
            probes.append(m)
            wins.append(times[0] is None or (times[1] is not None and times[1] <= times[0]))
        if probes:
            switches[b] = switch_point(b, probes, wins)
    return switches


def _tally(failures: list[Failure]) -> str:
    """'kx reason; jx other reason', most common first."""
    return "; ".join(f"{n}x {r}" for r, n in Counter(f.reason for f in failures).most_common())


def describe_failures(failures: list[Failure]) -> str:
    """'N candidates failed (k x reason, ...)' or 'no candidate failed'."""
    if not failures:
        return "no candidate failed"
    return f"{len(failures)} candidates failed ({_tally(failures)})"


# ---- the GPU side ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fusedmoe tune", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--preset", required=True, help="model preset(s), comma-separated, or 'all' (the presets whose tables we ship)"
    )
    ap.add_argument("--dtype", default="bf16", help=f"comma-separated of {DTYPES}, or 'all'")
    ap.add_argument("--out", default=None, help="output folder (default: the packaged fusedmoe/configs)")
    ap.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="comma-separated token counts")
    ap.add_argument("--quick", action="store_true", help="fewer candidates (first 3 per BLOCK_M)")
    ap.add_argument("--jobs", type=int, default=0, help="processes compiling every candidate first (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the entries of an existing output file for the token counts not tuned now (re-tune some M only)",
    )
    ap.add_argument(
        "--switches",
        action="store_true",
        help="no search: measure the switch points between the entries of the existing output files",
    )
    return ap


def merged_table(path: Path, table: dict, source: str, stand_ins: Sequence[Path] = ()) -> tuple[dict, str]:
    """(table, source) to write at ``path``: ``table`` over the entries of the file already there, else of the first
    ``stand_ins`` file there is (another device's table that this device reads without one of its own, see
    ``configs.table_devices``); the entries of the token counts ``table`` does not hold are kept, and the source
    names both runs. No file: ``table`` as is."""
    existing = next((e for e in map(_read_table, (path, *stand_ins)) if e is not None), None)
    if existing is None:
        return table, source
    old, old_source, _ = existing
    kept = {m: cfg for m, cfg in old.items() if m not in table}
    if not kept:
        return table, source
    ms = ",".join(str(m) for m in sorted(table))
    return {**kept, **table}, f"{source}; M={ms} merged into: {old_source}"


#: What ``--switches`` appends to a table's ``_source`` (once: a later run replaces it), before the GPU's name.
_SWITCHES_NOTE = "; switch points measured by fusedmoe tune --switches on "


def _read_table(path: Path) -> tuple[dict, str, list] | None:
    """(entries, source, failures) of a written table, or None when ``path`` holds none."""
    from ..ops.configs import MoEConfig

    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    entries = {int(k): MoEConfig.from_dict(v) for k, v in raw.items() if not k.startswith("_")}
    if not entries:
        return None
    return entries, raw.get("_source", "an untitled table"), raw.get("_failures", [])


def _calls_per_graph(M: int, top_k: int) -> tuple[int, int]:
    """(calls per graph, replays): many short calls at decode, few long ones at prefill."""
    slots = M * top_k
    if slots <= 2048:
        return 10, 10
    if slots <= 16384:
        return 4, 6
    return 2, 4


@dataclass(frozen=True)
class Target:
    """One table to tune: a preset's layer shape (E experts held on the GPU) and a dtype."""

    preset: str
    dtype: str
    E: int
    k: int
    H: int
    I: int

    @classmethod
    def of(cls, preset_name: str, dtype: str, max_experts: int | None = None) -> Target:
        from .presets import get_preset

        pr = get_preset(preset_name)
        E = min(pr.experts_on_gpu, max_experts or pr.experts_on_gpu)
        return cls(preset_name, dtype, E, min(pr.top_k, E), pr.hidden_size, pr.intermediate_size)

    @property
    def quant(self):
        from ..quant import QuantConfig

        return None if self.dtype == "bf16" else QuantConfig.parse(self.dtype)

    @property
    def block_shape(self):
        return self.quant.block_shape if self.dtype == "fp8_block" else None

    @property
    def decode_rows(self) -> float:
        """Rows per expert up to which one-row blocks are candidates (see :func:`block_m_options`); none for the
        mma-layout MXFP4 weights, whose loop needs 16-row tiles."""
        from ..ops.configs import SLOT_TUNE_ROWS, TUNE_DECODE_ROWS

        return {"bf16": SLOT_TUNE_ROWS, "mxfp4_mma": 0.0}.get(self.dtype, TUNE_DECODE_ROWS)

    def search_space(self, ms, quick: bool) -> dict[int, tuple[list[int], dict, dict]]:
        """Per M: (BLOCK_M options, GEMM1 candidates per BLOCK_M, GEMM2 candidates per BLOCK_M)."""
        fp8 = self.quant is not None and self.quant.fp8
        bk_cap = self.block_shape[1] if self.block_shape else None
        mma = self.dtype == "mxfp4_mma"
        space = {}
        for M in ms:
            bms = block_m_options(M, self.k, self.E, self.decode_rows, scaled_k_tiles=self.dtype == "fp8_block")
            mode = self.quant.kernel_mode if self.quant is not None else None
            t1, t2 = ({bm: _MMA_GEMM1 for bm in bms}, {bm: _MMA_GEMM2 for bm in bms}) if mma else (_GEMM1, _GEMM2)
            c1 = {bm: candidates(t1, bm, fp8, self.I, self.H, bk_cap, quick, mode) for bm in bms}
            c2 = {bm: candidates(t2, bm, fp8, self.H, self.I, bk_cap, quick, mode) for bm in bms}
            space[M] = (bms, c1, c2)
        return space


class _Data:
    """Weights of a target on the GPU and routed calls of the fused layer."""

    def __init__(self, t: Target, seed: int):
        import torch

        from ..quant import quantize_weights

        dev = torch.device("cuda")
        self.t = t
        self.gen = g = torch.Generator(device=dev).manual_seed(seed)
        w1 = torch.randn(t.E, 2 * t.I, t.H, device=dev, dtype=torch.bfloat16, generator=g) / t.H**0.5
        w2 = torch.randn(t.E, t.H, t.I, device=dev, dtype=torch.bfloat16, generator=g) / t.I**0.5
        self.extra = {}
        q = t.quant
        if q is not None:
            w1, w2, s1, s2 = quantize_weights(w1, w2, q)
            self.extra = dict(quant=q, w1_scale=s1, w2_scale=s2)
        self.w1, self.w2 = w1, w2

    def calls(self, M: int, n: int, manager):
        import torch

        from ..api import fused_moe

        t, dev = self.t, self.w1.device
        x = torch.randn(M, t.H, device=dev, dtype=torch.bfloat16, generator=self.gen)
        out = []
        for _ in range(n):
            ids = torch.rand(M, t.E, device=dev, generator=self.gen).argsort(dim=1)[:, : t.k].to(torch.int32)
            w = torch.rand(M, t.k, device=dev, generator=self.gen)
            out.append(
                lambda w=w, ids=ids: fused_moe(
                    x, self.w1, self.w2, w, ids, workspace=manager, backend="triton", **self.extra
                )
            )
        return out


#: Experts a compile worker holds (the GEMM kernels do not specialize on E; weights stay small).
_WORKER_EXPERTS = 8


def _compile_worker(task) -> tuple[int, list[str]]:
    """Run each (M, config) of one target once, so every kernel lands in Triton's on-disk cache."""
    t, seed, items = task
    import torch

    from ..ops.configs import MoEConfig, pinned_config
    from ..workspace.manager import WorkspaceManager

    data = _Data(t, seed)
    manager = WorkspaceManager(torch.device("cuda"))
    done, errors = 0, []
    for M, cfg in items:
        try:
            with pinned_config(MoEConfig.from_dict(cfg)):
                data.calls(M, 1, manager)[0]()
            done += 1
        except Exception as err:  # noqa: BLE001 - the timing pass reports it with its reason
            errors.append(failure_reason(err))
    torch.cuda.synchronize()
    return done, errors


def compile_chunks(targets: list[Target], ms, quick: bool, seed: int, fits, jobs: int) -> list[tuple]:
    """Work for :func:`_compile_worker`: every candidate kernel of every target, about ``2 * jobs`` chunks.

    A GEMM kernel depends on its own tile only, so pairing the i-th GEMM1 candidate with the i-th GEMM2 candidate
    (cycling the shorter list) compiles them all in max(n1, n2) calls per BLOCK_M; one M per BLOCK_M suffices
    (the kernels do not specialize on the token count). Workers hold a few experts only (same kernels)."""
    from ..ops.configs import MoEConfig

    per_target = []
    for t in targets:
        todo: dict[str, tuple[int, dict]] = {}
        for M, (bms, c1, c2) in t.search_space(ms, quick).items():
            for bm in bms:
                g1s = [g for g in c1[bm] if fits(t, g, "gemm1") is None]
                g2s = [g for g in c2[bm] if fits(t, g, "gemm2") is None]
                for i in range(max(len(g1s), len(g2s)) if g1s and g2s else 0):
                    cfg = MoEConfig(g1s[i % len(g1s)], g2s[i % len(g2s)]).to_dict()
                    todo.setdefault(str(cfg), (min(M, 64), cfg))
        per_target.append((Target.of(t.preset, t.dtype, max_experts=_WORKER_EXPERTS), list(todo.values())))
    total = max(1, sum(len(items) for _, items in per_target))
    chunks = []
    for small, items in per_target:
        n = max(1, -(-len(items) * 2 * jobs // total))
        per = max(1, -(-len(items) // n))
        chunks += [(small, seed, items[i : i + per]) for i in range(0, len(items), per)]
    return chunks


def _precompile(jobs: int, chunks: list[tuple]) -> None:
    """Run the chunks in ``jobs`` processes so every kernel lands in Triton's on-disk cache."""
    import multiprocessing as mp

    t0 = time.time()
    done = errs = 0
    with mp.get_context("spawn").Pool(jobs) as pool:
        for d, e in pool.imap_unordered(_compile_worker, chunks):
            done, errs = done + d, errs + len(e)
    print(
        f"precompiled {done} configs in {time.time() - t0:.0f}s with {jobs} processes ({errs} did not run; "
        "the search reports them)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        import torch
    except Exception:  # pragma: no cover
        print("fusedmoe tune: torch is not importable", file=sys.stderr)
        return 2
    from .presets import CONFIG_PRESETS, get_preset

    presets = list(CONFIG_PRESETS) if args.preset == "all" else [s for s in args.preset.split(",") if s]
    dtypes = list(DTYPES) if args.dtype == "all" else [s for s in args.dtype.split(",") if s]
    try:
        for name in presets:
            get_preset(name)
        bad = [d for d in dtypes if d not in DTYPES]
        if bad:
            raise ValueError(f"unknown dtype(s) {bad}; choose from {DTYPES} or 'all'")
        ms = sorted({int(m) for m in args.m.split(",") if m.strip()})
    except ValueError as e:
        print(f"fusedmoe tune: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("fusedmoe tune: needs a CUDA GPU (none is visible here); nothing was written", file=sys.stderr)
        return 2

    from ..experts.triton_experts import _smem_limit
    from ..ops.configs import (
        PACKAGED_DIR,
        config_file_name,
        device_name,
        heuristic_config,
        pinned_config,
        smem_bytes,
        table_devices,
        table_to_json,
    )
    from ..workspace.manager import WorkspaceManager
    from .bench.timing import graph_time_us

    limit = _smem_limit(torch.cuda.current_device())

    def fits(t: Target, g, gemm: str) -> str | None:
        w_bytes = 0.5 + 1 / 32 if t.dtype == "mxfp4_mma" else None  # packed codes and their scale bytes
        need = smem_bytes(g, 1 if t.quant is not None and t.quant.fp8 else 2, gemm == "gemm1", w_bytes=w_bytes)
        return None if need <= limit else f"skipped: shared memory estimate {need} B > {limit} B"

    targets = [Target.of(name, dtype) for name in presets for dtype in dtypes]
    if args.jobs > 0 and not args.switches:
        _precompile(args.jobs, compile_chunks(targets, ms, args.quick, args.seed, fits, args.jobs))

    out_dir = Path(args.out) if args.out else PACKAGED_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    status = 0
    for t in targets:
        t_start = time.time()
        mode = t.quant.kernel_mode if t.quant else None
        devices = table_devices(device_name())
        path = out_dir / config_file_name(t.E, t.I, devices[0], mode, t.block_shape)
        print(f"== {t.preset} {t.dtype}: E={t.E} k={t.k} H={t.H} I={t.I}", flush=True)
        if args.switches:
            existing = _read_table(path)
            if existing is None:
                print(f"fusedmoe tune: {path} holds no table; nothing to measure", file=sys.stderr, flush=True)
                status = 1
                continue
            table, source, failures_raw = existing
        data = _Data(t, args.seed)
        manager = WorkspaceManager(torch.device("cuda"))
        calls_at: dict[int, tuple] = {}

        def time_at(M, cfg, data=data, manager=manager, calls_at=calls_at, t=t):
            if M not in calls_at:
                manager.release()  # the arenas the graphs timed so far captured (those graphs are gone)
                n_calls, replays = _calls_per_graph(M, t.k)
                calls_at[M] = (data.calls(M, n_calls, manager), replays)
            calls, replays = calls_at[M]
            with pinned_config(cfg):
                return graph_time_us(calls, warmup_replays=2, replays=replays)

        if not args.switches:
            failures: list[Failure] = []
            table = {}
            try:
                for M, (bms, c1, c2) in t.search_space(ms, args.quick).items():
                    base = heuristic_config(M, t.E, t.H, t.I, t.k, mode, t.block_shape)
                    best_t, cfg = tune_m(
                        M,
                        bms,
                        c1.__getitem__,
                        c2.__getitem__,
                        lambda bm, base=base: replace(base.gemm2, block_m=bm),
                        lambda cfg, M=M: time_at(M, cfg),
                        lambda g, gemm, t=t: fits(t, g, gemm),
                        failures,
                    )
                    table[M] = cfg
                    calls_at.pop(M, None)
                    print(f"M={M:>6}: {best_t:9.1f} us  {cfg.to_dict()}  ({time.time() - t_start:.0f}s)", flush=True)
            except TuneError as e:
                print(f"fusedmoe tune: {t.preset} {t.dtype}: {e}; no table written", file=sys.stderr, flush=True)
                status = 1
                continue
            source = (
                f"fusedmoe tune --preset {t.preset} --dtype {t.dtype} on {torch.cuda.get_device_name()} (whole "
                f"fused call, CUDA graph); {describe_failures(failures)}"
            )
            if args.merge:
                stand_ins = [out_dir / config_file_name(t.E, t.I, d, mode, t.block_shape) for d in devices[1:]]
                table, source = merged_table(path, table, source, stand_ins)
            failures_raw = [vars(f) for f in failures]
        switches = measure_switches(table, time_at)
        shown = ", ".join(f"{b}: from {m}" for b, m in sorted(switches.items()))
        print(f"switch points ({time.time() - t_start:.0f}s): {shown or 'none'}", flush=True)
        if args.switches:
            source = source.split(_SWITCHES_NOTE)[0] + f"{_SWITCHES_NOTE}{torch.cuda.get_device_name()}"
        path.write_text(table_to_json(table, source, failures=failures_raw, switches=switches))
        print(f"wrote {path} ({len(switches)} switch points, {time.time() - t_start:.0f}s)", flush=True)
        del data, calls_at
        torch.cuda.empty_cache()
    return status


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
