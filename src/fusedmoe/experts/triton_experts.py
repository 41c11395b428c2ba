"""Triton experts for the standard layout: align -> (quant) -> GEMM1+act -> (quant) -> GEMM2 -> top-k reduce.

Every scratch byte comes from the plan and nothing is zero-filled: each kernel writes every element a later
kernel reads (see ``fusedmoe.ops``). No host sync and no allocation on the hot path, so a call can be captured
in a CUDA graph.

The launch (:class:`TritonLaunch`: tile configs fitted to the element size, alignment sizes, grid bound,
quantization settings, IEEE float32 dots) is a value derived from the problem and the configuration in effect
(pinned config, config folder, float32 matmul precision); plans are keyed by it, so a change of configuration
can never reuse scratch sized for another one.

Kernels per call: align 1-2 (1 at decode), GEMM1, GEMM2, reduce; with one-row tiles (a config's BLOCK_M 1)
only GEMM1 and GEMM2 over the slots in their own order, GEMM2 summing each token's slots
(:attr:`TritonLaunch.slot_order`, :mod:`fusedmoe.ops.slot_gemm`; MXFP4 weights keep the reduce). fp8 on 16-row
tiles adds one quantization launch per GEMM input (two for a dynamic per-tensor scale: partial maxima, then
quantize), except that fp8_block GEMM1 tiles holding whole scale groups (BLOCK_N a multiple of the group) quantize
their own output from float32 (:attr:`TritonLaunch.gemm1_quantizes`). GEMM2 writes its weighted rows in float32,
so the top-k sum rounds once, to the output dtype (:func:`y_dtype`), except on a flattened persistent grid (the
shipped bf16 tables' entries from 1024 tokens, which their switch points serve from 724-1024): there they take the
activation dtype, as vLLM and triton_kernels store them at every size.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

from ..ops import configs
from ..ops.align import AlignParams, align_params, moe_align
from ..ops.configs import MoEConfig, device_name, fit_smem, get_config
from ..ops.expert_gemm import MIN_DOT_BLOCK_M, MXFP4_GROUP, Numerics
from ..ops.grouped_gemm import fp8_output_fits, grid_blocks, moe_gemm1, moe_gemm2
from ..ops.quantize import num_partials, quantize_activation, scale_shape
from ..ops.reduce import moe_reduce
from ..ops.slot_gemm import moe_gemm1_slots, moe_gemm2_reduce, moe_gemm2_slots, token_reduces
from ..problem import ACTIVATIONS, Layout, MoEProblem, hash_once, state_without_hash
from ..quant import FP8_DTYPE, FP8_MODES
from ..steps import step
from ..workspace.plan import BufferSpec
from .base import Experts

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
#: Diagnostic switch: ``FUSEDMOE_SLOT_GEMM=0`` (read at import) sends one-row tiles through the aligned four-launch
#: path (align, GEMM1, GEMM2, reduce) instead of the slot-order GEMMs, to compare the two.
SLOT_GEMM = os.environ.get("FUSEDMOE_SLOT_GEMM", "1") != "0"
#: Smallest K extent of an fp8 ``tl.dot`` tile on NVIDIA GPUs (Triton's min_dot_size for 8-bit operands).
MIN_FP8_BLOCK_K = 32


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=16)
def _smem_limit(device_index: int) -> int:
    """Shared memory per program on a CUDA device (the H100/H200 figure elsewhere)."""
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(device_index)
        return int(props["max_shared_mem"])
    except Exception:  # pragma: no cover - no driver (CPU interpreter)
        return configs.DEFAULT_SMEM


def y_dtype(p: MoEProblem, config: MoEConfig) -> torch.dtype:
    """dtype of GEMM2's weighted rows ``y``: float32, so the top-k sum rounds once (the precision vLLM's reference
    simulates), unless GEMM2 runs on a flattened persistent grid (``persistent`` >= 2), whose output tile sits in
    shared memory beside the next tile's loads: a float32 128x256 tile does not fit there beside 3 stages, so such
    configs store ``y`` in the activation dtype, as vLLM and triton_kernels do at every size. (A float32 ``y`` also
    doubles GEMM2's stores and the reduce's reads: the reduce of qwen3-30b-a3b at M=16384 took 277 us with one,
    139 us with bf16, on the H200.)"""
    return p.dtype if config.gemm2.persistent >= 2 else torch.float32


def operand_bytes(p: MoEProblem) -> int:
    """Bytes per element of the GEMM operands (1 for fp8, else the activation dtype's size: MXFP4 weights are
    decoded into it)."""
    return 1 if p.quant is not None and p.quant.fp8 else p.dtype.itemsize


@dataclass(frozen=True)
class TritonLaunch:
    """Everything besides the problem that sizes the scratch of a call or picks its kernels."""

    config: MoEConfig
    align: AlignParams
    num_blocks: int
    quant_mode: str | None
    static_scale: bool
    block_shape: tuple[int, int]
    ieee: bool  # float32 operands: IEEE fp32 dots instead of TF32

    __hash__ = hash_once  # a per-call cache key (the program's)
    __getstate__ = state_without_hash

    @property
    def group_k(self) -> int:
        return self.block_shape[1]

    @property
    def gemm1_quantizes(self) -> bool:
        """fp8_block with GEMM1 tiles that hold whole scale groups of its output columns: GEMM1 writes GEMM2's fp8
        input and its scales itself (from the float32 activation), and no separate quantization runs."""
        return (
            self.quant_mode == "fp8_block" and not self.weight_only and fp8_output_fits(self.config.gemm1, self.group_k)
        )

    @property
    def slot_order(self) -> bool:
        """One-row tiles: the GEMMs run over the slots in their own order, with no alignment
        (:mod:`fusedmoe.ops.slot_gemm`; a tile of one row holds one slot, so sorting slots by expert gives it
        nothing), and GEMM2 sums each token's slots itself where :attr:`token_reduce`."""
        return SLOT_GEMM and self.config.block_m == 1 and self.quant_mode != "mxfp4_mma"

    @property
    def token_reduce(self) -> bool:
        """Slot order whose GEMM2 writes each token's summed row (float and fp8 weights): two launches in all."""
        return self.slot_order and token_reduces(self.quant_mode)

    @property
    def weight_only(self) -> bool:
        """fp8 weights in decode-sized blocks (BLOCK_M < 16): the multiply-add K loop takes the activations as they
        come (w8a16), so nothing is quantized and no fp8 scratch is planned."""
        return self.quant_mode in FP8_MODES and self.config.block_m < MIN_DOT_BLOCK_M


def fitted_config(p: MoEProblem, m_lookup: int) -> MoEConfig:
    """The config of ``p`` as looked up for ``m_lookup`` tokens (pin, tuned table of this device, heuristic),
    its tiles fitted to the element size and this device's shared memory."""
    q = p.quant
    mode = q.kernel_mode if q is not None else None
    shape = q.block_shape if (q is not None and mode == "fp8_block") else None
    on_gpu = torch.cuda.is_available()
    cfg = get_config(
        m_lookup, p.E, p.H, p.I, p.top_k, quant_mode=mode, block_shape=shape, device=device_name() if on_gpu else "cpu"
    )
    if q is not None and q.fp8 and on_gpu and not _interpreting():  # an fp8 dot tile is at least 32 deep on the GPU
        cfg = MoEConfig(*(replace(g, block_k=max(g.block_k, MIN_FP8_BLOCK_K)) for g in (cfg.gemm1, cfg.gemm2)))
    if mode == "mxfp4":  # a K tile holds whole 32-element scale groups
        cfg = MoEConfig(*(replace(g, block_k=max(g.block_k, MXFP4_GROUP)) for g in (cfg.gemm1, cfg.gemm2)))
    limit = _smem_limit(torch.cuda.current_device()) if on_gpu else configs.DEFAULT_SMEM
    # outputs in the activation dtype: act, and y where it matters (a flattened persistent GEMM2, see y_dtype);
    # mma-layout MXFP4 weights: half a byte per element and a scale byte per 32
    w_bytes = 0.5 + 1 / 32 if mode == "mxfp4_mma" else None
    return fit_smem(cfg, operand_bytes(p), limit, out_bytes=p.dtype.itemsize, w_bytes=w_bytes)


def make_launch(p: MoEProblem, config: MoEConfig, *, ieee: bool = False) -> TritonLaunch:
    """The launch of ``p`` with the GEMM tiles of ``config`` (already fitted: :func:`fitted_config`)."""
    q = p.quant
    ap = align_params(p.slots, p.E, config.block_m)
    return TritonLaunch(
        config=config,
        align=ap,
        num_blocks=grid_blocks(p.slots, ap.max_blocks),
        quant_mode=q.kernel_mode if q is not None else None,
        static_scale=bool(q is not None and q.static_activation_scale),
        block_shape=tuple(q.block_shape) if q is not None else (128, 128),
        ieee=ieee and p.dtype == torch.float32,
    )


def _w_scale(s: torch.Tensor | None, mode: str | None, E: int) -> torch.Tensor | None:
    """Views of caller weight scales in the layout the kernels index ([E] / [E, N] / [E, nb, kb])."""
    if mode is None:
        return None
    if s is None:
        raise ValueError(f"{mode} needs w1_scale and w2_scale")
    if mode == "fp8_tensor":
        return s.reshape(E)
    if mode == "fp8_token":
        return s.reshape(E, -1)
    return s


def gemm_numerics(L, a_scale: torch.Tensor | None, w_scale: torch.Tensor | None, E: int) -> Numerics:
    """A GEMM's numerics under launch ``L`` (a :class:`TritonLaunch` or batched launch): its quantization with
    activation scales ``a_scale`` and the caller's weight scales ``w_scale`` (viewed as the kernels index them),
    and its fp32 dot precision."""
    return Numerics(L.quant_mode, a_scale, _w_scale(w_scale, L.quant_mode, E), L.block_shape, L.ieee)


def quant_outputs(L, out, scale_out, partial, static_scale) -> dict:
    """The output keywords of an activation quantization under launch ``L``: ``out`` for q, ``scale_out`` and
    ``partial`` for dynamic scales, the caller's ``static_scale`` when the launch's scales are static."""
    static = static_scale if L.static_scale else None
    return {"out": out, "scale_out": scale_out, "static_scale": static, "partial": partial, "group_k": L.block_shape[1]}


def input_quantized(c) -> bool:
    """Whether the fp8 experts' input arrived quantized (by prepare, with ``a1_scale``): then it is not quantized
    again. Static scales need both activation scales."""
    x = c.x
    if c.launch.static_scale and (x.a1_scale is None or x.a2_scale is None):
        raise ValueError("fp8_tensor with static activation scales needs a1_scale and a2_scale")
    if x.hidden_states.dtype != FP8_DTYPE:
        return False
    if x.a1_scale is None:
        raise ValueError("fp8 hidden_states need a1_scale")
    return True


def gemm1_input(c, a1q: torch.Tensor, a1_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, a_scale) of an fp8 GEMM1: the input quantized by prepare with its scales, else the quantized copy
    ``a1q`` with its scales (the caller's static scale, or ``a1_scale``)."""
    x = c.x
    if input_quantized(c):
        return x.hidden_states, x.a1_scale
    return a1q, (x.a1_scale if c.launch.static_scale else a1_scale)


def _ids(c) -> torch.Tensor:
    ids = c.x.topk_ids
    return ids if ids.is_contiguous() else ids.contiguous()


# ---- steps (their parameters name the buffers they touch; see fusedmoe.steps) ---------------------------------
def align_slots(c, block_m: int, sorted_ids, block_expert, num_padded, align_partial=None) -> None:
    """The alignment of ``c``'s top-k ids into ``block_m``-row expert blocks, written into the step's buffers."""
    moe_align(
        _ids(c),
        c.p.E,
        block_m,
        expert_map=c.x.expert_map,
        global_num_experts=c.p.global_E,
        sorted_ids=sorted_ids,
        block_expert=block_expert,
        num_padded=num_padded,
        partial=align_partial,
    )


@step
def _align(c, sorted_ids, block_expert, num_padded, align_partial=None):
    align_slots(c, c.launch.config.block_m, sorted_ids, block_expert, num_padded, align_partial)


@step
def _quantize_input(c, a1q, a1_scale=None, a1_partial=None):
    x, L = c.x, c.launch
    if not input_quantized(c):
        quantize_activation(x.hidden_states, L.quant_mode, **quant_outputs(L, a1q, a1_scale, a1_partial, x.a1_scale))


def _gemm_options(c, config, a_scale, w_scale, bias) -> dict:
    """The keywords both grouped GEMMs take from the call: the grid bound, the GEMM's tile ``config``, its
    numerics (activation scales ``a_scale``, the caller's weight scales ``w_scale``) and its ``bias``."""
    numerics = gemm_numerics(c.launch, a_scale, w_scale, c.p.E)
    return {"num_blocks": c.launch.num_blocks, "config": config, "numerics": numerics, "bias": bias}


def _gemm1_call(c, sorted_ids, block_expert, act, a, a_scale, act_scale=None) -> None:
    x, p = c.x, c.p
    weights = x.topk_weights if p.apply_router_weight_on_input else None
    opts = _gemm_options(c, c.launch.config.gemm1, a_scale, x.w1_scale, x.w1_bias)
    moe_gemm1(
        a,
        x.w1,
        act,
        sorted_ids,
        block_expert,
        top_k=p.top_k,
        activation=p.activation,
        topk_weights=weights,
        preact=x.preact,
        out_scale=act_scale,
        **opts,
    )


@step
def _gemm1(c, sorted_ids, block_expert, act):
    _gemm1_call(c, sorted_ids, block_expert, act, c.x.hidden_states, None)


@step
def _gemm1_weight_only(c, sorted_ids, block_expert, act):
    # fp8 weights at decode: the input as it came (float; or fp8 with its scales when prepare quantized it)
    x = c.x
    quantized = x.hidden_states.dtype == FP8_DTYPE
    if quantized and x.a1_scale is None:
        raise ValueError("fp8 hidden_states need a1_scale")
    _gemm1_call(c, sorted_ids, block_expert, act, x.hidden_states, x.a1_scale if quantized else None)


@step
def _gemm1_fp8(c, sorted_ids, block_expert, act, a1q, a1_scale=None):
    _gemm1_call(c, sorted_ids, block_expert, act, *gemm1_input(c, a1q, a1_scale))


@step
def _gemm1_fp8_quantized(c, sorted_ids, block_expert, a1q, a2q, a2_scale, a1_scale=None):
    # fp8_block whose GEMM1 tiles hold whole groups: GEMM1 writes GEMM2's fp8 input and its scales
    _gemm1_call(c, sorted_ids, block_expert, a2q, *gemm1_input(c, a1q, a1_scale), act_scale=a2_scale)


@step
def _quantize_act(c, act, a2q, a2_scale=None, a2_partial=None):
    x, p, L = c.x, c.p, c.launch
    quantize_activation(
        act,
        L.quant_mode,
        topk_ids=_ids(c),
        expert_map=x.expert_map,
        num_experts=p.E,
        global_num_experts=p.global_E,
        **quant_outputs(L, a2q, a2_scale, a2_partial, x.a2_scale),
    )


def _gemm2_call(c, sorted_ids, block_expert, y, a, a_scale) -> None:
    x = c.x
    weights = None if c.p.apply_router_weight_on_input else x.topk_weights
    opts = _gemm_options(c, c.launch.config.gemm2, a_scale, x.w2_scale, x.w2_bias)
    moe_gemm2(a, x.w2, y, sorted_ids, block_expert, topk_weights=weights, **opts)


@step
def _gemm2(c, sorted_ids, block_expert, act, y):
    _gemm2_call(c, sorted_ids, block_expert, y, act, None)


@step
def _gemm2_fp8(c, sorted_ids, block_expert, a2q, y, a2_scale=None):
    _gemm2_call(c, sorted_ids, block_expert, y, a2q, c.x.a2_scale if c.launch.static_scale else a2_scale)


def _slot_gemm_options(c, config, a_scale, w_scale, bias) -> dict:
    """The keywords both slot-order GEMMs take from the call (see :func:`_gemm_options`)."""
    x, p = c.x, c.p
    numerics = gemm_numerics(c.launch, a_scale, w_scale, p.E)
    return {
        "num_experts": p.E,
        "global_num_experts": p.global_E,
        "expert_map": x.expert_map,
        "config": config,
        "numerics": numerics,
        "bias": bias,
    }


@step
def _gemm1_slots(c, act):
    # one-row tiles take the input as it came: float, or fp8 with its scales when prepare quantized it
    x, p = c.x, c.p
    a_scale = None
    if x.hidden_states.dtype == FP8_DTYPE:
        if x.a1_scale is None:
            raise ValueError("fp8 hidden_states need a1_scale")
        a_scale = x.a1_scale
    moe_gemm1_slots(
        x.hidden_states,
        x.w1,
        act,
        _ids(c),
        activation=p.activation,
        topk_weights=x.topk_weights if p.apply_router_weight_on_input else None,
        preact=x.preact,
        **_slot_gemm_options(c, c.launch.config.gemm1, a_scale, x.w1_scale, x.w1_bias),
    )


@step
def _gemm2_reduce(c, act):
    x = c.x
    moe_gemm2_reduce(
        act,
        x.w2,
        c.out,
        _ids(c),
        topk_weights=None if c.p.apply_router_weight_on_input else x.topk_weights,
        **_slot_gemm_options(c, c.launch.config.gemm2, None, x.w2_scale, x.w2_bias),
    )


@step
def _gemm2_slots(c, act, y):
    x = c.x
    moe_gemm2_slots(
        act,
        x.w2,
        y,
        _ids(c),
        topk_weights=None if c.p.apply_router_weight_on_input else x.topk_weights,
        **_slot_gemm_options(c, c.launch.config.gemm2, None, x.w2_scale, x.w2_bias),
    )


@step
def _reduce(c, y):
    moe_reduce(y, _ids(c), c.out, c.p.E, expert_map=c.x.expert_map, global_num_experts=c.p.global_E)


class TritonExperts(Experts):
    """Tiled Triton grouped GEMMs over expert-aligned blocks (bf16/fp16/fp32, fp8 w8a8 e4m3).

    Args:
        fp32_ieee: float32 inputs on the GPU: True for IEEE fp32 dots, False for TF32; None (default) follows
            ``torch.get_float32_matmul_precision()`` ("highest" means IEEE), as torch's own matmuls do.
    """

    name = "triton"
    layout = Layout.STANDARD

    def __init__(self, fp32_ieee: bool | None = None):
        self.fp32_ieee = fp32_ieee
        self._launches: dict[tuple, TritonLaunch] = {}

    # ---- capability, launch and plan ----------------------------------------------------------------------
    def supports(self, p: MoEProblem) -> str | None:
        try:
            import triton  # noqa: F401
        except Exception:  # pragma: no cover
            return "triton is not installed"
        if not torch.cuda.is_available() and not _interpreting():
            return "the Triton experts need a CUDA GPU (or TRITON_INTERPRET=1 for CPU tensors)"
        if p.dtype not in _FLOATS:
            return f"activation dtype {p.dtype} is not supported (float32, float16, bfloat16)"
        if _interpreting() and p.dtype == torch.bfloat16:
            return "bfloat16 math is broken in the Triton CPU interpreter; use float32/float16 there"
        if p.activation not in ACTIVATIONS:
            return f"activation {p.activation!r} is not supported"
        if p.quant is None:
            if p.weight_dtype != p.dtype:
                return f"weight dtype {p.weight_dtype} must match the activation dtype {p.dtype}"
        elif p.quant.mode == "mxfp4":
            if p.weight_dtype != torch.uint8:
                return f"{p.quant.name} needs uint8 (packed) weights, got {p.weight_dtype}"
            if p.H % MXFP4_GROUP or p.I % MXFP4_GROUP:
                return f"mxfp4 needs H and I to be multiples of {MXFP4_GROUP}, got H={p.H}, I={p.I}"
        else:
            if p.weight_dtype != FP8_DTYPE:
                return f"{p.quant.name} needs float8_e4m3fn weights, got {p.weight_dtype}"
            if p.quant.mode == "fp8_block":
                bn, bk = p.quant.block_shape
                if min(bn, bk) < 16 or bk & (bk - 1) or bn & (bn - 1):
                    return f"fp8_block needs power-of-two block_shape >= 16, got {p.quant.block_shape}"
                if bk < MIN_FP8_BLOCK_K and not _interpreting():
                    return (
                        f"fp8_block on the GPU needs scale groups of >= {MIN_FP8_BLOCK_K} along K (an fp8 dot "
                        f"tile is at least that deep), got block_shape {p.quant.block_shape}"
                    )
        return None

    def _ieee(self, p: MoEProblem) -> bool:
        if p.dtype != torch.float32:
            return False
        if self.fp32_ieee is not None:
            return self.fp32_ieee
        return torch.get_float32_matmul_precision() == "highest"

    def launch(self, p: MoEProblem) -> TritonLaunch:
        """The launch of ``p`` under the configuration in effect now (cached under a key holding all of it)."""
        ieee = self._ieee(p)
        key = (p, configs.source_key(), ieee)
        hit = self._launches.get(key)
        if hit is not None:
            return hit
        # Configs are keyed by tokens for a layer holding all its experts. Under expert parallelism only
        # E/global_E of the slots land here, so look up the token count with the same rows per local expert.
        m_lookup = max(1, round(p.M * p.E / p.global_E)) if p.global_E > p.E else p.M
        launch = make_launch(p, fitted_config(p, m_lookup), ieee=ieee)
        if len(self._launches) > 4096:
            self._launches.clear()
        self._launches[key] = launch
        return launch

    def buffers(self, p: MoEProblem, launch: TritonLaunch) -> list[BufferSpec]:
        """Scratch of one call (no zeroed region). ``act`` (GEMM1 side) is region "2"; ``y`` (GEMM2 side) "13".

        ``y`` [M*k, H] (:func:`y_dtype`) lives GEMM2..reduce and so shares bytes with whatever is dead by then (the
        fp8 input copy, the unquantized ``act`` when fp8 re-quantizes it).
        """
        if p.M == 0:
            return []
        L = launch
        S, M, H, I = p.slots, p.M, p.H, p.I
        i32, f32, dt = torch.int32, torch.float32, p.dtype
        if L.slot_order:  # no alignment; GEMM2 writes the output itself where it sums the slots
            act = BufferSpec("act", (S, I), dt, region="2")
            return [act] if L.token_reduce else [act, BufferSpec("y", (S, H), y_dtype(p, L.config))]
        ap = L.align
        specs = [
            BufferSpec("sorted_ids", (ap.max_padded,), i32),
            BufferSpec("block_expert", (ap.max_blocks,), i32),
            BufferSpec("num_padded", (1,), i32),
            BufferSpec("y", (S, H), y_dtype(p, L.config)),
        ]
        if not L.gemm1_quantizes:  # (else GEMM1 writes a2q and a2_scale directly)
            specs.insert(3, BufferSpec("act", (S, I), dt, region="2"))
        if not ap.fused:
            specs.append(BufferSpec("align_partial", ap.partial_shape, i32))
        if L.quant_mode in FP8_MODES and not L.weight_only:
            mode, gk = L.quant_mode, L.group_k
            specs.append(BufferSpec("a1q", (M, H), FP8_DTYPE))
            specs.append(BufferSpec("a2q", (S, I), FP8_DTYPE, region="2"))
            if not L.static_scale:
                specs.append(BufferSpec("a1_scale", scale_shape(mode, M, H, gk), f32))
                specs.append(BufferSpec("a2_scale", scale_shape(mode, S, I, gk), f32, region="2"))
                if mode == "fp8_tensor":
                    specs.append(BufferSpec("a1_partial", (num_partials(M),), f32))
                    specs.append(BufferSpec("a2_partial", (num_partials(S),), f32, region="2"))
        return specs

    def steps(self, p: MoEProblem, launch: TritonLaunch):
        if p.M == 0:
            return []
        if launch.slot_order:
            return [_gemm1_slots, _gemm2_reduce] if launch.token_reduce else [_gemm1_slots, _gemm2_slots, _reduce]
        if launch.quant_mode not in FP8_MODES:  # unquantized, or MXFP4 weights (the GEMMs' numerics carry them)
            return [_align, _gemm1, _gemm2, _reduce]
        if launch.weight_only:
            return [_align, _gemm1_weight_only, _gemm2, _reduce]
        if launch.gemm1_quantizes:
            return [_align, _quantize_input, _gemm1_fp8_quantized, _gemm2_fp8, _reduce]
        return [_align, _quantize_input, _gemm1_fp8, _quantize_act, _gemm2_fp8, _reduce]


__all__ = ["TritonExperts", "TritonLaunch", "fitted_config", "make_launch"]
