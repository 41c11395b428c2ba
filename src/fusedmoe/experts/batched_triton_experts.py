"""Triton experts for the batched layout: (quant) -> GEMM1+act -> (quant) -> GEMM2, valid rows only.

Input ``[E, T, H]`` (float, or e4m3 with ``a1_scale`` when prepare already quantized it) plus
``expert_num_tokens [E]`` on the device; output ``[E, T, H]`` (finalize weights and reduces).

The no-fill contract: the plan declares no zero region, and no kernel reads a row ``r >= expert_num_tokens[e]``
of any buffer into a result, a reduction or a scale (see :mod:`fusedmoe.ops.batched_gemm` and
:mod:`fusedmoe.ops.batched_quantize`): the GEMMs return early / mask loads and stores past the count, and the
dynamic per-tensor fp8 scales (of the input and of GEMM1's output) are maxima over valid rows only, built from
per-program partial maxima in a planned buffer (every entry written) instead of a zeroed accumulator. So padded
rows may hold anything (NaN in poison mode, stale data under CUDA-graph replay) without changing the output.
No host sync, no allocation: the call can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import configs
from ..ops.batched_gemm import batched_gemm1, batched_gemm2
from ..ops.batched_quantize import batched_num_partials, batched_quantize
from ..ops.configs import MoEConfig
from ..ops.expert_gemm import ACTIVATION_CODES
from ..ops.quantize import scale_shape
from ..problem import Layout, MoEProblem, hash_once, state_without_hash
from ..quant import FP8_DTYPE, FP8_MODES
from ..steps import step
from ..workspace.plan import BufferSpec
from .base import Experts
from .triton_experts import TritonExperts, fitted_config, gemm1_input, gemm_numerics, input_quantized, quant_outputs


@dataclass(frozen=True)
class BatchedLaunch:
    """Tile configs (fitted to the element size) and settings of one batched problem."""

    config: MoEConfig
    quant_mode: str | None
    static_scale: bool
    block_shape: tuple[int, int]
    ieee: bool

    __hash__ = hash_once  # a per-call cache key (the program's)
    __getstate__ = state_without_hash


def _counts(c) -> torch.Tensor:
    counts = c.x.expert_num_tokens
    if counts is None or counts.dtype != torch.int32:
        raise TypeError("the batched experts need expert_num_tokens (int32 [E])")
    return counts


@step
def _quantize_input(c, bx_a1q, bx_a1_scale=None, bx_a1_partial=None):
    x, p, L = c.x, c.p, c.launch
    if input_quantized(c):
        return
    E, T = p.E, p.max_tokens_per_expert
    batched_quantize(
        x.hidden_states.reshape(E * T, p.H),
        _counts(c),
        T,
        L.quant_mode,
        **quant_outputs(L, bx_a1q, bx_a1_scale, bx_a1_partial, x.a1_scale),
    )


def _gemm1_call(c, a, a_scale, bx_act) -> None:
    x, p, L = c.x, c.p, c.launch
    act = bx_act.view(p.E, p.max_tokens_per_expert, p.I)
    numerics = gemm_numerics(L, a_scale, x.w1_scale, p.E)
    batched_gemm1(a, x.w1, act, _counts(c), config=L.config.gemm1, activation=p.activation, numerics=numerics)


@step
def _gemm1(c, bx_act):
    _gemm1_call(c, c.x.hidden_states, None, bx_act)


@step
def _gemm1_fp8(c, bx_a1q, bx_act, bx_a1_scale=None):
    p = c.p
    _gemm1_call(c, *gemm1_input(c, bx_a1q.view(p.E, p.max_tokens_per_expert, p.H), bx_a1_scale), bx_act)


@step
def _quantize_act(c, bx_act, bx_a2q, bx_a2_scale=None, bx_a2_partial=None):
    x, p, L = c.x, c.p, c.launch
    outputs = quant_outputs(L, bx_a2q, bx_a2_scale, bx_a2_partial, x.a2_scale)
    batched_quantize(bx_act, _counts(c), p.max_tokens_per_expert, L.quant_mode, **outputs)


def _gemm2_call(c, a, a_scale) -> None:
    x, p, L = c.x, c.p, c.launch
    act = a.view(p.E, p.max_tokens_per_expert, p.I)
    batched_gemm2(
        act, x.w2, c.out, _counts(c), config=L.config.gemm2, numerics=gemm_numerics(L, a_scale, x.w2_scale, p.E)
    )


@step
def _gemm2(c, bx_act):
    _gemm2_call(c, bx_act, None)


@step
def _gemm2_fp8(c, bx_a2q, bx_a2_scale=None):
    _gemm2_call(c, bx_a2q, c.x.a2_scale if c.launch.static_scale else bx_a2_scale)


class BatchedTritonExperts(Experts):
    """Batched-layout Triton GEMMs (bf16/fp16/fp32, fp8 w8a8 e4m3 in every mode, MXFP4 weights).

    Args:
        fp32_ieee: as for :class:`~fusedmoe.experts.triton_experts.TritonExperts` (None follows torch's
            float32 matmul precision).
    """

    name = "triton"
    layout = Layout.BATCHED

    def __init__(self, fp32_ieee: bool | None = None):
        self._standard = TritonExperts(fp32_ieee)
        self._launches: dict[tuple, BatchedLaunch] = {}

    def supports(self, p: MoEProblem) -> str | None:
        if p.has_bias:
            return "the batched Triton experts do not implement expert biases"
        if p.activation not in ACTIVATION_CODES:
            return f"activation {p.activation!r} is not supported by the batched Triton experts"
        return self._standard.supports(p)

    def launch(self, p: MoEProblem) -> BatchedLaunch:
        """The launch of ``p`` under the configuration in effect now (cached under a key holding all of it)."""
        ieee = self._standard._ieee(p)
        key = (p, configs.source_key(), ieee)
        hit = self._launches.get(key)
        if hit is None:
            q = p.quant
            # A batched problem of T rows per expert behaves like a standard one of E*T/top_k tokens.
            m_lookup = max(1, p.E * p.max_tokens_per_expert // max(p.top_k, 1))
            hit = BatchedLaunch(
                fitted_config(p, m_lookup),
                q.mode if q is not None else None,
                bool(q is not None and q.static_activation_scale),
                tuple(q.block_shape) if q is not None else (128, 128),
                ieee,
            )
            if len(self._launches) > 4096:
                self._launches.clear()
            self._launches[key] = hit
        return hit

    def buffers(self, p: MoEProblem, launch: BatchedLaunch) -> list[BufferSpec]:
        """``bx_act`` [E*T, I] (+ fp8: quantized copies, scales, per-program partial maxima). No zero region."""
        R, H, I = p.E * p.max_tokens_per_expert, p.H, p.I
        if R == 0:
            return []
        f32 = torch.float32
        q = p.quant
        if q is None or not q.fp8:  # unquantized, or MXFP4 weights with float activations
            return [BufferSpec("bx_act", (R, I), p.dtype, region="2")]
        mode, gk = q.mode, q.block_shape[1]
        specs = [
            BufferSpec("bx_a1q", (R, H), FP8_DTYPE),
            BufferSpec("bx_act", (R, I), p.dtype, region="2"),
            BufferSpec("bx_a2q", (R, I), FP8_DTYPE, region="2"),
        ]
        if not q.static_activation_scale:
            specs.append(BufferSpec("bx_a1_scale", scale_shape(mode, R, H, gk), f32))
            specs.append(BufferSpec("bx_a2_scale", scale_shape(mode, R, I, gk), f32, region="2"))
            if mode == "fp8_tensor":
                n = batched_num_partials(p.E, p.max_tokens_per_expert)
                specs.append(BufferSpec("bx_a1_partial", (n,), f32))
                specs.append(BufferSpec("bx_a2_partial", (n,), f32, region="2"))
        return specs

    def steps(self, p: MoEProblem, launch: BatchedLaunch):
        if p.E * p.max_tokens_per_expert == 0:
            return []
        if launch.quant_mode not in FP8_MODES:
            return [_gemm1, _gemm2]
        return [_quantize_input, _gemm1_fp8, _quantize_act, _gemm2_fp8]


__all__ = ["BatchedLaunch", "BatchedTritonExperts"]
