"""Reference-grade experts for the batched layout in plain torch (any device, bf16/fp16/fp32, no fp8).

Input ``[E, T, H]`` plus ``expert_num_tokens [E]``; output ``[E, T, H]``. Two ``bmm`` over all T rows of every
expert (no host sync, so the call can be captured in a CUDA graph), with the gated activation in between:

    gate_up[e] = a[e] @ w1[e].T ;  act[e] = act_fn(gate) * up ;  y[e] = act[e] @ w2[e].T

The padded rows past ``expert_num_tokens[e]`` are never written by prepare (garbage or NaN), and a matrix
product need not keep them to their own output rows: torch 2.11's CPU bf16 ``bmm`` spreads a NaN input row
into valid rows (torch 2.13's does not; seen through the hypothesis properties on the GPU machine's host).
So GEMM1 reads a copy of the input (a planned buffer; the caller's tensor is untouched) whose padded rows are
0; every later step is row-wise and keeps padded rows finite, and finalize never reads them. There is no
reduction over rows and no per-tensor scale. The cost is the full E*T rows; the Triton batched experts
compute the valid rows only.
"""

from __future__ import annotations

import torch

from ..prepare_finalize.batched import _arange
from ..problem import Layout, MoEProblem
from ..workspace.manager import Workspace
from ..workspace.plan import BufferSpec, Phase
from .base import Experts, ExpertsInputs


class BatchedTorchExperts(Experts):
    """Batched-layout experts with ``torch.bmm`` (see module docs)."""

    name = "torch"
    layout = Layout.BATCHED

    def supports(self, p: MoEProblem) -> str | None:
        if p.has_bias:
            return "the batched torch experts do not implement expert biases"
        if p.activation not in ("silu", "gelu", "swigluoai"):
            return f"activation {p.activation!r} is not supported"
        if p.quant is not None:
            return "the torch batched experts do not implement fp8 quantization; use BatchedTritonExperts"
        if p.weight_dtype != p.dtype:
            return f"weight dtype {p.weight_dtype} must match the activation dtype {p.dtype}"
        return None

    def plan(self, p: MoEProblem) -> list[BufferSpec]:
        E, T, I = p.E, p.max_tokens_per_expert, p.I
        return [
            BufferSpec("bt_padded", (E, T, 1), torch.bool, Phase.GEMM1, Phase.GEMM1, region="2"),
            BufferSpec("bt_a", (E, T, p.H), p.dtype, Phase.GEMM1, Phase.GEMM1, region="13"),
            BufferSpec("bt_gate_up", (E, T, 2 * I), p.dtype, Phase.GEMM1, Phase.ACTIVATION, region="2"),
            BufferSpec("bt_act", (E, T, I), p.dtype, Phase.ACTIVATION, Phase.GEMM2, region="13"),
        ]

    def apply(self, output: torch.Tensor, x: ExpertsInputs, p: MoEProblem, ws: Workspace) -> None:
        if x.w1_bias is not None or x.w2_bias is not None:
            raise NotImplementedError("the batched torch experts do not implement expert biases")
        E, T, I = p.E, p.max_tokens_per_expert, p.I
        if E == 0 or T == 0:
            return
        padded, a = ws["bt_padded"], ws["bt_a"]
        torch.ge(_arange(T, a.device).view(1, T, 1), x.expert_num_tokens.view(E, 1, 1), out=padded)
        a.copy_(x.hidden_states).masked_fill_(padded, 0.0)
        gate_up, act = ws["bt_gate_up"], ws["bt_act"]
        torch.bmm(a, x.w1.transpose(1, 2), out=gate_up)
        gate, up = gate_up[..., :I], gate_up[..., I:]
        if p.activation == "silu":
            torch.ops.aten.silu.out(gate, out=act)
        elif p.activation == "gelu":
            torch.ops.aten.gelu.out(gate, approximate="tanh", out=act)
        else:  # swigluoai (gpt-oss): min(g, L) * sigmoid(alpha * min(g, L)) * (clamp(u, -L, L) + 1)
            from ..problem import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

            gate.clamp_(max=SWIGLUOAI_LIMIT)
            up.clamp_(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT).add_(1.0)
            torch.mul(gate, SWIGLUOAI_ALPHA, out=act)
            act.sigmoid_().mul_(gate)
        act.mul_(up)
        torch.bmm(act, x.w2.transpose(1, 2), out=output)


__all__ = ["BatchedTorchExperts"]
