"""Experts in plain torch index ops: runs on any device, the default backend on machines without a GPU.

Algorithm (standard layout), every buffer from the plan:
  1. key each (token, slot) pair with its local expert (non-local or out-of-range ids -> key E, sorted last),
     stable-sort the keys, find each expert's segment with ``searchsorted``;
  2. gather the token rows in sorted order (scaled by the routing weight if it applies on the input);
  3. per expert with tokens: GEMM1 (+ bias) into ``gate_up``, activation into ``act``, GEMM2 (+ bias) into
     ``y_sorted``; rows of non-local slots are written as zeros;
  4. weight, un-permute into slot order, sum over top-k into the output.
One host sync per call reads the segment offsets (so this backend is not CUDA-graph capturable; the Triton
backend is).
"""

from __future__ import annotations

import torch

from ..problem import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, Layout, MoEProblem
from ..workspace.manager import Workspace
from ..workspace.plan import BufferSpec, Phase
from .base import Experts, ExpertsInputs

_BOUNDS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _expert_bounds(E: int, device: torch.device) -> torch.Tensor:
    """int64 [E + 1] = 0..E, cached per device (the search keys of each expert segment's start)."""
    key = (E, device)
    t = _BOUNDS.get(key)
    if t is None:
        t = _BOUNDS[key] = torch.arange(E + 1, dtype=torch.int64, device=device)
    return t


def local_expert_keys(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    E: int,
    global_E: int,
    out: torch.Tensor,
    scratch: torch.Tensor,
) -> torch.Tensor:
    """Write int64 [M*k] local expert ids into ``out`` (``scratch``: int64 [M*k]); slots that are not local
    (or whose id is out of range) get E."""
    ids = scratch if expert_map is not None else out
    ids.copy_(topk_ids.reshape(-1))
    valid = (ids >= 0) & (ids < global_E)
    ids.clamp_(0, max(global_E - 1, 0))
    if expert_map is not None:
        torch.index_select(expert_map.to(torch.int64), 0, ids, out=out)
        valid &= out >= 0
    valid &= out < E
    return out.masked_fill_(~valid, E)


class TorchExperts(Experts):
    """Reference-grade experts in torch (bf16/fp16/fp32, no fp8)."""

    name = "torch"
    layout = Layout.STANDARD

    def supports(self, p: MoEProblem) -> str | None:
        if p.quant is not None:
            return "the torch experts do not implement fp8 quantization; use backend='triton'"
        return None

    def plan(self, p: MoEProblem) -> list[BufferSpec]:
        S, H, I, E = p.slots, p.H, p.I, p.E
        i64, f32, dt = torch.int64, torch.float32, p.dtype
        return [
            BufferSpec("keys", (S,), i64, Phase.ALIGN, Phase.ALIGN),
            BufferSpec("sorted_keys", (S,), i64, Phase.ALIGN, Phase.ALIGN),
            BufferSpec("order", (S,), i64, Phase.ALIGN, Phase.REDUCE),
            BufferSpec("offsets", (E + 1,), i64, Phase.ALIGN, Phase.ALIGN),
            BufferSpec("token_of", (S,), i64, Phase.ALIGN, Phase.GATHER),
            BufferSpec("w_sorted", (S,), f32, Phase.ALIGN, Phase.GEMM2),
            BufferSpec("a_sorted", (S, H), dt, Phase.GATHER, Phase.GEMM1, region="13"),
            BufferSpec("gate_up", (S, 2 * I), dt, Phase.GEMM1, Phase.ACTIVATION, region="2"),
            BufferSpec("act", (S, I), dt, Phase.ACTIVATION, Phase.GEMM2, region="13"),
            BufferSpec("y_sorted", (S, H), dt, Phase.GEMM2, Phase.REDUCE, region="2"),
            BufferSpec("y_slot", (S, H), dt, Phase.REDUCE, Phase.REDUCE, region="13"),
        ]

    def apply(self, output: torch.Tensor, x: ExpertsInputs, p: MoEProblem, ws: Workspace) -> None:
        M, k, E, I = p.M, p.top_k, p.E, p.I
        S = p.slots
        keys, order, sorted_keys = ws["keys"], ws["order"], ws["sorted_keys"]
        local_expert_keys(x.topk_ids, x.expert_map, E, p.global_E, out=keys, scratch=sorted_keys)
        torch.sort(keys, stable=True, out=(sorted_keys, order))
        torch.searchsorted(sorted_keys, _expert_bounds(E, keys.device), out=ws["offsets"])
        offsets = ws["offsets"].tolist()  # the one host sync of this backend
        n_local = offsets[E]

        token_of, w_sorted = ws["token_of"], ws["w_sorted"]
        torch.div(order, k, rounding_mode="floor", out=token_of)
        torch.index_select(x.topk_weights.reshape(-1).to(torch.float32), 0, order, out=w_sorted)
        a = ws["a_sorted"]
        torch.index_select(x.hidden_states, 0, token_of, out=a)
        if p.apply_router_weight_on_input:
            a.mul_(w_sorted[:, None])

        gate_up, act, y = ws["gate_up"], ws["act"], ws["y_sorted"]
        b1, b2 = x.w1_bias, x.w2_bias
        for e in range(E):
            lo, hi = offsets[e], offsets[e + 1]
            if hi > lo:
                if b1 is None:
                    torch.mm(a[lo:hi], x.w1[e].t(), out=gate_up[lo:hi])
                else:
                    torch.addmm(b1[e], a[lo:hi], x.w1[e].t(), out=gate_up[lo:hi])
        act_n, gate, up = act[:n_local], gate_up[:n_local, :I], gate_up[:n_local, I:]
        if p.activation == "silu":
            torch.ops.aten.silu.out(gate, out=act_n)
        elif p.activation == "gelu":
            torch.ops.aten.gelu.out(gate, approximate="tanh", out=act_n)
        else:  # swigluoai: g * sigmoid(alpha g) * (u + 1), g = min(gate, L), u = clamp(up, -L, L)
            gate.clamp_(max=SWIGLUOAI_LIMIT)
            up.clamp_(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT).add_(1.0)
            torch.mul(gate, SWIGLUOAI_ALPHA, out=act_n)
            act_n.sigmoid_().mul_(gate)
        act_n.mul_(up)
        for e in range(E):
            lo, hi = offsets[e], offsets[e + 1]
            if hi > lo:
                if b2 is None:
                    torch.mm(act[lo:hi], x.w2[e].t(), out=y[lo:hi])
                else:
                    torch.addmm(b2[e], act[lo:hi], x.w2[e].t(), out=y[lo:hi])
        if not p.apply_router_weight_on_input:
            y[:n_local].mul_(w_sorted[:n_local, None])
        y[n_local:S].zero_()  # non-local slots contribute nothing: these rows are results, not a fill

        y_slot = ws["y_slot"]
        y_slot.index_copy_(0, order, y)
        torch.sum(y_slot.view(M, k, -1), dim=1, out=output)
