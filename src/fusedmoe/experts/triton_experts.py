"""Triton experts for the standard layout: align -> (quant) -> GEMM1+act -> (quant) -> GEMM2 -> top-k reduce.

Every scratch byte comes from the plan and nothing is zero-filled: each kernel writes every element a later
kernel reads (see ``fusedmoe.ops``). No host sync and no allocation on the hot path, so a call can be captured
in a CUDA graph. Launch parameters are cached per (problem, config).

Kernels per call: align 1-2 (1 at decode), GEMM1, GEMM2, reduce; fp8 adds one quantization launch per GEMM
input (two for a dynamic per-tensor scale: partial maxima, then quantize).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..ops import decode
from ..ops.align import AlignParams, align_params, moe_align
from ..ops.configs import MoEConfig, device_name, get_config
from ..ops.grouped_gemm import grid_blocks, moe_gemm1, moe_gemm2
from ..ops.quantize import num_partials, quantize_activation, scale_shape
from ..ops.reduce import moe_reduce
from ..problem import ACTIVATIONS, Layout, MoEProblem
from ..quant import FP8_DTYPE
from ..workspace.manager import Workspace
from ..workspace.plan import BufferSpec, Phase
from .base import Experts, ExpertsInputs

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class _Launch:
    """Static launch parameters of one problem."""

    config: MoEConfig
    align: AlignParams
    num_blocks: int
    quant_mode: str | None
    static_scale: bool
    group_k: int
    decode: bool = False  # the two-launch decode path (ops/decode.py) serves this problem


class TritonExperts(Experts):
    """Tiled Triton grouped GEMMs over expert-aligned blocks (bf16/fp16/fp32, fp8 w8a8 e4m3).

    Args:
        fp32_ieee: for float32 inputs on the GPU, use IEEE fp32 dots instead of TF32.
    """

    name = "triton"
    layout = Layout.STANDARD

    def __init__(self, fp32_ieee: bool = False):
        self.fp32_ieee = fp32_ieee
        self._launches: dict[tuple, _Launch] = {}

    # ---- capability and plan ------------------------------------------------------------------------------
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
        else:
            if p.weight_dtype != FP8_DTYPE:
                return f"{p.quant.name} needs float8_e4m3fn weights, got {p.weight_dtype}"
            if p.quant.mode == "fp8_block":
                bn, bk = p.quant.block_shape
                if min(bn, bk) < 16 or bk & (bk - 1) or bn & (bn - 1):
                    return f"fp8_block needs power-of-two block_shape >= 16, got {p.quant.block_shape}"
        return None

    def launch(self, p: MoEProblem) -> _Launch:
        """The cached launch parameters of ``p`` (config for its M, alignment, grid bound)."""
        from ..ops import configs as _cfg

        key = (p, _cfg._PINNED.get() or _cfg._PINNED_GLOBAL[0])
        hit = self._launches.get(key)
        if hit is not None:
            return hit
        q = p.quant
        mode = q.mode if q is not None else None
        shape = q.block_shape if (q is not None and mode == "fp8_block") else None
        # Configs are keyed by tokens for a layer holding all its experts. Under expert parallelism only
        # E/global_E of the slots land here, so look up the token count with the same rows per local expert.
        m_lookup = max(1, round(p.M * p.E / p.global_E)) if p.global_E > p.E else p.M
        cfg = get_config(m_lookup, p.E, p.H, p.I, p.top_k, quant_mode=mode, block_shape=shape,
                         device=device_name() if torch.cuda.is_available() else "cpu")
        ap = align_params(p.slots, p.E, cfg.block_m)
        launch = _Launch(cfg, ap, grid_blocks(p.slots, ap.max_blocks), mode,
                         bool(q is not None and q.static_activation_scale),
                         q.block_shape[1] if q is not None else 128,
                         decode.ENABLED and decode.decode_supported(p.slots, mode, p.activation, p.has_bias))
        if len(self._launches) > 4096:
            self._launches.clear()
        self._launches[key] = launch
        return launch

    def plan(self, p: MoEProblem) -> list[BufferSpec]:
        """Scratch of one call (no zeroed region). ``act`` (GEMM1 side) is region "2"; ``y`` (GEMM2 side) "13".

        ``y`` [M*k, H] is live GEMM2..REDUCE and so shares bytes with everything dead before GEMM2 (the fp8
        input copy, the unquantized ``act`` when fp8 re-quantizes it).
        """
        L = self.launch(p)
        S, M, H, I = p.slots, p.M, p.H, p.I
        i32, f32, dt = torch.int32, torch.float32, p.dtype
        if L.decode:  # no alignment, no [M*k, H] buffer: GEMM2 reduces over top-k in registers
            return [BufferSpec("act", (S, I), dt, Phase.GEMM1, Phase.GEMM2, region="2")]
        ap = L.align
        specs = [
            BufferSpec("sorted_ids", (ap.max_padded,), i32, Phase.ALIGN, Phase.GEMM2),
            BufferSpec("block_expert", (ap.max_blocks,), i32, Phase.ALIGN, Phase.GEMM2),
            BufferSpec("num_padded", (1,), i32, Phase.ALIGN, Phase.GEMM2),
        ]
        if not ap.fused:
            specs.append(BufferSpec("align_partial", ap.partial_shape, i32, Phase.ALIGN, Phase.ALIGN))
        if L.quant_mode is None:
            specs.append(BufferSpec("act", (S, I), dt, Phase.GEMM1, Phase.GEMM2, region="2"))
        else:
            mode, gk = L.quant_mode, L.group_k
            specs.append(BufferSpec("a1q", (M, H), FP8_DTYPE, Phase.PREPARE, Phase.GEMM1))
            specs.append(BufferSpec("act", (S, I), dt, Phase.GEMM1, Phase.ACTIVATION, region="2"))
            specs.append(BufferSpec("a2q", (S, I), FP8_DTYPE, Phase.ACTIVATION, Phase.GEMM2, region="2"))
            if not L.static_scale:
                specs.append(BufferSpec("a1_scale", scale_shape(mode, M, H, gk), f32, Phase.PREPARE, Phase.GEMM1))
                specs.append(BufferSpec("a2_scale", scale_shape(mode, S, I, gk), f32, Phase.ACTIVATION,
                                        Phase.GEMM2, region="2"))
            if mode == "fp8_tensor" and not L.static_scale:
                specs.append(BufferSpec("a1_partial", (num_partials(M),), f32, Phase.PREPARE, Phase.PREPARE))
                specs.append(BufferSpec("a2_partial", (num_partials(S),), f32, Phase.ACTIVATION,
                                        Phase.ACTIVATION, region="2"))
        specs.append(BufferSpec("y", (S, H), dt, Phase.GEMM2, Phase.REDUCE))
        return specs

    # ---- compute ------------------------------------------------------------------------------------------
    def apply(self, output: torch.Tensor, x: ExpertsInputs, p: MoEProblem, ws: Workspace) -> None:
        if p.M == 0:
            return
        L = self.launch(p)
        if L.static_scale and (x.a1_scale is None or x.a2_scale is None):
            raise ValueError("fp8_tensor with static activation scales needs a1_scale and a2_scale")
        cfg, E, gE, k = L.config, p.E, p.global_E, p.top_k
        ids = x.topk_ids if x.topk_ids.is_contiguous() else x.topk_ids.contiguous()
        emap = x.expert_map
        weights = x.topk_weights
        if L.decode:
            decode.moe_decode(x.hidden_states, x.w1, x.w2, weights.contiguous(), ids, output, ws["act"],
                              expert_map=emap, global_num_experts=gE, activation=p.activation,
                              apply_router_weight_on_input=p.apply_router_weight_on_input)
            return
        sorted_ids, block_expert = ws["sorted_ids"], ws["block_expert"]
        moe_align(ids, E, cfg.block_m, expert_map=emap, global_num_experts=gE, sorted_ids=sorted_ids,
                  block_expert=block_expert, num_padded=ws["num_padded"],
                  partial=ws["align_partial"] if "align_partial" in ws else None)

        mode = L.quant_mode
        a, a_scale = x.hidden_states, None
        if mode is not None:
            a, a_scale = self._quantize_input(x, p, L, ws)
        act = ws["act"]
        moe_gemm1(a, x.w1, act, sorted_ids, block_expert, top_k=k, num_blocks=L.num_blocks, config=cfg.gemm1,
                  activation=p.activation, topk_weights=weights if p.apply_router_weight_on_input else None,
                  quant_mode=mode, a_scale=a_scale, w_scale=self._w_scale(x.w1_scale, mode, E),
                  block_shape=p.quant.block_shape if p.quant else (128, 128), fp32_ieee=self.fp32_ieee,
                  bias=x.w1_bias)

        a2, a2_scale = act, None
        if mode is not None:
            a2, a2_scale = quantize_activation(
                act, mode, out=ws["a2q"], scale_out=ws["a2_scale"] if "a2_scale" in ws else None,
                static_scale=x.a2_scale if L.static_scale else None,
                partial=ws["a2_partial"] if "a2_partial" in ws else None,
                topk_ids=ids, expert_map=emap, num_experts=E, global_num_experts=gE, group_k=L.group_k)
        y = ws["y"]
        moe_gemm2(a2, x.w2, y, sorted_ids, block_expert, num_blocks=L.num_blocks, config=cfg.gemm2,
                  topk_weights=None if p.apply_router_weight_on_input else weights,
                  quant_mode=mode, a_scale=a2_scale, w_scale=self._w_scale(x.w2_scale, mode, E),
                  block_shape=p.quant.block_shape if p.quant else (128, 128), fp32_ieee=self.fp32_ieee,
                  bias=x.w2_bias)
        moe_reduce(y, ids, output, E, expert_map=emap, global_num_experts=gE)

    @staticmethod
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

    @staticmethod
    def _quantize_input(x: ExpertsInputs, p: MoEProblem, L: _Launch, ws: Workspace):
        hs = x.hidden_states
        if hs.dtype == FP8_DTYPE:  # already quantized by prepare
            if x.a1_scale is None:
                raise ValueError("fp8 hidden_states need a1_scale")
            return hs, x.a1_scale
        return quantize_activation(
            hs, L.quant_mode, out=ws["a1q"], scale_out=ws["a1_scale"] if "a1_scale" in ws else None,
            static_scale=x.a1_scale if L.static_scale else None,
            partial=ws["a1_partial"] if "a1_partial" in ws else None, group_k=L.group_k)


__all__ = ["TritonExperts"]
