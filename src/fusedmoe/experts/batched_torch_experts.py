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
from ..steps import step
from ..workspace.plan import BufferSpec
from .base import Experts
from .torch_experts import activate


@step
def _copy_valid_rows(c, bt_padded, bt_a):
    p, x = c.p, c.x
    E, T = p.E, p.max_tokens_per_expert
    torch.ge(_arange(T, bt_a.device).view(1, T, 1), x.expert_num_tokens.view(E, 1, 1), out=bt_padded)
    bt_a.copy_(x.hidden_states).masked_fill_(bt_padded, 0.0)


@step
def _gemm1(c, bt_a, bt_gate_up):
    torch.bmm(bt_a, c.x.w1.transpose(1, 2), out=bt_gate_up)


@step
def _activate(c, bt_gate_up, bt_act):
    I = c.p.I
    activate(bt_gate_up[..., :I], bt_gate_up[..., I:], c.p.activation, bt_act)


@step
def _gemm2(c, bt_act):
    torch.bmm(bt_act, c.x.w2.transpose(1, 2), out=c.out)


class BatchedTorchExperts(Experts):
    """Batched-layout experts with ``torch.bmm`` (see module docs)."""

    name = "torch"
    layout = Layout.BATCHED

    def supports(self, p: MoEProblem) -> str | None:
        if p.has_bias:
            return "the batched torch experts do not implement expert biases"
        if p.activation not in ("silu", "gelu", "swigluoai", "gelu_exact"):
            return f"activation {p.activation!r} is not supported"
        if p.quant is not None:
            name = p.quant.name
            return f"the torch batched experts do not implement quantized weights ({name}); use the Triton backend"
        if p.weight_dtype != p.dtype:
            return f"weight dtype {p.weight_dtype} must match the activation dtype {p.dtype}"
        return None

    def buffers(self, p: MoEProblem, launch=None) -> list[BufferSpec]:
        E, T, I = p.E, p.max_tokens_per_expert, p.I
        if E * T == 0:
            return []
        return [
            BufferSpec("bt_padded", (E, T, 1), torch.bool, region="2"),
            BufferSpec("bt_a", (E, T, p.H), p.dtype, region="13"),
            BufferSpec("bt_gate_up", (E, T, 2 * I), p.dtype, region="2"),
            BufferSpec("bt_act", (E, T, I), p.dtype, region="13"),
        ]

    def steps(self, p: MoEProblem, launch=None):
        if p.E * p.max_tokens_per_expert == 0:
            return []
        return [_copy_valid_rows, _gemm1, _activate, _gemm2]


__all__ = ["BatchedTorchExperts"]
