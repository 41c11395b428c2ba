"""Block-size configs of the grouped GEMMs: JSON files per (E, I, device, dtype), a heuristic, and pinning.

File names follow vLLM's: ``E={E},N={I},device_name={name}[,dtype=fp8_w8a8][,block_shape=[bn,bk]].json``
(``name`` = ``torch.cuda.get_device_name().replace(' ', '_')``), content ``{"<M>": {config}, ...}``. Keys starting
with ``_`` (e.g. ``"_source"``) are metadata. Which entry serves M (:func:`pick_key`): M's own; below the first key
or above the last, the nearest; between neighbouring keys a < b, b's entry from the token count the table's
``"_switch"`` map records for b (``{"<b>": m}``, measured by ``fusedmoe tune``: the first of a few counts between
a and b from which b's config stayed faster than a's), a's below it; without a recorded switch (vLLM's files,
tables tuned before switches existed) the nearer key, the smaller one on a tie.

A config is either vLLM's flat form ``{"BLOCK_SIZE_M": .., "BLOCK_SIZE_N": .., "BLOCK_SIZE_K": ..,
"GROUP_SIZE_M": .., "num_warps": .., "num_stages": ..}`` (unknown keys ignored) or ours, ``{"gemm1": {...},
"gemm2": {...}}`` with the same keys in each. A flat config's N tile spans gate and up columns together, so
GEMM1 (which computes a gate tile *and* an up tile per program) uses half its BLOCK_SIZE_N. BLOCK_SIZE_M is
shared (both GEMMs read the same aligned blocks): GEMM2 always takes GEMM1's.

Search order: ``$FUSEDMOE_CONFIG_DIR`` (can point at vLLM's tuned files), the packaged ``fusedmoe/configs``,
then :func:`heuristic_config`. :func:`pinned_config` overrides everything (tests pin one small config).
:func:`source_key` names what the search depends on besides the problem (the pin, the config folder), so that
callers caching anything derived from a config can key it completely.

Tiles are fitted to the element size before use (:func:`fit_smem`): a table tuned for 2-byte elements would
ask a float32 problem for twice the shared memory the GPU has.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import functools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

#: fp8_block scale groups (rows of N, columns of K), as in :class:`fusedmoe.quant.QuantConfig`.
BlockShape = tuple[int, int]

PACKAGED_DIR = Path(__file__).resolve().parent.parent / "configs"
ENV_DIR = "FUSEDMOE_CONFIG_DIR"


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch settings of one grouped GEMM (block sizes powers of two, >= 16 except BLOCK_M: 1 to 8
    rows run the multiply-add K loops instead of tensor-core dots)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    #: Weight tiles through a TMA descriptor (``expert_gemm.weight_descriptor``) instead of pointer loads, where
    #: the tile and the weights allow it. Launches with a descriptor are not replayed (``ops.launcher``).
    tma: bool = False
    #: 0: one program per tile. 1: persistent (one program per SM walks the tiles), 2: persistent with the tile loop
    #: flattened into the K loop, 3: also warp-specialized (``grouped_gemm._moe_gemm``).
    persistent: int = 0
    #: GEMM1 only: gate and up rows read as one interleaved tile, one dot of 2 x BLOCK_N columns per K tile
    #: (``expert_gemm._k_loop_gate_up``; dense, fp8_tensor and fp8_token weights, tiles of >= 16 rows).
    interleave: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> GemmConfig:
        return cls(
            block_m=int(d["BLOCK_SIZE_M"]),
            block_n=int(d["BLOCK_SIZE_N"]),
            block_k=int(d["BLOCK_SIZE_K"]),
            group_m=int(d.get("GROUP_SIZE_M", 1)),
            num_warps=int(d.get("num_warps", 4)),
            num_stages=int(d.get("num_stages", 3)),
            tma=bool(d.get("tma", False)),
            persistent=int(d.get("persistent", 0)),
            interleave=bool(d.get("interleave", False)),
        )

    def to_dict(self) -> dict[str, int]:
        d = {
            "BLOCK_SIZE_M": self.block_m,
            "BLOCK_SIZE_N": self.block_n,
            "BLOCK_SIZE_K": self.block_k,
            "GROUP_SIZE_M": self.group_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }
        if self.tma:
            d["tma"] = 1
        if self.persistent:
            d["persistent"] = self.persistent
        if self.interleave:
            d["interleave"] = 1
        return d


@dataclass(frozen=True)
class MoEConfig:
    """Configs of GEMM1 (gate/up + activation) and GEMM2 (down); ``block_m`` is shared and sets alignment."""

    gemm1: GemmConfig
    gemm2: GemmConfig

    def __post_init__(self) -> None:
        if self.gemm2.block_m != self.gemm1.block_m:
            object.__setattr__(self, "gemm2", replace(self.gemm2, block_m=self.gemm1.block_m))

    @property
    def block_m(self) -> int:
        return self.gemm1.block_m

    @classmethod
    def from_dict(cls, d: dict) -> MoEConfig:
        if "gemm1" in d:
            return cls(GemmConfig.from_dict(d["gemm1"]), GemmConfig.from_dict(d.get("gemm2", d["gemm1"])))
        flat = GemmConfig.from_dict(d)
        return cls(replace(flat, block_n=max(16, flat.block_n // 2)), flat)

    def to_dict(self) -> dict:
        return {"gemm1": self.gemm1.to_dict(), "gemm2": self.gemm2.to_dict()}

    @classmethod
    def simple(cls, block_m: int, block_n: int, block_k: int, **kw) -> MoEConfig:
        g = GemmConfig(block_m, block_n, block_k, **kw)
        return cls(g, g)


def device_name(device: torch.device | str | None = None) -> str:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        return torch.cuda.get_device_name(device).replace(" ", "_")
    return "cpu"


def quant_suffix(quant_mode: str | None, block_shape: BlockShape | None = None) -> str:
    """vLLM's suffixes (``dtype=fp8_w8a8`` is per-tensor, as vLLM tunes it) plus ``,per_token`` for per-token
    activation x per-channel weight scales, which vLLM's file names do not tell apart; ``dtype=mxfp4_w4a16`` for
    MXFP4 weights (so they never pick up an fp8 table)."""
    if quant_mode is None:
        return ""
    if quant_mode == "mxfp4":  # weight-only FP4 (w4a16): tables of its own, none shipped yet
        return ",dtype=mxfp4_w4a16"
    if quant_mode == "mxfp4_mma":  # the same weights in the mma layout: another kernel, its own tables
        return ",dtype=mxfp4_w4a16,layout=mma"
    s = ",dtype=fp8_w8a8"
    if quant_mode == "fp8_block":
        bn, bk = block_shape or (128, 128)
        s += f",block_shape=[{bn},{bk}]"
    elif quant_mode == "fp8_token":
        s += ",per_token"
    return s


def config_file_name(
    E: int, I: int, device: str, quant_mode: str | None = None, block_shape: BlockShape | None = None
) -> str:
    return f"E={E},N={I},device_name={device}{quant_suffix(quant_mode, block_shape)}.json"


#: Devices that read another device's tables when they have none of their own: the H100 (SXM: the H200's 132 SMs,
#: 228 KB of shared memory per SM, the same sm_90 tensor cores; less memory bandwidth) takes the H200's. Tiles are
#: fitted to the device's own shared memory either way (:func:`fit_smem`).
TABLE_STAND_INS = {"NVIDIA_H100": "NVIDIA_H200"}


def table_devices(device: str) -> list[str]:
    """The device names whose tables serve ``device``, in order: its own, then its stand-in's
    (:data:`TABLE_STAND_INS`, matched by name prefix)."""
    names = [device]
    for prefix, stand_in in TABLE_STAND_INS.items():
        if device.startswith(prefix) and stand_in != device:
            names.append(stand_in)
    return names


def source_key() -> tuple:
    """Everything besides the problem that :func:`get_config` depends on: the pinned config (context, then
    process-wide) and ``$FUSEDMOE_CONFIG_DIR``. Caches of values derived from configs key on it."""
    return (_PINNED.get() or _PINNED_GLOBAL[0], os.environ.get(ENV_DIR))


@dataclass(frozen=True)
class ConfigTable:
    """One config file: its entries by token count, and the measured switch points between neighbouring keys
    (upper key -> the first token count that takes its entry; only for keys of ``entries`` with a smaller key
    below, and a < switch <= b)."""

    entries: dict[int, MoEConfig]
    switches: dict[int, int]


def pick_key(keys: list[int], switches: dict[int, int], M: int) -> int:
    """The key of ``keys`` (ascending, non-empty) whose entry serves ``M`` tokens; see the module docstring."""
    i = bisect.bisect_left(keys, M)
    if i < len(keys) and keys[i] == M:
        return M
    if i == 0:
        return keys[0]
    if i == len(keys):
        return keys[-1]
    a, b = keys[i - 1], keys[i]
    switch = switches.get(b)
    if switch is not None:
        return b if M >= switch else a
    return b if b - M < M - a else a


def _switches(raw: object, keys: list[int]) -> dict[int, int]:
    """The valid entries of a file's ``"_switch"`` map (malformed ones are ignored, like malformed configs)."""
    out: dict[int, int] = {}
    if not isinstance(raw, dict):
        return out
    for key, val in raw.items():
        try:
            b, m = int(key), val
        except (TypeError, ValueError):
            continue
        if b not in keys or keys.index(b) == 0 or isinstance(m, bool) or not isinstance(m, int):
            continue
        if keys[keys.index(b) - 1] < m <= b:
            out[b] = m
    return out


@functools.lru_cache(maxsize=256)
def _load_file(path: str) -> ConfigTable | None:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    table = {}
    for key, val in raw.items():
        if key.startswith("_") or not isinstance(val, dict):
            continue
        try:
            table[int(key)] = MoEConfig.from_dict(val)
        except (KeyError, ValueError, TypeError):
            continue
    if not table:
        return None
    return ConfigTable(table, _switches(raw.get("_switch"), sorted(table)))


def load_table(
    E: int,
    I: int,
    device: str,
    quant_mode: str | None = None,
    block_shape: BlockShape | None = None,
    config_dir: str | None = None,
) -> dict[int, MoEConfig] | None:
    """The entries of the tuned table for this shape (see :func:`find_table`)."""
    found = find_table(E, I, device, quant_mode, block_shape, config_dir)
    return found.entries if found is not None else None


def find_table(
    E: int,
    I: int,
    device: str,
    quant_mode: str | None = None,
    block_shape: BlockShape | None = None,
    config_dir: str | None = None,
) -> ConfigTable | None:
    """The tuned table for this shape: first match in ``config_dir`` (default $FUSEDMOE_CONFIG_DIR), then the
    packaged dir. Per-token fp8 falls back to the per-tensor (vLLM ``dtype=fp8_w8a8``) file of the folder. In each
    folder the device's own file comes first, then its stand-in's (:func:`table_devices`)."""
    names = []
    for dev in table_devices(device):
        names.append(config_file_name(E, I, dev, quant_mode, block_shape))
        if quant_mode == "fp8_token":
            names.append(config_file_name(E, I, dev, "fp8_tensor"))
    config_dir = os.environ.get(ENV_DIR) if config_dir is None else config_dir
    dirs = [config_dir] if config_dir else []
    dirs.append(str(PACKAGED_DIR))
    for d in dirs:
        for name in names:
            table = _load_file(os.path.join(d, name))
            if table:
                return table
    return None


def _pow2_at_most(n: int, cap: int) -> int:
    """Largest power of two <= cap that is not above next_pow2(n) (at least 16)."""
    p = 16
    while p < cap and p < n:
        p *= 2
    return min(p, cap)


#: MXFP4 problems with at most this many rows per expert (on average) take one-row multiply-add blocks by default;
#: other formats only from a table or a pin (their tuned tables decide, `fusedmoe tune`). Measured on the H200
#: (BENCHMARKS.md) with the word-decode loop (864a474): one-row blocks beat 16-row dot tiles up to 1 row per
#: expert (gpt-oss-20b M=8: 331 us against 394) and lose at 2 (gpt-oss-20b M=16: 643 against 478): each row
#: decodes the weights again.
DECODE_ROWS = 1.0
#: The tuner offers decode-sized blocks up to this many rows per expert (it measures where they stop paying).
TUNE_DECODE_ROWS = 4
#: bf16 calls are offered one-row blocks (the slot-order GEMMs, :mod:`fusedmoe.ops.slot_gemm`) up to this many rows
#: per expert: beyond it, experts hold several rows whose weights a 16-row dot tile reads once and one-row tiles
#: read once per row.
SLOT_TUNE_ROWS = 1.0


#: From this many tokens the heuristic (like the shipped bf16 tables) runs both GEMMs on a flattened persistent
#: grid, which stores GEMM2's rows in the activation dtype instead of float32 (``triton_experts.y_dtype``): below
#: it, calls keep the one rounding of a float32 top-k sum.
PERSISTENT_MIN_TOKENS = 1024


def weight_tma(block_m: int, quant_mode: str | None) -> bool:
    """Whether tiles of ``block_m`` rows read unquantized weights through TMA descriptors by default (the heuristic's
    and the tuner's rule): from 64 rows, 1-7% faster at M >= 1024 on the H200; no gain measured for fp8, and
    MXFP4 takes none."""
    return quant_mode is None and block_m >= 64


def heuristic_config(
    M: int, E: int, H: int, I: int, top_k: int, quant_mode: str | None = None, block_shape: BlockShape | None = None
) -> MoEConfig:
    """A Hopper-minded default by average rows per expert (patterned on tuned H200 tables); ``block_shape`` does
    not change it (it is taken for the same call shape as :func:`get_config`)."""
    rows = M * top_k / max(E, 1)
    if quant_mode == "mxfp4_mma":
        return mma_heuristic_config(rows)
    if quant_mode == "mxfp4" and rows <= DECODE_ROWS:
        # Decode-sized MXFP4 blocks: the multiply-add K loop (no dot, so no 16-row tile mostly of padding) on one
        # row per block, narrow N tiles (more programs) and 8 warps: 64 registers per thread and no layout
        # conversion in the loop for sm_90 (compile_probe; 4-row blocks convert the weights every K tile). An
        # expert's rows read the same weight tiles: GROUP_M 8 puts their blocks next to each other in the grid, so
        # that the repeated reads can come from L2.
        g = GemmConfig(1, 16, 256, 8, 8, 2)
        g1 = replace(g, block_k=_pow2_at_most(H, g.block_k))
        g2 = replace(g, block_k=_pow2_at_most(I, g.block_k))
        return MoEConfig(g1, g2)
    fp8 = quant_mode is not None
    bk_small = 256 if fp8 else 128
    if rows <= 1:
        g1 = GemmConfig(16, 32, bk_small, 1, 4, 4)
        g2 = GemmConfig(16, 64, bk_small, 1, 4, 4)
    elif rows <= 4 or (quant_mode == "mxfp4" and rows <= 8):
        # (MXFP4 keeps 16-row tiles to 8 rows per expert: 527 us against 637 for 32-row ones, gpt-oss-20b M=64)
        g1 = GemmConfig(16, 64, bk_small, 1, 4, 3)
        g2 = GemmConfig(16, 128, bk_small, 1, 4, 3)
    elif rows <= 16:
        g1 = GemmConfig(32, 128, 128, 8, 8, 3)
        g2 = GemmConfig(32, 128, 128, 8, 4, 3)
    elif rows <= 64:
        g1 = GemmConfig(64, 64, 128 if fp8 else 64, 8, 4, 3)
        g2 = GemmConfig(64, 128, 128 if fp8 else 64, 8, 4, 3)
    elif quant_mode == "fp8_block":
        # 128-row tiles spill with a scaled partial product per K tile (qwen3 M=4096: 2167 us against 920)
        g1 = GemmConfig(64, 128, 128, 8, 8, 3)
        g2 = GemmConfig(64, 128, 128, 8, 4, 4)
    elif fp8:
        g1 = GemmConfig(128, 128, 128, 16, 8, 3)
        g2 = GemmConfig(128, 128, 128, 16, 8, 3)
    elif M >= PERSISTENT_MIN_TOKENS:
        # GEMM1's interleaved gate-up dot and both GEMMs on a flattened persistent grid: 2-15% faster per GEMM
        # than one program per tile with two dots at every point measured (M = 1024, 4096, 16384 of qwen3-30b-a3b,
        # mixtral-8x7b and deepseek-v2-lite, each GEMM timed alone on the H200)
        g1 = GemmConfig(128, 128, 64, 16, 8, 3, persistent=2, interleave=True)
        g2 = GemmConfig(128, 256, 64, 16, 8, 3, persistent=2)
    else:
        g1 = GemmConfig(128, 128, 64, 16, 8, 4)
        g2 = GemmConfig(128, 256, 64, 16, 8, 4)
    if weight_tma(g1.block_m, quant_mode):
        g1, g2 = replace(g1, tma=True), replace(g2, tma=True)
    # no wider than the problem
    g1 = replace(g1, block_n=_pow2_at_most(I, g1.block_n), block_k=_pow2_at_most(H, g1.block_k))
    g2 = replace(g2, block_n=_pow2_at_most(H, g2.block_n), block_k=_pow2_at_most(I, g2.block_k))
    return MoEConfig(g1, g2)


def mma_heuristic_config(rows: float) -> MoEConfig:
    """Tiles of mma-layout MXFP4 (weights first: a tile's weight rows are the tensor cores' M, its token rows their
    N) by average rows per expert: BLOCK_M the next power of two in [16, 128]; 128-row weight tiles on one warpgroup
    up to 16 rows per expert (twice the programs: a decode-sized call reads its weights from few experts), 256 on two
    above; BLOCK_K 128. What ``fusedmoe tune --dtype mxfp4_mma`` chose for gpt-oss-20b on the H200. GEMM1's BLOCK_N
    counts output columns: a tile reads their gate and up rows, twice as many."""
    block_m = 16
    while block_m < min(rows, 128):
        block_m *= 2
    if block_m <= 16:
        return MoEConfig(GemmConfig(block_m, 64, 128, 8, 4, 4), GemmConfig(block_m, 128, 128, 8, 4, 4))
    # (GEMM1 at 3 stages fits two programs per SM: the tuner's choice over 4 stages at gpt-oss-20b M = 512 and 4096)
    return MoEConfig(
        GemmConfig(block_m, 128, 128, 8, 8, 3), GemmConfig(block_m, 256, 128, 8, 8, 4 if block_m <= 64 else 3)
    )


def fit_config(cfg: MoEConfig, quant_mode: str | None, block_shape: BlockShape | None) -> MoEConfig:
    """Adjust a config to what the kernels require: for fp8_block, BLOCK_K divides the scale group; mma-layout
    MXFP4 takes tiles of at least 16 rows, BLOCK_N a multiple of 16 and BLOCK_K of 64."""
    if quant_mode == "mxfp4_mma":

        def fix_mma(g: GemmConfig) -> GemmConfig:
            return replace(g, block_m=max(g.block_m, 16), block_n=max(16, g.block_n), block_k=max(64, g.block_k))

        return MoEConfig(fix_mma(cfg.gemm1), fix_mma(cfg.gemm2))
    if quant_mode != "fp8_block":
        return cfg
    gk = (block_shape or (128, 128))[1]

    def fix(g: GemmConfig) -> GemmConfig:
        bk = g.block_k
        while bk > 16 and (bk > gk or gk % bk):
            bk //= 2
        return replace(g, block_k=bk)

    return MoEConfig(fix(cfg.gemm1), fix(cfg.gemm2))


#: Shared memory one program may use, when the device does not say (H100/H200: 227 KiB).
DEFAULT_SMEM = 232448


def smem_bytes(
    g: GemmConfig, elem_bytes: int, gated: bool, out_bytes: int | None = None, w_bytes: float | None = None
) -> int:
    """Estimated shared memory of one program of a grouped GEMM: ``num_stages`` copies of the A tile and the
    weight tile(s) (two for GEMM1's gate and up; ``w_bytes`` per weight element, default ``elem_bytes``); the
    epilogue reuses that space for its fp32 tile, except on a flattened persistent grid (``persistent`` >= 2), where
    the next tile's loads are in flight while the output tile (``out_bytes`` per element, default ``elem_bytes``)
    goes through shared memory on its way out."""
    w_bytes = elem_bytes if w_bytes is None else w_bytes
    per_stage = int(g.block_m * g.block_k * elem_bytes + (2 if gated else 1) * g.block_k * g.block_n * w_bytes)
    if g.persistent >= 2:
        return g.num_stages * per_stage + g.block_m * g.block_n * (out_bytes or elem_bytes)
    return max(g.num_stages * per_stage, g.block_m * g.block_n * 4)


def fit_smem(
    cfg: MoEConfig,
    elem_bytes: int,
    limit: int = DEFAULT_SMEM,
    out_bytes: int | None = None,
    w_bytes: float | None = None,
) -> MoEConfig:
    """Shrink tiles until both GEMMs fit in ``limit`` bytes of shared memory for ``elem_bytes``-byte operands
    (``w_bytes`` per weight element when the weights differ; ``out_bytes``-byte outputs, default ``elem_bytes``:
    see :func:`smem_bytes`).

    BLOCK_M never changes (it sizes the alignment and the plan); BLOCK_K halves first (down to 32), then stages
    drop (down to 2), then BLOCK_N and BLOCK_K halve (down to 16). A config that fits is returned unchanged.
    """

    def fit(g: GemmConfig, gated: bool) -> GemmConfig:
        while smem_bytes(g, elem_bytes, gated, out_bytes, w_bytes) > limit:
            if g.block_k > 32:
                g = replace(g, block_k=g.block_k // 2)
            elif g.num_stages > 2:
                g = replace(g, num_stages=g.num_stages - 1)
            elif g.block_n > 16:
                g = replace(g, block_n=g.block_n // 2)
            elif g.block_k > 16:
                g = replace(g, block_k=g.block_k // 2)
            else:
                break
        return g

    return MoEConfig(fit(cfg.gemm1, True), fit(cfg.gemm2, False))


_PINNED: contextvars.ContextVar[MoEConfig | None] = contextvars.ContextVar("fusedmoe_pinned_config", default=None)
_PINNED_GLOBAL: list[MoEConfig | None] = [None]


@contextlib.contextmanager
def pinned_config(cfg: MoEConfig | dict | None) -> Iterator[MoEConfig | None]:
    """Use ``cfg`` for every problem inside the context (None: no pin)."""
    if isinstance(cfg, dict):
        cfg = MoEConfig.from_dict(cfg)
    token = _PINNED.set(cfg)
    try:
        yield cfg
    finally:
        _PINNED.reset(token)


def pin_config(cfg: MoEConfig | dict | None) -> None:
    """Process-wide pin (None unpins); :func:`pinned_config` takes precedence."""
    _PINNED_GLOBAL[0] = MoEConfig.from_dict(cfg) if isinstance(cfg, dict) else cfg


def get_config(
    M: int,
    E: int,
    H: int,
    I: int,
    top_k: int,
    *,
    quant_mode: str | None = None,
    block_shape: BlockShape | None = None,
    device: str | None = None,
) -> MoEConfig:
    """The config for a problem: pinned, else the entry of a tuned file that serves M (:func:`pick_key`), else the
    heuristic."""
    pinned, config_dir = source_key()
    cfg = pinned
    if cfg is None:
        cfg = _lookup(M, E, H, I, top_k, quant_mode, block_shape, device or device_name(), config_dir)
    return fit_config(cfg, quant_mode, block_shape)


@functools.lru_cache(maxsize=4096)
def _lookup(M, E, H, I, top_k, quant_mode, block_shape, device, config_dir) -> MoEConfig:
    table = find_table(E, I, device, quant_mode, block_shape, config_dir or "")
    if table is not None:
        return table.entries[pick_key(sorted(table.entries), table.switches, M)]
    return heuristic_config(M, E, H, I, top_k, quant_mode, block_shape)


def clear_cache() -> None:
    _load_file.cache_clear()
    _lookup.cache_clear()


def table_to_json(
    table: dict[int, MoEConfig],
    source: str,
    failures: list[dict] | None = None,
    switches: dict[int, int] | None = None,
) -> str:
    """A config file: ``_source`` (how it was made), ``_failures`` (candidates that did not run, if any),
    ``_switch`` (measured switch points, if any), then one entry per M."""
    body: dict = {"_source": source}
    if failures:
        body["_failures"] = failures
    if switches:
        body["_switch"] = {str(b): switches[b] for b in sorted(switches)}
    body.update({str(m): table[m].to_dict() for m in sorted(table)})
    return json.dumps(body, indent=2) + "\n"


__all__ = [
    "ENV_DIR",
    "PACKAGED_DIR",
    "ConfigTable",
    "GemmConfig",
    "MoEConfig",
    "clear_cache",
    "config_file_name",
    "device_name",
    "find_table",
    "fit_config",
    "fit_smem",
    "get_config",
    "heuristic_config",
    "load_table",
    "pick_key",
    "pin_config",
    "pinned_config",
    "smem_bytes",
    "table_devices",
    "source_key",
    "table_to_json",
    "weight_tma",
]
