"""The MoE layer's backward with the Triton kernels of :mod:`fusedmoe.ops.moe_backward`, as a planned program.

Steps (each a :func:`~fusedmoe.steps.step`; the buffers it names are its scratch, lifetimes derived by the plan):
``align`` (the forward's alignment, recomputed: a few µs), ``bwd_act`` (GEMM1's output recomputed + ``g W2`` +
the activation's backward -> ``dh``, ``act`` in the aligned order, ``dw_partial``), ``gather_dy`` + ``dw2``
(``w g`` gathered into the aligned order, then ``dW2``, ``db2``), ``dweights`` (the routing weights' gradient),
``dx_slots`` (``dh W1`` per slot, the forward's GEMM2 kernel on W1's transpose), ``dx`` (the forward's top-k
reduce), ``gather_x`` + ``dw1`` (``x`` gathered, then ``dW1``, ``db1``). With the forward's saved GEMM1 output the
order starts ``act_saved`` (the activation from it), ``gather_dy``, ``dw2``, then ``bwd_act_saved`` (``g W2`` +
the activation's backward -> ``dh``), so the activation and ``w g`` are dead before ``dh`` exists: the plan's
peak is then ``dh`` plus one [P, H] operand. Steps whose gradients nobody asked for are left out.

Both weight-gradient GEMMs read their operands as contiguous rows of the aligned order: on the H200 that ran
at ~520 TFLOP/s against ~225 with x's rows gathered by token inside the K loop (mixtral-8x7b, M=4096).

Scratch comes from the same :class:`~fusedmoe.workspace.manager.WorkspaceManager` as the forward (so it is
shared across layers, poison-checked and counted in ``WorkspaceStats``); the gradients are fresh tensors whose
every element the kernels write (no fills).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..experts.triton_experts import align_slots
from ..ops.align import AlignParams, align_params
from ..ops.configs import GemmConfig
from ..ops.expert_gemm import Numerics
from ..ops.grouped_gemm import grid_blocks, moe_gemm2
from ..ops.moe_backward import (
    bwd_act_tiles,
    expert_block_ranges,
    gather_aligned,
    moe_bwd_act,
    moe_dweights,
    moe_wgrad,
)
from ..ops.reduce import moe_reduce
from ..problem import MoEProblem, hash_once
from ..steps import Call, Program, step
from ..workspace.manager import WorkspaceManager
from ..workspace.plan import BufferSpec
from .torch_backward import MoEGradients


@dataclass(frozen=True)
class BackwardInputs:
    """The saved forward inputs and the incoming gradient ``grad_out`` [M, H] (contiguous)."""

    hidden_states: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    expert_map: torch.Tensor | None
    w1_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    grad_out: torch.Tensor
    preact: torch.Tensor | None = None  # the forward's raw GEMM1 output [M*k, 2I] by slot, or None: recompute


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch settings of one backward kernel: BLOCK_N, BLOCK_K (both powers of two >= 16)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class BackwardLaunch:
    """Tile choices of one backward call and which gradients it computes (hidden_states, w1, w2, topk_weights,
    w1_bias, w2_bias). ``block_m`` is the alignment's block: the M tile of ``bwd_act`` and ``dx_slots``."""

    block_m: int
    align: AlignParams
    num_blocks: int
    act: Tiles  # BLOCK_N over I, BLOCK_K over H
    wgrad: Tiles  # BLOCK_N, BLOCK_K of the [N, K] output tile
    wgrad_step: int  # rows per K step of the weight-gradient GEMMs (a power of two)
    saved: bool  # the forward saved GEMM1's output (the program computes dW2 before dh)
    dx: GemmConfig
    ieee: bool
    needs: tuple[bool, bool, bool, bool, bool, bool]

    __hash__ = hash_once


def _pow2_between(n: int, lo: int, hi: int) -> int:
    p = lo
    while p < hi and p < n:
        p *= 2
    return p


#: Tile choices pinned by :func:`pin_backward_tiles` (the tuning sweep); None: the heuristic below.
_PINNED: dict[str, object] = {}


def pin_backward_tiles(**tiles) -> None:
    """Pin ``block_m`` / ``wgrad_step`` (int), ``act`` / ``wgrad`` (:class:`Tiles`) or ``dx`` (GemmConfig) for
    later calls; no arguments unpins all. For tuning sweeps."""
    if not tiles:
        _PINNED.clear()
    _PINNED.update(tiles)


def backward_launch(p: MoEProblem, needs: tuple[bool, ...], ieee: bool = False, saved: bool = False) -> BackwardLaunch:
    """Tiles by rows per expert, from an H200 sweep of the whole backward's time per tile candidate, clamped
    to the problem's widths. ``saved``: the forward saved GEMM1's output (``bwd_act`` keeps one accumulator)."""
    rows = p.slots / max(p.E, 1)
    block_m = _PINNED.get("block_m") or (16 if rows <= 16 else 32 if rows <= 64 else 64 if rows <= 512 else 128)
    if block_m == 128 and not saved and "block_m" not in _PINNED:
        block_m = 64  # three 128-row accumulators in the recomputing bwd_act: not measured to pay
    ap = align_params(p.slots, p.E, block_m)
    wide_n, wide_k = max(p.H, 2 * p.I), max(p.H, p.I)  # the weight gradients' output widths
    if rows > 256:
        wgrad = Tiles(_pow2_between(wide_n, 16, 128), _pow2_between(wide_k, 16, 256), 8, 3)
        dx = GemmConfig(block_m, _pow2_between(p.H, 16, 256), _pow2_between(2 * p.I, 16, 64), 8, 8, 3)
    elif rows > 64:
        wgrad = Tiles(_pow2_between(wide_n, 16, 128), _pow2_between(wide_k, 16, 128), 8, 3)
        dx = GemmConfig(block_m, _pow2_between(p.H, 16, 128), _pow2_between(2 * p.I, 16, 64), 8, 4, 3)
    else:
        wgrad = Tiles(_pow2_between(wide_n, 16, 64), _pow2_between(wide_k, 16, 64), 4, 3)
        dx = GemmConfig(block_m, _pow2_between(p.H, 16, 128), _pow2_between(2 * p.I, 16, 64), 8, 4, 3)
    act_n = 128 if saved and rows > 64 else 64
    act_stages = 4 if saved and rows > 64 else 3
    act = Tiles(_pow2_between(p.I, 16, act_n), _pow2_between(p.H, 16, 64), 8 if rows > 64 else 4, act_stages)
    act, wgrad = _PINNED.get("act") or act, _PINNED.get("wgrad") or wgrad
    dx = _PINNED.get("dx") or dx
    step = _PINNED.get("wgrad_step") or min(block_m, 64)  # 128-row steps of 128x256 tiles overflow shared memory
    if dx.block_m != block_m:
        dx = GemmConfig(block_m, dx.block_n, dx.block_k, dx.group_m, dx.num_warps, dx.num_stages)
    return BackwardLaunch(
        block_m,
        ap,
        grid_blocks(p.slots, ap.max_blocks),
        act,
        wgrad,
        step,
        saved,
        dx,
        ieee,
        tuple(map(bool, needs)),
    )


def _ids(c: Call) -> torch.Tensor:
    return c.x.topk_ids if c.x.topk_ids.is_contiguous() else c.x.topk_ids.contiguous()


@step
def _align(c, sorted_ids, block_expert, num_padded, align_partial=None):
    align_slots(c, c.launch.block_m, sorted_ids, block_expert, num_padded, align_partial)


@step
def _ranges(c, block_expert, expert_ranges):
    expert_block_ranges(block_expert, expert_ranges)


def _act_kernel(c, sorted_ids, block_expert, dh, act, dw_partial):
    x, p, L = c.x, c.p, c.launch
    moe_bwd_act(
        x.hidden_states,
        x.grad_out,
        x.w1,
        x.w2,
        x.topk_weights,
        sorted_ids,
        block_expert,
        dh,
        top_k=p.top_k,
        num_blocks=L.num_blocks,
        block_m=L.block_m,
        block_n=L.act.block_n,
        block_k=L.act.block_k,
        activation=p.activation,
        apply_router_weight_on_input=p.apply_router_weight_on_input,
        w1_bias=x.w1_bias,
        w2_bias=x.w2_bias,
        act=act,
        dw_partial=dw_partial,
        preact=x.preact,
        fp32_ieee=L.ieee,
        num_warps=L.act.num_warps,
        num_stages=L.act.num_stages,
    )


@step
def _bwd_act(c, sorted_ids, block_expert, dh, act=None, dw_partial=None):
    _act_kernel(c, sorted_ids, block_expert, dh, act, dw_partial)


@step
def _act_saved(c, sorted_ids, block_expert, act):
    # the activation from the forward's saved GEMM1 output, before dh exists (dW2 runs first)
    _act_kernel(c, sorted_ids, block_expert, None, act, None)


@step
def _bwd_act_saved(c, sorted_ids, block_expert, dh, dw_partial=None):
    _act_kernel(c, sorted_ids, block_expert, dh, None, dw_partial)


def _gather(c, src, out, sorted_ids, block_expert, weighted):
    L = c.launch
    gather_aligned(
        src,
        out,
        sorted_ids,
        block_expert,
        top_k=c.p.top_k,
        num_blocks=L.num_blocks,
        block_m=L.block_m,
        topk_weights=c.x.topk_weights if weighted else None,
    )


def _wgrad(c, a, b, out, bias_out, sorted_ids, expert_ranges):
    """``out[e] = Σ aᵀ b`` over expert e's rows, both operands in the aligned order."""
    L = c.launch
    moe_wgrad(
        a,
        b,
        out,
        sorted_ids,
        expert_ranges,
        n_slots=c.p.slots,
        top_k=c.p.top_k,
        block_m=L.block_m,
        a_rows="sorted",
        b_rows="sorted",
        bias_out=bias_out,
        step_m=L.wgrad_step,
        block_n=L.wgrad.block_n,
        block_k=L.wgrad.block_k,
        fp32_ieee=L.ieee,
        num_warps=L.wgrad.num_warps,
        num_stages=L.wgrad.num_stages,
    )


@step
def _gather_dy(c, sorted_ids, block_expert, dy_sorted):
    # GEMM2's output gradient per slot: w g (g alone with the weight on the input)
    _gather(c, c.x.grad_out, dy_sorted, sorted_ids, block_expert, not c.p.apply_router_weight_on_input)


@step
def _dw2(c, sorted_ids, expert_ranges, dy_sorted, act):
    _wgrad(c, dy_sorted, act, c.out["w2"], c.out.get("w2_bias"), sorted_ids, expert_ranges)


@step
def _dweights(c, dw_partial):
    p = c.p
    moe_dweights(
        dw_partial, _ids(c), c.out["topk_weights"], p.E, expert_map=c.x.expert_map, global_num_experts=p.global_E
    )


@step
def _dx_slots(c, sorted_ids, block_expert, dh, dx_slots):
    x, L = c.x, c.launch
    moe_gemm2(
        dh,
        x.w1.transpose(1, 2),
        dx_slots,
        sorted_ids,
        block_expert,
        num_blocks=L.num_blocks,
        config=L.dx,
        topk_weights=x.topk_weights if c.p.apply_router_weight_on_input else None,
        numerics=Numerics(fp32_ieee=L.ieee),
        a_sorted=True,
    )


@step
def _dx(c, dx_slots):
    p = c.p
    moe_reduce(dx_slots, _ids(c), c.out["hidden_states"], p.E, expert_map=c.x.expert_map, global_num_experts=p.global_E)


@step
def _gather_x(c, sorted_ids, block_expert, x_sorted):
    # GEMM1's input per slot: x (w x with the weight on the input)
    _gather(c, c.x.hidden_states, x_sorted, sorted_ids, block_expert, c.p.apply_router_weight_on_input)


@step
def _dw1(c, sorted_ids, expert_ranges, dh, x_sorted):
    _wgrad(c, dh, x_sorted, c.out["w1"], c.out.get("w1_bias"), sorted_ids, expert_ranges)


def backward_program(p: MoEProblem, L: BackwardLaunch) -> Program:
    """The steps and buffers of one backward call of ``p`` (``p.M > 0``)."""
    need_x, need_w1, need_w2, need_w, need_b1, need_b2 = L.needs
    S, H, I, dt, ap = p.slots, p.H, p.I, p.dtype, L.align
    i32 = torch.int32
    buffers = [
        BufferSpec("sorted_ids", (ap.max_padded,), i32),
        BufferSpec("block_expert", (ap.max_blocks,), i32),
        BufferSpec("num_padded", (1,), i32),
        BufferSpec("dh", (ap.max_padded, 2 * I), dt),  # aligned order
    ]
    if not ap.fused:
        buffers.append(BufferSpec("align_partial", ap.partial_shape, i32))
    steps = [_align]
    if need_w1 or need_w2 or need_b1 or need_b2:
        buffers.append(BufferSpec("expert_ranges", (p.E, 2), i32))
        steps.append(_ranges)
    dw2 = []
    if need_w2 or need_b2:
        buffers.append(BufferSpec("act", (ap.max_padded, I), dt))
        buffers.append(BufferSpec("dy_sorted", (ap.max_padded, H), dt))
        dw2 = [_gather_dy, _dw2]
    if L.saved:  # dW2 first, from the saved output's activation: act and w·g are freed before dh is written
        steps += ([_act_saved] + dw2 if dw2 else []) + [_bwd_act_saved]
    else:
        steps += [_bwd_act] + dw2
    if need_w:
        buffers.append(BufferSpec("dw_partial", (bwd_act_tiles(I, L.act.block_n), S), torch.float32))
        steps.append(_dweights)
    if need_x:
        buffers.append(BufferSpec("dx_slots", (S, H), dt))
        steps += [_dx_slots, _dx]
    if need_w1 or need_b1:
        buffers.append(BufferSpec("x_sorted", (ap.max_padded, H), dt))
        steps += [_gather_x, _dw1]
    return Program([], steps, [], buffers)


class TritonBackward:
    """Runs backward programs, cached per (problem, launch), on a workspace manager's arena."""

    def __init__(self):
        self._programs: dict[tuple[MoEProblem, BackwardLaunch], Program] = {}

    def program(self, p: MoEProblem, L: BackwardLaunch) -> Program:
        key = (p, L)
        prog = self._programs.get(key)
        if prog is None:
            if len(self._programs) > 1024:
                self._programs.clear()
            prog = self._programs[key] = backward_program(p, L)
        return prog

    def __call__(
        self, x: BackwardInputs, p: MoEProblem, needs: tuple[bool, ...], manager: WorkspaceManager, owner=None
    ) -> MoEGradients:
        need_x, need_w1, need_w2, need_w, need_b1, need_b2 = needs
        need_b1 = need_b1 and x.w1_bias is not None
        need_b2 = need_b2 and x.w2_bias is not None
        needs = (need_x, need_w1, need_w2, need_w, need_b1, need_b2)

        def empty_like(t, want):
            return torch.empty_like(t, memory_format=torch.contiguous_format) if want else None

        out = {
            "hidden_states": empty_like(x.hidden_states, need_x),
            "w1": empty_like(x.w1, need_w1 or need_b1),  # the dW1 kernel writes db1 alongside
            "w2": empty_like(x.w2, need_w2 or need_b2),
            "topk_weights": empty_like(x.topk_weights, need_w),
            "w1_bias": empty_like(x.w1_bias, need_b1),
            "w2_bias": empty_like(x.w2_bias, need_b2),
        }
        if p.M > 0:
            ieee = p.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"
            L = backward_launch(p, needs, ieee, saved=x.preact is not None)
            prog = self.program(p, L)
            ws = manager.acquire(prog.plan, owner)
            prog.run(1, Call(p, L, x, out), ws.views, ws.arena if manager.poison else None)
        elif need_w1 or need_w2 or need_b1 or need_b2:
            for name in ("w1", "w2", "w1_bias", "w2_bias"):
                if out[name] is not None:
                    out[name].zero_()  # no tokens: these gradients are zero, not garbage
        return MoEGradients(
            hidden_states=out["hidden_states"],
            w1=out["w1"] if need_w1 else None,
            w2=out["w2"] if need_w2 else None,
            topk_weights=out["topk_weights"],
            w1_bias=out["w1_bias"],
            w2_bias=out["w2_bias"],
        )
