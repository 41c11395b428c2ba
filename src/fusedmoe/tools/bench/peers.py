"""Other libraries' MoE kernels, run in the same process and run as ours (``fusedmoe bench kernel --peers``).

Each peer is a factory ``make(x, w1, w2, top_k, routing)`` returning a function of router logits that runs
routing + one bf16 SwiGLU layer on the peer (or None where the peer cannot run the shape), and a version label.
A peer that is not importable is reported by :func:`available` with the reason, never silently dropped.

- ``vllm``: vLLM's Triton ``fused_experts`` (tuned tables of the installed vLLM) after our routing.
- ``triton_kernels``: OpenAI's ``triton_kernels`` (the ``matmul_ogs`` generation: its own routing, GEMM1 with
  the SwiGLU fused in, GEMM2 with the scatter and top-k sum fused in). Its SwiGLU is gpt-oss's
  ``silu(g) * (u + 1)`` (alpha 1, no clamp here); an up-column bias of -1 makes it the standard ``silu(g) * u``,
  so its output is comparable with ours (:func:`check_close` verifies it). Installing it: docs/benchmarks.md.
- ``grouped_mm``: ``torch._grouped_mm`` (see :mod:`.baselines`), always present on sm90 with torch >= 2.8.

Quantized peers run the very weights our quantized call runs (``make(x, quantized, top_k, routing)``, listed in
:data:`QUANT_PEERS` with the weight mode they take):

- ``triton_kernels_mxfp4``: triton_kernels' w4a16 path (MXFP4 weights in its Hopper value and scale layouts, bf16
  activations), the one transformers runs gpt-oss through; the same SwiGLU bias as the bf16 adapter.
- ``vllm_fp8``: vLLM's fp8 w8a8 Triton MoE GEMM (``fused_moe_kernel``), its host launch and its tuned config tables,
  run from the unmodified files of one vLLM wheel in ``.peers/vllm-VERSION/`` (``scripts/fetch-peers``), no vLLM
  installed: see :func:`load_vllm_fused_moe` for how, and :func:`vllm_fp8_experts` for what else the layer runs.
- ``scaled_grouped_mm``: ``torch._scaled_grouped_mm`` (torch's CUTLASS fp8 grouped GEMM with rowwise scales, sm90)
  twice with torch glue, on our fp8_token weights: :func:`scaled_grouped_mm_experts`.
"""

from __future__ import annotations

import ast
import base64
import builtins
import csv
import functools
import hashlib
import importlib
import importlib.metadata
import logging
import os
import re
import sys
import types
from pathlib import Path

import torch

#: Peers in the order they are listed.
PEERS = ("vllm", "triton_kernels", "grouped_mm")
#: The fp8 weight modes of the vllm_fp8 peer (vLLM's fp8_w8a8 per tensor, per channel x per token, and in blocks).
VLLM_FP8_MODES = ("fp8_tensor", "fp8_token", "fp8_block")
#: The weight mode of the scaled_grouped_mm peer: per-token activation x per-output-channel weight scales, what
#: torch's fp8 grouped GEMM calls rowwise scaling.
SCALED_GROUPED_MM_MODES = ("fp8_token",)
#: Peers of a quantized sweep that run our quantized weights: name -> the weight modes they take.
QUANT_PEERS = {
    "triton_kernels_mxfp4": ("mxfp4",),
    "vllm_fp8": VLLM_FP8_MODES,
    "scaled_grouped_mm": SCALED_GROUPED_MM_MODES,
}


def quant_peers(dtype: str) -> list[str]:
    """The quantized peers that take the weights of a ``--quant dtype`` sweep (none for bf16)."""
    if dtype == "bf16":
        return []
    from ...quant import QuantConfig

    mode = QuantConfig.parse(dtype).mode
    return [name for name, modes in QUANT_PEERS.items() if mode in modes]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def available(name: str) -> tuple[bool, str]:
    """(importable, version label or the reason it is not)."""
    if name == "grouped_mm":
        from .baselines import grouped_mm_available

        return (True, f"torch {torch.__version__}") if grouped_mm_available() else (False, "needs sm90+")
    if name == "scaled_grouped_mm":
        why = scaled_grouped_mm_absent()
        if why:
            return False, why
        align = scaled_grouped_mm_row_align()
        padded = f", expert groups padded to {align} rows" if align > 1 else ""
        return True, f"torch {torch.__version__} _scaled_grouped_mm (rowwise fp8, CUTLASS{padded})"
    if name == "vllm_fp8":
        try:
            root = vllm_peer_folder()
            load_vllm_fused_moe(str(root))
        except Exception as exc:  # no .peers, a file missing or changed, a vLLM import the stand-ins lack
            return False, f"{type(exc).__name__}: {exc}"[:300]
        return True, f"vLLM {root.name.removeprefix('vllm-')} fused_moe_kernel, unmodified files from {root}"
    modules = {
        "vllm": ["vllm.model_executor.layers.fused_moe"],
        "triton_kernels": ["triton_kernels.matmul_ogs"],
        "triton_kernels_mxfp4": ["triton_kernels.matmul_ogs", "triton_kernels.tensor_details.layout"],
    }[name]
    try:
        for module in modules:
            importlib.import_module(module)
    except Exception as exc:  # any failure to import (missing, ABI mismatch) means the peer is absent here
        return False, f"{type(exc).__name__}: {exc}"[:160]
    if name == "vllm":
        return True, f"vllm {_version('vllm')}"
    import triton_kernels

    origin = triton_kernels.__file__ or "?"
    return True, f"triton_kernels (matmul_ogs API) from {origin.rsplit('/', 2)[0]}"


def make_vllm(x, w1, w2, top_k: int, routing: dict):
    """vLLM's Triton experts (``fused_experts``, bf16, SiLU) after :func:`fusedmoe.routing.route`."""
    from vllm.model_executor.layers.fused_moe import fused_experts

    from ...routing import route

    def call(logits):
        w, ids = route(logits, top_k, **routing)
        return fused_experts(x, w1, w2, w, ids)

    return call


def triton_kernels_weights(w1: torch.Tensor, w2: torch.Tensor):
    """Our [E, 2I, H] / [E, H, I] weights in triton_kernels' layout: w1 [E, H, 2I] with gate and up columns
    interleaved (its SwiGLU pairs adjacent columns) and w2 [E, I, H] (both views of K-contiguous copies), and the
    fp32 GEMM1 bias [E, 2I] that turns its ``silu(g) * (u + 1)`` into ``silu(g) * u``."""
    return interleave_rows(w1).transpose(1, 2), w2.transpose(1, 2), up_bias(w1.shape[0], w1.shape[1], w1.device)


def interleave_rows(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, X] with gate rows then up rows -> rows g0, u0, g1, u1, ... (the pairs triton_kernels' SwiGLU takes)."""
    E, two_i, X = t.shape
    return t.view(E, 2, two_i // 2, X).transpose(1, 2).reshape(E, two_i, X)


def up_bias(E: int, two_i: int, device) -> torch.Tensor:
    """The fp32 GEMM1 bias [E, 2I] (interleaved columns) that turns ``silu(g) * (u + 1)`` into ``silu(g) * u``."""
    bias = torch.zeros(E, two_i, device=device, dtype=torch.float32)
    bias[:, 1::2] = -1.0
    return bias


def mxfp4_for_triton_kernels(packed: torch.Tensor, scales: torch.Tensor, interleave: bool):
    """Our MXFP4 weight (:mod:`fusedmoe.mxfp4`: ``packed`` uint8 [E, N, K/2], ``scales`` uint8 [E, N, K/32]) as the
    tensors triton_kernels' MXFP4 layouts take: rows interleaved gate, up when ``interleave`` (GEMM1), then K-major
    views, values [E, K/2, N] and scales [E, K/32 rounded up to a multiple of 4, N] (its Hopper path reads the
    scales of 4 groups at a time; vLLM 0.34.0 pads them the same way; the zero groups lie past K)."""
    if interleave:
        packed, scales = interleave_rows(packed), interleave_rows(scales)
    scales = torch.nn.functional.pad(scales, (0, -scales.shape[-1] % 4))
    return packed.transpose(-2, -1), scales.transpose(-2, -1)


def make_triton_kernels(x, w1, w2, top_k: int, routing: dict):
    """triton_kernels' ``routing`` + two ``matmul_ogs`` calls; None for routing it does not do (grouped top-k,
    softmax before top-k without renormalizing is its ``sm_first``)."""
    sm_first = _triton_kernels_sm_first(routing)
    if sm_first is None:
        return None
    w1t, w2t, bias = triton_kernels_weights(w1, w2)
    return _triton_kernels_layer(x, w1t, w2t, bias, top_k, sm_first)


def _triton_kernels_layer(x, w1, w2, bias, top_k: int, sm_first: bool, precision=(None, None), constraints=None):
    """A function of router logits running triton_kernels' ``routing`` (``sm_first``), GEMM1 on ``w1`` with its
    SwiGLU fused (``bias``: the up-column bias of :func:`up_bias`) and GEMM2 on ``w2`` with the scatter and the
    gate-weighted top-k sum fused; ``precision``: the two GEMMs' ``PrecisionConfig`` (None: unquantized),
    ``constraints``: its opt-flag constraints, held during each call only."""
    from triton_kernels import swiglu
    from triton_kernels.matmul_ogs import FnSpecs, FusedActivation, matmul_ogs
    from triton_kernels.matmul_ogs_details.opt_flags import reset_opt_flags_constraints, update_opt_flags_constraints
    from triton_kernels.routing import routing as tk_routing

    act = FusedActivation(FnSpecs("swiglu", swiglu.swiglu_fn, ("alpha", "limit")), (1.0, None), 2)
    pc1, pc2 = precision

    def call(logits):
        if constraints:
            update_opt_flags_constraints(constraints)
        try:
            rdata, gather, scatter = tk_routing(logits, top_k, sm_first=sm_first)
            h = matmul_ogs(x, w1, bias, rdata, gather_indx=gather, precision_config=pc1, fused_activation=act)
            return matmul_ogs(h, w2, None, rdata, scatter_indx=scatter, precision_config=pc2, gammas=rdata.gate_scal)
        finally:
            if constraints:
                reset_opt_flags_constraints()

    return call


def _triton_kernels_sm_first(routing: dict) -> bool | None:
    """triton_kernels' ``sm_first`` for our routing, or None for routing it does not do (grouped top-k, sigmoid
    scoring, a routed scaling factor). Its default (False) is top-k of the logits, then softmax over those k: our
    "softmax_topk" (gpt-oss), and "softmax" renormalized over the top k; True is softmax over all experts, then
    top-k without renormalizing."""
    if routing.get("num_expert_groups") or routing.get("routed_scaling_factor", 1.0) != 1.0:
        return None
    scoring = routing.get("scoring", "softmax")
    if scoring == "softmax_topk":
        return False
    if scoring == "softmax":
        return not routing.get("renormalize", True)
    return None


def make_triton_kernels_mxfp4(x, quantized: dict, top_k: int, routing: dict):
    """triton_kernels' ``routing`` + two w4a16 ``matmul_ogs`` calls on our MXFP4 weights (the same bits), laid out
    as its Hopper kernels read them; None for other weight modes or routing it does not do. ``split_k`` is held
    at 1 during each call, as vLLM holds it for MXFP4 weights on Hopper."""
    from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig
    from triton_kernels.numerics import InFlexData
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details import layout

    sm_first = _triton_kernels_sm_first(routing)
    if quantized["quant"].mode != "mxfp4" or sm_first is None:
        return None

    def laid_out(packed, scales, interleave):
        values, group_scales = mxfp4_for_triton_kernels(packed, scales, interleave)
        value_layout, value_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout, scale_opts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
        w = convert_layout(wrap_torch_tensor(values, dtype=FP4), value_layout, **value_opts)
        s = convert_layout(wrap_torch_tensor(group_scales), scale_layout, **scale_opts)
        return w, PrecisionConfig(weight_scale=s, flex_ctx=FlexCtx(rhs_data=InFlexData()))

    w1, pc1 = laid_out(quantized["w1"], quantized["w1_scale"], True)
    w2, pc2 = laid_out(quantized["w2"], quantized["w2_scale"], False)
    bias = up_bias(quantized["w1"].shape[0], quantized["w1"].shape[1], x.device)
    return _triton_kernels_layer(x, w1, w2, bias, top_k, sm_first, (pc1, pc2), {"split_k": 1})


# ---- vllm_fp8: vLLM's fp8 Triton MoE kernel, run from its wheel's files in .peers ------------------------------
#
# vLLM cannot be installed where the benchmarks run (no registry; its wheel is ~240 MB and its compiled extension is
# built for one torch), and importing its fused_moe module pulls in most of vLLM (the package's __init__ imports the
# layer, the distributed state, psutil, ...). So the peer executes the wheel's fused_moe.py itself, unmodified, as a
# module of its own: its kernels, its host launch (``invoke_fused_moe_triton_kernel``: grid, strides, SWAP_AB, the
# TMA descriptor of B) and its config-table lookup (``try_get_optimal_moe_config``, the tables beside the file) run
# as vLLM's code. Its ``import`` statements resolve to the stand-ins of :func:`_vllm_stand_ins`: the few vLLM helper
# functions that launch calls, taken from their own files in the wheel; the platform and environment answered as
# vLLM answers them on this GPU with its defaults; our alignment op in place of vLLM's compiled one; everything else
# (compiled ops, the paths of fused_experts the peer does not run) raising if touched.

#: Environment variable naming the peers folder (default: a ``.peers`` folder on ``sys.path``, in the working
#: directory, or at the root of this checkout).
PEERS_DIR_ENV = "FUSEDMOE_PEERS_DIR"
#: The vLLM release the vllm_fp8 peer is written against (its fused_moe.py's function signatures).
VLLM_VERSION = "0.34.0"
VLLM_FUSED_MOE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
VLLM_CONFIGS = "vllm/model_executor/layers/fused_moe/configs"
#: vLLM's helper functions that fused_moe.py's launch path calls, taken from these files of the wheel as they are.
VLLM_HELPERS = {
    "vllm/model_executor/layers/fused_moe/utils.py": (
        "enable_swap_ab",
        "resolve_moe_use_td",
        "warn_if_moe_use_td_ineffective",
    ),
    "vllm/utils/math_utils.py": ("next_power_of_2",),
    "vllm/utils/platform_utils.py": ("get_device_name_as_file_name",),
    "vllm/triton_utils/allocation.py": ("set_triton_allocator",),
}
#: Every file the peer reads (wheel paths; scripts/fetch-peers copies the same list).
VLLM_PEER_FILES = (VLLM_FUSED_MOE, f"{VLLM_CONFIGS}/*.json", *VLLM_HELPERS)
#: vLLM's settings (vllm.envs) the launch path reads, at vLLM's defaults: no batch-invariant mode, no tuned-config
#: folder of the user's, the tensor-descriptor gather left to the platform (off on CUDA).
VLLM_ENVS = {"VLLM_BATCH_INVARIANT": False, "VLLM_TUNED_CONFIG_FOLDER": None, "VLLM_TRITON_USE_TD": None}


def peers_folders() -> list[Path]:
    """Where a ``.peers`` folder is looked for, in order (only the one of ``FUSEDMOE_PEERS_DIR`` when it is set)."""
    if os.environ.get(PEERS_DIR_ENV):
        return [Path(os.environ[PEERS_DIR_ENV])]
    found = [Path(p) for p in sys.path if p and Path(p).name == ".peers"]
    found += [Path.cwd() / ".peers", Path(__file__).resolve().parents[4] / ".peers"]
    return list(dict.fromkeys(p.resolve() for p in found))


def vllm_peer_folder() -> Path:
    """The ``vllm-VERSION`` folder of the first peers folder that has one (``VLLM_VERSION`` preferred);
    FileNotFoundError saying what is missing otherwise."""
    looked = peers_folders()
    existing = [p for p in looked if p.is_dir()]
    if not existing:
        raise FileNotFoundError(f"no .peers folder ({', '.join(map(str, looked))}); scripts/fetch-peers fills one")
    for folder in existing:
        versions = sorted(folder.glob("vllm-*[0-9]"), key=lambda p: [int(n) for n in re.findall(r"\d+", p.name)])
        pinned = folder / f"vllm-{VLLM_VERSION}"
        if versions:
            return pinned if pinned in versions else versions[-1]
    raise FileNotFoundError(f"{existing[0]} has no vllm-VERSION folder; scripts/fetch-peers writes vllm-{VLLM_VERSION}")


def _record_digest(data: bytes) -> str:
    """sha256 as a wheel's RECORD writes it."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def check_vllm_files(root: Path) -> None:
    """Raise unless every file the peer reads is under ``root`` with the sha256 the wheel's RECORD lists for it (the
    config tables: every ``*.json`` there, so a table added or edited by hand is refused too)."""
    records = sorted(root.glob("vllm-*.dist-info/RECORD"))
    if not records:
        raise FileNotFoundError(f"{root} has no vllm-*.dist-info/RECORD to check its files against")
    with open(records[0], newline="") as f:
        record = {row[0]: row[1] for row in csv.reader(f) if len(row) >= 2}
    configs = sorted(p.relative_to(root).as_posix() for p in (root / VLLM_CONFIGS).glob("*.json"))
    for rel in (VLLM_FUSED_MOE, *VLLM_HELPERS, *configs):
        path = root / rel
        if not path.is_file():
            raise FileNotFoundError(f"missing {path}")
        if record.get(rel) != _record_digest(path.read_bytes()):
            raise ValueError(f"{path} is not the file the wheel ships (its sha256 differs from {records[0].name})")


@functools.cache
def load_vllm_fused_moe(root: str, verify: bool = True) -> types.ModuleType:
    """The wheel's fused_moe.py under ``root`` (a ``vllm-VERSION`` folder), executed unmodified as a module of its
    own whose vLLM imports are :func:`_vllm_stand_ins` (its other imports, torch, triton and the standard library,
    are the real ones). ``__file__`` is the file's own path, so its config lookup reads the tables beside it.
    ``verify``: check the files against the wheel's RECORD first (:func:`check_vllm_files`)."""
    path = Path(root) / VLLM_FUSED_MOE
    if verify:
        check_vllm_files(Path(root))
    stand_ins = _vllm_stand_ins(Path(root))
    module = types.ModuleType("fusedmoe_peers.vllm_fused_moe", "vLLM's fused_moe.py, run by the vllm_fp8 peer")
    module.__file__ = str(path)
    module.__builtins__ = stand_ins.builtins
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), module.__dict__)
    return module


class _StandIns:
    """The modules a vLLM file's ``import vllm...`` statements get (:meth:`add`: dotted name -> a module, or the
    attributes of one; the parents of a name are plain modules holding their children). An import of any other
    vLLM module raises ImportError naming it (a newer fused_moe.py may need more); other imports are Python's.
    ``builtins``: the builtins of code run with these imports."""

    def __init__(self):
        self.modules: dict[str, types.ModuleType] = {"vllm": types.ModuleType("vllm")}
        self.known: set[str] = set()
        self.builtins = dict(builtins.__dict__, __import__=self.import_)

    def add(self, modules: dict) -> None:
        for name in sorted(modules, key=lambda n: n.count(".")):
            parts = name.split(".")
            for i in range(2, len(parts) + 1):
                node, parent = ".".join(parts[:i]), self.modules[".".join(parts[: i - 1])]
                if i == len(parts) and isinstance(modules[name], types.ModuleType):
                    self.modules[node] = modules[name]
                elif node not in self.modules:
                    self.modules[node] = types.ModuleType(node)
                setattr(parent, parts[i - 1], self.modules[node])
            if not isinstance(modules[name], types.ModuleType):
                self.modules[name].__dict__.update(modules[name])
            self.known.add(name)

    def import_(self, name, globals=None, locals=None, fromlist=(), level=0):
        if level or not (name == "vllm" or name.startswith("vllm.")):
            return builtins.__import__(name, globals, locals, fromlist, level)
        if name not in self.known:
            raise ImportError(f"{name} is not among the vllm_fp8 peer's stand-ins (0.34.0's fused_moe.py imports less)")
        module = self.modules[name]
        for attr in fromlist or ():
            if attr not in module.__dict__:
                raise ImportError(f"the vllm_fp8 peer's stand-in {name} has no {attr}")
        return module if fromlist else self.modules["vllm"]


class _NotRun(types.ModuleType):
    """A vLLM module the peer's path never uses (vLLM's compiled ops, its modular-kernel classes): any attribute
    raises, naming it."""

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise NotImplementedError(f"{self.__name__}.{attr}: not available to the vllm_fp8 peer (not run by it)")


def _not_run(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"{name}: not available to the vllm_fp8 peer (not run by it)")

    return call


class _VllmLogger:
    """vLLM's logger as far as the launch path uses it; its ``*_once`` messages (which table the config lookup
    read, or that it fell back to its default config) are printed once each, as vLLM logs them."""

    def __init__(self, name: str):
        self._log = logging.getLogger(name)
        self._said: set[str] = set()

    def _once(self, msg, *args, **kwargs):
        text = msg % args if args else msg
        if text not in self._said:
            self._said.add(text)
            print(f"peer vllm_fp8 (vLLM log): {text}", flush=True)

    info_once = warning_once = _once

    def debug(self, msg, *args, **kwargs):
        self._log.debug(msg, *args)

    def info(self, msg, *args, **kwargs):
        self._log.info(msg, *args)

    def warning(self, msg, *args, **kwargs):
        self._log.warning(msg, *args)


class VllmPlatform:
    """vLLM's ``current_platform`` as the launch path queries it, answered from torch for the current CUDA device
    with the semantics of vLLM's ``Platform``: a capability is compared as a ``(major, minor)`` tuple or as the
    integer ``10 * major + minor``; a "family" is the major version. ``capability`` / ``device_name`` override the
    device's (tests: the Hopper branches under the CPU interpreter)."""

    def __init__(self, capability: tuple[int, int] | None = None, device_name: str | None = None):
        self.capability, self.device_name = capability, device_name

    def get_device_capability(self, device_id: int = 0) -> tuple[int, int] | None:
        if self.capability is not None:
            return tuple(self.capability)
        return torch.cuda.get_device_capability(device_id) if torch.cuda.is_available() else None

    def _as_int(self, device_id: int) -> int | None:
        cap = self.get_device_capability(device_id)
        return None if cap is None else 10 * cap[0] + cap[1]

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        cap = self.get_device_capability(device_id)
        if cap is None:
            return False
        return cap >= capability if isinstance(capability, tuple) else self._as_int(device_id) >= capability

    def is_device_capability(self, capability, device_id: int = 0) -> bool:
        cap = self.get_device_capability(device_id)
        if cap is None:
            return False
        return cap == capability if isinstance(capability, tuple) else self._as_int(device_id) == capability

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        cap = self._as_int(device_id)
        return cap is not None and cap // 10 == capability // 10

    def get_device_name(self, device_id: int = 0) -> str:
        if self.device_name:
            return self.device_name
        return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"

    def is_cuda(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    def is_rocm(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is not None

    def is_cuda_alike(self) -> bool:
        return torch.cuda.is_available()

    def is_xpu(self) -> bool:
        return False

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn


#: The platform the loaded module sees (tests set its overrides).
VLLM_PLATFORM = VllmPlatform()


def vllm_functions(path: Path, names, namespace: dict) -> dict:
    """The top-level functions ``names`` of a vLLM file, executed from its source as they are (decorators
    included) in ``namespace``, after the file's own top-level imports of anything but vLLM (those that import
    here) and the module-level assignments of the globals the functions declare; the vLLM names they use are the
    caller's to put in ``namespace``. Returns the namespace."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {d.name for d in defs}
    if missing:
        raise ImportError(f"{path} has no {sorted(missing)}")
    for node in tree.body:
        if isinstance(node, ast.Import):
            imported = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            imported = [node.module]
        else:
            continue
        if any(m.split(".")[0] == "vllm" for m in imported):
            continue
        try:
            exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
        except ImportError:
            pass  # not installed here: a function that needs it fails when called, naming it
    declared = {g for d in defs for n in ast.walk(d) if isinstance(n, ast.Global) for g in n.names}
    assigns = [
        n for n in tree.body if isinstance(n, ast.Assign) and {getattr(t, "id", None) for t in n.targets} & declared
    ]
    body = sorted(assigns + defs, key=lambda n: n.lineno)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def _vllm_stand_ins(root: Path) -> _StandIns:
    """The vLLM modules fused_moe.py imports, as the peer provides them (see the section's comment)."""
    import triton
    import triton.language as tl

    envs = types.SimpleNamespace(**VLLM_ENVS)
    stand_ins = _StandIns()  # the helpers' own imports (inside their bodies) resolve through it too
    helpers = {}
    for rel, names in VLLM_HELPERS.items():
        namespace = {
            "__builtins__": stand_ins.builtins,
            "__name__": rel,
            "triton": triton,
            "tl": tl,
            "current_platform": VLLM_PLATFORM,
            "envs": envs,
            "logger": _VllmLogger(rel),
            "re": re,  # platform_utils' ``regex as re`` where regex is not installed (its pattern means the same)
        }
        helpers[rel] = vllm_functions(root / rel, names, namespace)

    def take(rel):
        return {n: helpers[rel][n] for n in VLLM_HELPERS[rel]}

    fused = "vllm.model_executor.layers.fused_moe"
    stand_ins.add(
        {
            "vllm": {"_custom_ops": _NotRun("vllm._custom_ops")},
            "vllm.envs": envs.__dict__,
            "vllm.logger": {"init_logger": _VllmLogger},
            "vllm.platforms": {"current_platform": VLLM_PLATFORM},
            "vllm.triton_utils": {"triton": triton, "tl": tl},
            "vllm.triton_utils.allocation": take("vllm/triton_utils/allocation.py"),
            "vllm.utils.math_utils": take("vllm/utils/math_utils.py"),
            "vllm.utils.platform_utils": take("vllm/utils/platform_utils.py"),
            # registering vLLM's torch op (torch.ops.vllm.fused_experts) is left out: the peer does not call it,
            # and it would clash with an installed vLLM's
            "vllm.utils.torch_utils": {"direct_register_custom_op": lambda *args, **kwargs: None},
            # no config override (vLLM's get_config() is None outside its override context)
            fused: {"get_config": lambda: None},
            f"{fused}.modular_kernel": _NotRun(f"{fused}.modular_kernel"),
            f"{fused}.activation": {
                "MoEActivation": types.SimpleNamespace(SILU="silu"),
                "apply_moe_activation": _not_run("apply_moe_activation"),
            },
            f"{fused}.config": {
                "FUSED_MOE_UNQUANTIZED_CONFIG": None,
                "FusedMoEQuantConfig": type("FusedMoEQuantConfig", (), {}),
                "_get_config_dtype_str": _not_run("_get_config_dtype_str"),
            },
            f"{fused}.moe_align_block_size": {"moe_align_block_size": vllm_align_block_size},
            f"{fused}.utils": {
                **take("vllm/model_executor/layers/fused_moe/utils.py"),
                "moe_kernel_quantize_input": _not_run("moe_kernel_quantize_input"),
            },
        }
    )
    return stand_ins


def vllm_align_block_size(
    topk_ids: torch.Tensor,
    block_size: int,
    num_experts: int,
    expert_map: torch.Tensor | None = None,
    pad_sorted_ids: bool = False,
    ignore_invalid_experts: bool = False,
    return_scatter_idx: bool = False,
):
    """vLLM's ``moe_align_block_size`` (a wrapper of its compiled op) computed by our alignment op: the same format
    (flat slot ids grouped by expert, each expert's run padded to ``block_size`` with the sentinel
    ``topk_ids.numel()``; the expert of each block; the padded total, int32 [1]) in buffers of vLLM's sizes:
    ``numel + E * (block_size - 1)`` ids, or ``numel * block_size`` when there are fewer slots than experts, and
    one expert id per ``block_size`` of those (the GEMM's grid is sized from them). Within an expert ours lists
    the slots in order (vLLM's op need not; the GEMM's result does not depend on it); the ids past the padded
    total, which the GEMM never reads, are left unwritten. Only the arguments the peer's path passes are taken."""
    if expert_map is not None or pad_sorted_ids or return_scatter_idx:
        raise NotImplementedError("the vllm_fp8 peer aligns without an expert map, padding or scatter index")
    from ...ops.align import moe_align

    n = topk_ids.numel()
    size = n + num_experts * (block_size - 1)
    if n < num_experts:
        size = min(n * block_size, size)
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, num_experts, block_size)
    return sorted_ids[:size], expert_ids[: -(-size // block_size)], num_padded


def vllm_fp8_arguments(quantized: dict) -> dict:
    """Our quantized weights (:func:`fusedmoe.quant.quantize_weights`) as vLLM's ``fused_experts`` takes fp8
    w8a8 weights: the same e4m3 tensors w1 [E, 2I, H] (gate rows, then up rows, as vLLM's SiLU-and-mul splits
    them) and w2 [E, H, I]; the same float32 scales, per tensor [E], per channel as [E, N, 1] views (vLLM's
    layout of channel scales), in blocks [E, N / bn, K / bk]; ``per_channel_quant`` (fp8_token) and
    ``block_shape`` [bn, bk] (fp8_block) as vLLM's flags; the static activation scales when the sweep has them."""
    quant = quantized["quant"]
    s1, s2 = quantized["w1_scale"], quantized["w2_scale"]
    if quant.mode == "fp8_token":
        s1, s2 = s1.unsqueeze(-1), s2.unsqueeze(-1)
    return {
        "w1": quantized["w1"],
        "w2": quantized["w2"],
        "w1_scale": s1,
        "w2_scale": s2,
        "a1_scale": quantized.get("a1_scale"),
        "a2_scale": quantized.get("a2_scale"),
        "per_channel_quant": quant.mode == "fp8_token",
        "block_shape": list(quant.block_shape) if quant.mode == "fp8_block" else None,
    }


def vllm_fp8_experts(
    vllm,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w1_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    per_channel_quant: bool = False,
    block_shape: list[int] | None = None,
) -> torch.Tensor:
    """One SwiGLU experts layer the way vLLM 0.34.0's ``fused_experts_impl`` runs fp8 w8a8 (no expert map, router
    weights applied in GEMM2), step for step; ``vllm`` is :func:`load_vllm_fused_moe`'s module.

    vLLM's own code: the config (``try_get_optimal_moe_config``: its tuned table for (E, N = I, fp8_w8a8, block
    shape) on this GPU, the entry of the nearest M, else its default config), the expert assignment
    (``_prepare_expert_assignment``: one block per slot when slots * 4 <= E, else the alignment) and both GEMM
    launches (``dispatch_fused_moe_kernel`` -> ``fused_moe_kernel``, with SWAP_AB and the TMA descriptor of B as
    its host code chooses them).

    Ours in place of vLLM's compiled ops (their CUDA source is not in the wheel; they were not compared bit for
    bit): the alignment (:func:`vllm_align_block_size`); the fp8 activation quantization
    (:func:`fusedmoe.ops.quantize.quantize_activation`, one launch, two for a dynamic per-tensor scale: per token
    and 128-column group for blocks, per token for per-channel weights, per tensor otherwise, the static scale
    when given), whose scale ``max(amax, 1e-10) / 448`` is the rule of vLLM's Triton group quantizer (which
    multiplies by 1/448 instead of dividing: the last bit of a scale may differ); SiLU-and-mul (torch, two
    launches: ``silu(gate)`` rounded to the activation dtype, times ``up``); the sum over the top k (torch, one
    launch)."""
    from ...ops.quantize import quantize_activation

    compute_type = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[x.dtype]
    compute_type = getattr(vllm.tl, compute_type)
    mode = "fp8_block" if block_shape else "fp8_token" if per_channel_quant else "fp8_tensor"
    group_k = block_shape[1] if block_shape else 128
    M, top_k = topk_ids.shape
    E, N, _ = w1.shape
    K = w2.shape[1]
    config = vllm.try_get_optimal_moe_config(w1.size(), w2.size(), top_k, "fp8_w8a8", M, block_shape=block_shape)
    cache13 = torch.empty(M * top_k * max(N, K), device=x.device, dtype=x.dtype)
    cache1 = cache13[: M * top_k * N].view(M, top_k, N)
    cache3 = cache13[: M * top_k * K].view(M, top_k, K)
    cache2 = torch.empty((M * top_k, N // 2), device=x.device, dtype=x.dtype)
    out = torch.empty_like(x)
    a1q, a1s = quantize_activation(x, mode, static_scale=a1_scale, group_k=group_k)
    sorted_ids, expert_ids, num_padded = vllm._prepare_expert_assignment(
        topk_ids,
        config,
        M,
        top_k,
        E,
        None,
        block_shape=block_shape,
        ignore_invalid_experts=True,
        weights_host_resident=vllm._weights_host_resident(w1, w2),
    )
    flags = dict(
        compute_type=compute_type,
        use_fp8_w8a8=True,
        use_int8_w8a8=False,
        use_int8_w8a16=False,
        use_int4_w4a16=False,
        per_channel_quant=per_channel_quant,
        block_shape=block_shape,
    )
    routed = (topk_weights, sorted_ids, expert_ids, num_padded)
    vllm.dispatch_fused_moe_kernel(a1q, w1, cache1, a1s, w1_scale, None, *routed, False, top_k, config, **flags)
    gate_up = cache1.view(-1, N)
    torch.mul(torch.nn.functional.silu(gate_up[:, : N // 2]), gate_up[:, N // 2 :], out=cache2)
    a2q, a2s = quantize_activation(cache2, mode, static_scale=a2_scale, group_k=group_k)
    vllm.dispatch_fused_moe_kernel(a2q, w2, cache3, a2s, w2_scale, None, *routed, True, 1, config, **flags)
    return torch.sum(cache3, dim=1, out=out)


def make_vllm_fp8(x, quantized: dict, top_k: int, routing: dict):
    """vLLM's fp8 experts (:func:`vllm_fp8_experts`) on our fp8 weights, after :func:`fusedmoe.routing.route`; None
    for other weight modes, and for fp8 blocks whose group does not divide H and I (vLLM's group quantizer
    asserts it does)."""
    from ...routing import route

    quant = quantized["quant"]
    if quant.mode not in VLLM_FP8_MODES:
        return None
    args = vllm_fp8_arguments(quantized)
    if args["block_shape"] and (x.shape[1] % args["block_shape"][1] or args["w2"].shape[2] % args["block_shape"][1]):
        return None
    vllm = load_vllm_fused_moe(str(vllm_peer_folder()))

    def call(logits):
        w, ids = route(logits, top_k, **routing)
        return vllm_fp8_experts(vllm, x, w, ids, **args)

    return call


# ---- scaled_grouped_mm: torch's fp8 grouped GEMM with rowwise scales -----------------------------------------------
#
# What torch._scaled_grouped_mm takes for a 2-D operand grouped along its rows by ``offs`` against a 3-D one (its
# checks in aten/src/ATen/native/cuda/GroupedBlas.cpp, their meta twin in torch/_meta_registrations.py, the group
# set-up in aten/src/ATen/native/cuda/GroupMMCommon.cuh): e4m3 ``mat_a`` [R, K] row-major and ``mat_b`` [G, K, N]
# column-major (our [E, N, K] weights transposed, no copy), K and N multiples of 16 (16-byte rows); float32
# ``scale_a`` [R] (one per row) and ``scale_b`` [G, N] (one per output channel, contiguous along N); ``offs`` int32
# [G], the end row of each group (an empty group is allowed); bf16 output [R, N], rows past ``offs[-1]`` left
# unwritten; fewer than 1024 groups (its sm90 kernel); compute capability 9.0 or 10.0 (its device check), while
# the rowwise kernel itself is built for sm90 only. Before the group set-up's alignment check was narrowed
# (pytorch PR 155466, June 2025; in torch 2.9 and later for certain) it asserted on the device that every group's
# row count be a multiple of 16 bytes of e4m3, i.e. 16 rows; since then rows of a row-major 2-D operand grouped
# along M are not checked (each group starts at a multiple of the 16-byte row stride anyway), so no padding is
# needed there. Everything below runs on the device without a host sync and with shapes fixed by M, k and E, so a
# call can be captured in a CUDA graph.


def scaled_grouped_mm_absent() -> str | None:
    """Why the scaled_grouped_mm peer cannot run here, or None when it can."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    need = "needs compute capability 9.0 (torch's rowwise fp8 grouped GEMM is a CUTLASS sm90 kernel)"
    if not torch.cuda.is_available():
        return f"{need}: no CUDA GPU here"
    major, minor = torch.cuda.get_device_capability()
    return None if major == 9 else f"{need}, not {major}.{minor}"


def scaled_grouped_mm_row_align() -> int:
    """Rows each expert's group is padded to a multiple of: 16 for a torch older than 2.9 (whose grouped GEMMs
    assert it on the device), 1 (no padding) otherwise; see the section's comment."""
    return 1 if torch.torch_version.TorchVersion(torch.__version__) >= "2.9" else 16


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (e4m3 [R, K], float32 scales [R]): one scale per row, ``max(amax, MIN_AMAX) / 448``, and
    ``x / scale`` saturated to +-448: the rule of our fp8_token activation quantization
    (:func:`fusedmoe.quant.activation_scales`), in torch ops (an amax, a division, a cast)."""
    from ...quant import FP8_DTYPE, FP8_MAX, MIN_AMAX

    scale = x.abs().amax(dim=1).float().clamp_min(MIN_AMAX) / FP8_MAX
    q = (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def expert_groups(topk_ids: torch.Tensor, num_experts: int, align: int = 1):
    """The slots of ``topk_ids`` [M, k] (valid expert ids) grouped by expert as a grouped GEMM's 2-D operand holds
    them: ``(order, rows, offs, total)``.

    ``order``: int64 [M*k], the flat slot ids sorted by expert (stable: in slot order within an expert);
    ``rows``: int64 [M*k], the operand row of slot ``order[i]``: ``i`` when ``align`` is 1, else each expert's rows
    start at a multiple of ``align`` (padding rows fill each group up to one); ``offs``: int32 [E], the end row of
    each expert's group, padded; ``total``: the operand's row count, M*k, or with padding the bound
    M*k + min(E, M*k) * (align - 1) (its rows past ``offs[-1]`` are in no group). Device ops only, no host sync."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat.index_select(0, order)
    experts = torch.arange(num_experts, device=flat.device, dtype=flat.dtype)
    ends = torch.searchsorted(sorted_ids, experts, right=True)
    if align == 1:
        return order, torch.arange(n, device=flat.device), ends.to(torch.int32), n
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + align - 1) // align * align
    padded_ends = torch.cumsum(padded, 0)
    # each slot's sorted position, moved by its expert's padded start minus its start
    shift = (padded_ends - padded) - (ends - counts)
    rows = torch.arange(n, device=flat.device) + shift.index_select(0, sorted_ids)
    return order, rows, padded_ends.to(torch.int32), n + min(num_experts, n) * (align - 1)


def scaled_grouped_mm_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w1_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    align: int = 1,
    use_fast_accum: bool = True,
    grouped_mm=None,
) -> torch.Tensor:
    """One SwiGLU experts layer on fp8_token weights (e4m3 ``w1`` [E, 2I, H], ``w2`` [E, H, I], float32 scales
    [E, 2I] and [E, H]) through two ``torch._scaled_grouped_mm`` calls (``grouped_mm``: a stand-in taking the same
    arguments, for tests on the CPU), after routing: ``topk_weights`` / ``topk_ids`` [M, k].

    Each token is quantized once (:func:`quantize_rowwise`, per row of x, as our fp8_token call quantizes its
    input) and its rows are gathered into expert order (:func:`expert_groups`; groups padded to ``align`` rows with
    zero rows); GEMM1 with per-row x per-channel scales and bf16 output; SiLU(gate) * up in torch (gate rows then
    up rows, as our w1 holds them); the rowwise quantization again; GEMM2; then each slot's row, times its routing
    weight, summed over the top k per token in slot order (a deterministic sum). ``use_fast_accum``: CUTLASS's fast
    fp8 accumulation, the way Triton's fp8 dots (ours) accumulate on sm90 by default."""
    gmm = grouped_mm if grouped_mm is not None else torch._scaled_grouped_mm
    M, H = x.shape
    k = topk_ids.shape[1]
    inter = w1.shape[1] // 2
    order, rows, offs, total = expert_groups(topk_ids, w1.shape[0], align)
    q, scale = quantize_rowwise(x)
    tokens = order // k
    if align == 1:
        a1 = q.view(torch.uint8).index_select(0, tokens).view(q.dtype)
        s1 = scale.index_select(0, tokens)
    else:
        a1 = torch.zeros(total, H, device=x.device, dtype=torch.uint8)
        a1.index_copy_(0, rows, q.view(torch.uint8).index_select(0, tokens))
        a1 = a1.view(q.dtype)
        s1 = torch.ones(total, device=x.device, dtype=torch.float32).index_copy_(0, rows, scale.index_select(0, tokens))
    h = gmm(a1, w1.transpose(-2, -1), s1, w1_scale, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum)
    a2, s2 = quantize_rowwise(torch.nn.functional.silu(h[:, :inter]) * h[:, inter:])
    y = gmm(a2, w2.transpose(-2, -1), s2, w2_scale, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum)
    slot_rows = torch.empty_like(rows).index_copy_(0, order, rows)  # the operand row of each slot, in slot order
    y = y.index_select(0, slot_rows).view(M, k, H)
    return (y * topk_weights.to(y.dtype).unsqueeze(-1)).sum(dim=1).to(x.dtype)


def make_scaled_grouped_mm(x, quantized: dict, top_k: int, routing: dict, align: int | None = None):
    """``torch._scaled_grouped_mm`` experts (:func:`scaled_grouped_mm_experts`) on our fp8_token weights and scales
    (the very tensors our call runs), after :func:`fusedmoe.routing.route`, groups padded to ``align`` rows (default:
    :func:`scaled_grouped_mm_row_align`); None for other weight modes, for H or I not a multiple of 16 (its shape
    checks) and for 1,024 experts or more (its kernel's group limit)."""
    from ...routing import route

    if quantized["quant"].mode not in SCALED_GROUPED_MM_MODES:
        return None
    w1, w2, s1, s2 = quantized["w1"], quantized["w2"], quantized["w1_scale"], quantized["w2_scale"]
    E, _, H = w1.shape
    if H % 16 or w2.shape[2] % 16 or E >= 1024:
        return None
    align = align or scaled_grouped_mm_row_align()

    def call(logits):
        w, ids = route(logits, top_k, **routing)
        return scaled_grouped_mm_experts(x, w, ids, w1, w2, s1, s2, align=align)

    return call


def make_grouped_mm(x, w1, w2, top_k: int, routing: dict):
    from ...routing import route
    from .baselines import grouped_mm_moe

    def call(logits):
        w, ids = route(logits, top_k, **routing)
        return grouped_mm_moe(x, w1, w2, w, ids)

    return call


MAKERS = {"vllm": make_vllm, "triton_kernels": make_triton_kernels, "grouped_mm": make_grouped_mm}
QUANT_MAKERS = {
    "triton_kernels_mxfp4": make_triton_kernels_mxfp4,
    "vllm_fp8": make_vllm_fp8,
    "scaled_grouped_mm": make_scaled_grouped_mm,
}


def is_peer(backend: str) -> bool:
    """Whether ``backend`` is another library's kernels (bf16 or quantized), not one of ours."""
    return backend in MAKERS or backend in QUANT_MAKERS


def check_close(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of a peer's layer output against ours (max abs difference over ref's max abs)."""
    out = out.reshape(ref.shape).float()
    return float((out - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12))
