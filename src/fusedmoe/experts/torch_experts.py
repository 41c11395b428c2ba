"""Experts in plain torch index ops: runs on any device, the default backend on machines without a GPU.

Algorithm (standard layout), every buffer from the plan, one step each:
  1. ``sort``: key each (token, slot) pair with its local expert (non-local or out-of-range ids -> key E, sorted
     last), stable-sort the keys, find each expert's segment with ``searchsorted`` (the one host sync);
  2. ``gather``: the token rows in sorted order, in float32 (scaled by the routing weight if it applies on the
     input);
  3. ``gemm1``/``activate``/``gemm2``: per expert with tokens, GEMM1 (+ bias) into ``gate_up``, the activation
     into ``act``, GEMM2 (+ bias) into ``y_sorted``; rows of non-local slots are written as zeros;
  4. ``reduce``: weight, un-permute into slot order, sum over top-k into the output.

Precision: the rounding points of the Triton kernels (and of vLLM's reference): GEMMs accumulate in float32,
the activation is computed in float32 and rounded once to the input dtype (GEMM2's operand), the expert outputs,
their weights and the top-k sum stay float32, and the output is rounded once.

Weights: 16-bit, fp8 and MXFP4 weights are converted (dequantized with their scales) to float32 in row chunks of
``W_CHUNK`` rows through one planned staging buffer, so no float32 copy of a whole expert ever exists (an MXFP4
chunk's decode, and fp8 block scales whose width does not divide K, take a chunk-sized temporary).

fp8 (w8a8) is emulated: each GEMM's input goes through the e4m3 rounding the Triton kernels apply
(:func:`fusedmoe.quant.fake_quantize_activation`, with temporaries of the rows it rounds; scales over the same
rows: every token for GEMM1, every local slot row for GEMM2), then the float32 GEMM runs on the dequantized
operands. Rows that arrive in e4m3 (expert parallelism's prepare) are dequantized with their ``a1_scale``, not
rounded again. Not modelled: the Triton kernels' weight-only decode tiles, which skip the activation rounding.

This backend is not CUDA-graph capturable (step 1 reads the segment offsets on the host); the Triton backend is.
"""

from __future__ import annotations

import torch

from ..mxfp4 import dequantize_mxfp4
from ..mxfp4_layout import from_mma_layout
from ..problem import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, Layout, MoEProblem
from ..quant import FP8_DTYPE, QuantConfig, fake_quantize_activation, per_element_scales
from ..steps import step
from ..workspace.plan import BufferSpec
from .base import Experts

#: Rows of a 16-bit weight matrix converted to float32 at a time (bounds the staging buffer).
W_CHUNK = 256

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


def activate(gate: torch.Tensor, up: torch.Tensor, activation: str, out: torch.Tensor) -> torch.Tensor:
    """``out = act(gate) * up`` for the gated activations; ``gate`` and ``up`` may be modified in place."""
    if activation == "silu":
        torch.ops.aten.silu.out(gate, out=out)
    elif activation == "gelu":
        torch.ops.aten.gelu.out(gate, approximate="tanh", out=out)
    elif activation == "gelu_exact":
        torch.ops.aten.gelu.out(gate, approximate="none", out=out)
    else:  # swigluoai: g * sigmoid(alpha g) * (u + 1), g = min(gate, L), u = clamp(up, -L, L)
        gate.clamp_(max=SWIGLUOAI_LIMIT)
        up.clamp_(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT).add_(1.0)
        torch.mul(gate, SWIGLUOAI_ALPHA, out=out)
        out.sigmoid_().mul_(gate)
    return out.mul_(up)


def _linear(
    a: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    stage: torch.Tensor | None,
    w_scale: torch.Tensor | None = None,
    quant: QuantConfig | None = None,
    gated: bool = False,
) -> None:
    """``out = a @ w.T (+ bias)`` in float32 (``a``, ``out`` float32; ``w`` [N, K] in any float dtype, e4m3 with
    this expert's scales ``w_scale`` under an fp8 ``quant``, or MXFP4 bytes [N, K/2] with their e8m0 ``w_scale``
    [N, K/32], or both in the mma layout, where ``gated`` says the rows are GEMM1's interleaved gate and up).

    A float32 ``w`` is used as it is; otherwise its rows are converted (fp8: dequantized; MXFP4: decoded)
    ``W_CHUNK`` at a time into ``stage`` (mma-layout MXFP4 first back to the checkpoint layout, in a temporary of
    one expert's bytes).
    """
    if w.dtype == torch.float32:
        if bias is None:
            torch.mm(a, w.t(), out=out)
        else:
            torch.addmm(bias.float(), a, w.t(), out=out)
        return
    mxfp4 = quant is not None and quant.mode == "mxfp4"
    if mxfp4 and quant.layout == "mma":  # back to the checkpoint layout (one expert's bytes) for the row decode
        w, w_scale = from_mma_layout(w, w_scale, a.shape[1], gated)
    N, K = w.shape[0], 2 * w.shape[1] if mxfp4 else w.shape[1]
    for n0 in range(0, N, W_CHUNK):
        n1 = min(n0 + W_CHUNK, N)
        wf = stage[: (n1 - n0) * K].view(n1 - n0, K)
        if mxfp4:
            wf.copy_(dequantize_mxfp4(w[n0:n1], w_scale[n0:n1]))
        else:
            wf.copy_(w[n0:n1])
            if quant is not None:
                _scale_fp8_rows_(wf, w_scale, quant, n0)
        if bias is None:
            torch.mm(a, wf.t(), out=out[:, n0:n1])
        else:
            torch.addmm(bias[n0:n1].float(), a, wf.t(), out=out[:, n0:n1])


def _scale_fp8_rows_(wf: torch.Tensor, w_scale: torch.Tensor, quant: QuantConfig, n0: int) -> None:
    """Multiply ``wf`` (float32 [n, K]: rows ``n0:n0 + n`` of one expert's e4m3 weight) in place by their scales:
    fp8_tensor's one scale, fp8_token's per-row scales [N], or fp8_block's [cdiv(N, bn), cdiv(K, bk)] tiles."""
    n, K = wf.shape
    s = w_scale.float()
    if quant.mode == "fp8_tensor":
        wf.mul_(s.reshape(()))
    elif quant.mode == "fp8_token":
        wf.mul_(s.reshape(-1)[n0 : n0 + n, None])
    else:
        bn, bk = quant.block_shape
        tiles = s[torch.arange(n0, n0 + n, device=s.device) // bn]  # [n, cdiv(K, bk)]: each row's block scales
        if K % bk == 0:  # whole blocks: broadcast over each block's columns, no [n, K] copy of the scales
            wf.view(n, K // bk, bk).mul_(tiles[:, :, None])
        else:
            wf.mul_(per_element_scales(tiles, quant, K))


def _fp8_round_(c, rows: torch.Tensor, static_scale: torch.Tensor | None) -> None:
    """Round ``rows`` (float32 [n, K], in place) through e4m3 as the Triton kernels quantize a GEMM's input under
    the problem's fp8 mode (the caller's static per-tensor scale when the mode takes one); no-op otherwise."""
    q = c.p.quant
    if q is None or not q.fp8 or rows.shape[0] == 0:
        return
    rows.copy_(fake_quantize_activation(rows, q, scale=static_scale if q.static_activation_scale else None))


@step
def _sort(c, keys, sorted_keys, order, offsets):
    p = c.p
    local_expert_keys(c.x.topk_ids, c.x.expert_map, p.E, p.global_E, out=keys, scratch=sorted_keys)
    torch.sort(keys, stable=True, out=(sorted_keys, order))
    torch.searchsorted(sorted_keys, _expert_bounds(p.E, keys.device), out=offsets)
    c.state["offsets"] = offsets.tolist()  # the one host sync of this backend


@step
def _gather(c, order, token_of, w_sorted, a_sorted, a_rows=None):
    x = c.x
    torch.div(order, c.p.top_k, rounding_mode="floor", out=token_of)
    torch.index_select(x.topk_weights.reshape(-1).to(torch.float32), 0, order, out=w_sorted)
    if x.hidden_states.dtype == FP8_DTYPE:  # rows prepare quantized (expert parallelism): already e4m3
        _dequantized_rows(c, token_of, a_sorted)
    else:
        if a_rows is None:  # float32 inputs: gather straight into the float32 buffer
            torch.index_select(x.hidden_states, 0, token_of, out=a_sorted)
        else:
            torch.index_select(x.hidden_states, 0, token_of, out=a_rows)
            a_sorted.copy_(a_rows)
        # fp8: every token is gathered (top_k times), so a per-tensor scale over these rows is the kernels' over x
        _fp8_round_(c, a_sorted, x.a1_scale)
    if c.p.apply_router_weight_on_input:
        a_sorted.mul_(w_sorted[:, None])


def _dequantized_rows(c, token_of: torch.Tensor, out: torch.Tensor) -> None:
    """Rows ``token_of`` of e4m3 ``hidden_states`` (quantized by prepare, scales in ``a1_scale``: [1] per tensor,
    [rows, 1] per token, [rows, cdiv(H, bk)] per block) dequantized into ``out`` (float32)."""
    x, q = c.x, c.p.quant
    if x.a1_scale is None:
        raise ValueError("fp8 hidden_states need a1_scale")
    out.copy_(x.hidden_states.index_select(0, token_of))
    scale = x.a1_scale.float()
    if q.mode != "fp8_tensor":  # row scales: those of the gathered rows
        scale = scale.reshape(scale.shape[0], -1).index_select(0, token_of)
    out.mul_(per_element_scales(scale, q, out.shape[1]))


def _expert_scale(c, w_scale: torch.Tensor | None, e: int) -> torch.Tensor | None:
    """Expert ``e``'s weight scales when the weights are quantized, else None."""
    return w_scale[e] if c.p.quant is not None else None


@step
def _gemm1(c, a_sorted, gate_up, w_stage=None):
    offsets, x = c.state["offsets"], c.x
    for e in range(c.p.E):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            b1 = x.w1_bias[e] if x.w1_bias is not None else None
            w_scale = _expert_scale(c, x.w1_scale, e)
            _linear(a_sorted[lo:hi], x.w1[e], b1, gate_up[lo:hi], w_stage, w_scale, c.p.quant, gated=True)


@step
def _activate(c, gate_up, act, act_rounded=None):
    n, I = c.state["offsets"][c.p.E], c.p.I
    activate(gate_up[:n, :I], gate_up[:n, I:], c.p.activation, act[:n])
    if act_rounded is not None:  # GEMM2 reads the activation in the input dtype, as the Triton kernels do
        act_rounded[:n].copy_(act[:n])
        act[:n].copy_(act_rounded[:n])
    _fp8_round_(c, act[:n], c.x.a2_scale)  # fp8: over the local slot rows, as the kernels quantize GEMM2's input


@step
def _gemm2(c, act, y_sorted, w_sorted, w_stage=None):
    offsets, x, p = c.state["offsets"], c.x, c.p
    for e in range(p.E):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            b2 = x.w2_bias[e] if x.w2_bias is not None else None
            w_scale = _expert_scale(c, x.w2_scale, e)
            _linear(act[lo:hi], x.w2[e], b2, y_sorted[lo:hi], w_stage, w_scale, c.p.quant)
    n = offsets[p.E]
    if not p.apply_router_weight_on_input:
        y_sorted[:n].mul_(w_sorted[:n, None])
    y_sorted[n:].zero_()  # non-local slots contribute nothing: these rows are results, not a fill


@step
def _reduce(c, order, y_sorted, y_slot, y_sum=None):
    y_slot.index_copy_(0, order, y_sorted)
    # sum in float32, then the one rounding to the output dtype (torch.sum with a 16-bit out= tensor rounds the
    # float32 rows to 16 bits before adding them)
    torch.sum(y_slot.view(c.p.M, c.p.top_k, -1), dim=1, out=c.out if y_sum is None else y_sum)
    if y_sum is not None:
        c.out.copy_(y_sum)


class TorchExperts(Experts):
    """Reference-grade experts in torch (bf16/fp16/fp32 activations, float32 math; fp8 and MXFP4 weights
    dequantized in row chunks, fp8 activations emulated by e4m3 rounding)."""

    name = "torch"
    layout = Layout.STANDARD

    def buffers(self, p: MoEProblem, launch=None) -> list[BufferSpec]:
        if p.M == 0:
            return []
        S, H, I, E = p.slots, p.H, p.I, p.E
        i64, f32 = torch.int64, torch.float32
        specs = [
            BufferSpec("keys", (S,), i64),
            BufferSpec("sorted_keys", (S,), i64),
            BufferSpec("order", (S,), i64),
            BufferSpec("offsets", (E + 1,), i64),
            BufferSpec("token_of", (S,), i64),
            BufferSpec("w_sorted", (S,), f32),
            BufferSpec("a_sorted", (S, H), f32, region="13"),
            BufferSpec("gate_up", (S, 2 * I), f32, region="2"),
            BufferSpec("act", (S, I), f32, region="13"),
            BufferSpec("y_sorted", (S, H), f32, region="2"),
            BufferSpec("y_slot", (S, H), f32, region="13"),
        ]
        if p.dtype != f32:
            specs.append(BufferSpec("a_rows", (S, H), p.dtype, region="2"))
            specs.append(BufferSpec("y_sum", (p.M, H), f32, region="2"))
            specs.append(BufferSpec("act_rounded", (S, I), p.dtype, region="2"))
        if p.weight_dtype != f32:
            stage = max(min(W_CHUNK, 2 * I) * H, min(W_CHUNK, H) * I)  # the larger of GEMM1's and GEMM2's chunk
            specs.append(BufferSpec("w_stage", (stage,), f32, region="2"))
        return specs

    def steps(self, p: MoEProblem, launch=None):
        return [] if p.M == 0 else [_sort, _gather, _gemm1, _activate, _gemm2, _reduce]
