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

import torch

from ..ops.batched_gemm import _ACTIVATIONS, batched_gemm1, batched_gemm2
from ..ops.batched_quantize import batched_num_partials, batched_quantize
from ..ops.configs import MoEConfig, device_name, get_config
from ..ops.quantize import scale_shape
from ..problem import Layout, MoEProblem
from ..quant import FP8_DTYPE
from ..workspace.manager import Workspace
from ..workspace.plan import BufferSpec, Phase
from .base import Experts, ExpertsInputs
from .triton_experts import TritonExperts


class BatchedTritonExperts(Experts):
    """Batched-layout Triton GEMMs (bf16/fp16/fp32, fp8 w8a8 e4m3 in every mode).

    Args:
        fp32_ieee: for float32 inputs on the GPU, use IEEE fp32 dots instead of TF32.
    """

    name = "triton"
    layout = Layout.BATCHED

    def __init__(self, fp32_ieee: bool = False):
        self.fp32_ieee = fp32_ieee
        self._configs: dict[tuple, MoEConfig] = {}

    def supports(self, p: MoEProblem) -> str | None:
        if p.has_bias:
            return "the batched Triton experts do not implement expert biases"
        if p.activation not in _ACTIVATIONS:
            return f"activation {p.activation!r} is not supported by the batched Triton experts"
        return TritonExperts().supports(p)

    def config(self, p: MoEProblem) -> MoEConfig:
        from ..ops import configs as _cfg

        key = (p, _cfg._PINNED.get() or _cfg._PINNED_GLOBAL[0])
        cfg = self._configs.get(key)
        if cfg is None:
            q = p.quant
            mode = q.mode if q is not None else None
            shape = q.block_shape if (q is not None and mode == "fp8_block") else None
            # A batched problem of T rows per expert behaves like a standard one of E*T/top_k tokens.
            m_lookup = max(1, p.E * p.max_tokens_per_expert // max(p.top_k, 1))
            cfg = get_config(m_lookup, p.E, p.H, p.I, p.top_k, quant_mode=mode, block_shape=shape,
                             device=device_name() if torch.cuda.is_available() else "cpu")
            if len(self._configs) > 4096:
                self._configs.clear()
            self._configs[key] = cfg
        return cfg

    def plan(self, p: MoEProblem) -> list[BufferSpec]:
        """``act`` [E*T, I] (+ fp8: quantized copies, scales, per-program partial maxima). No zero region."""
        R, H, I = p.E * p.max_tokens_per_expert, p.H, p.I
        f32, P, G1, A, G2 = torch.float32, Phase.PREPARE, Phase.GEMM1, Phase.ACTIVATION, Phase.GEMM2
        q = p.quant
        if q is None:
            return [BufferSpec("bx_act", (R, I), p.dtype, G1, G2, region="2")]
        mode, gk = q.mode, q.block_shape[1]
        specs = [
            BufferSpec("bx_a1q", (R, H), FP8_DTYPE, P, G1),
            BufferSpec("bx_act", (R, I), p.dtype, G1, A, region="2"),
            BufferSpec("bx_a2q", (R, I), FP8_DTYPE, A, G2, region="2"),
        ]
        if not q.static_activation_scale:
            specs.append(BufferSpec("bx_a1_scale", scale_shape(mode, R, H, gk), f32, P, G1))
            specs.append(BufferSpec("bx_a2_scale", scale_shape(mode, R, I, gk), f32, A, G2, region="2"))
        if mode == "fp8_tensor" and not q.static_activation_scale:
            n = batched_num_partials(p.E, p.max_tokens_per_expert)
            specs.append(BufferSpec("bx_a1_partial", (n,), f32, P, P))
            specs.append(BufferSpec("bx_a2_partial", (n,), f32, A, A, region="2"))
        return specs

    def apply(self, output: torch.Tensor, x: ExpertsInputs, p: MoEProblem, ws: Workspace) -> None:
        if x.w1_bias is not None or x.w2_bias is not None:
            raise NotImplementedError("the Triton experts do not implement expert biases")
        E, T, H, I = p.E, p.max_tokens_per_expert, p.H, p.I
        if E == 0 or T == 0:
            return
        cfg = self.config(p)
        counts = x.expert_num_tokens
        if counts is None or counts.dtype != torch.int32:
            raise TypeError("the batched experts need expert_num_tokens (int32 [E])")
        q = p.quant
        mode = q.mode if q is not None else None
        bs = q.block_shape if q is not None else (128, 128)
        static = q is not None and q.static_activation_scale
        if static and (x.a1_scale is None or x.a2_scale is None):
            raise ValueError("fp8_tensor with static activation scales needs a1_scale and a2_scale")
        w1s = TritonExperts._w_scale(x.w1_scale, mode, E)
        w2s = TritonExperts._w_scale(x.w2_scale, mode, E)

        a, a_scale = x.hidden_states, None
        if mode is not None:
            if a.dtype == FP8_DTYPE:  # quantized by prepare
                if x.a1_scale is None:
                    raise ValueError("fp8 hidden_states need a1_scale")
                a_scale = x.a1_scale
            else:
                aq, a_scale = batched_quantize(
                    a.reshape(E * T, H), counts, T, mode, out=ws["bx_a1q"],
                    scale_out=None if static else ws["bx_a1_scale"], static_scale=x.a1_scale if static else None,
                    partial=ws["bx_a1_partial"] if "bx_a1_partial" in ws else None, group_k=bs[1])
                a = aq.view(E, T, H)
        act = ws["bx_act"].view(E, T, I)
        batched_gemm1(a, x.w1, act, counts, config=cfg.gemm1, activation=p.activation, quant_mode=mode,
                      a_scale=a_scale, w_scale=w1s, block_shape=bs, fp32_ieee=self.fp32_ieee)
        a2, a2_scale = act, None
        if mode is not None:
            a2q, a2_scale = batched_quantize(
                ws["bx_act"], counts, T, mode, out=ws["bx_a2q"],
                scale_out=None if static else ws["bx_a2_scale"], static_scale=x.a2_scale if static else None,
                partial=ws["bx_a2_partial"] if "bx_a2_partial" in ws else None, group_k=bs[1])
            a2 = a2q.view(E, T, I)
        batched_gemm2(a2, x.w2, output, counts, config=cfg.gemm2, quant_mode=mode, a_scale=a2_scale,
                      w_scale=w2s, block_shape=bs, fp32_ieee=self.fp32_ieee)


__all__ = ["BatchedTritonExperts"]
