"""Registered torch ops (schema + fake implementation): ``torch.ops.fusedmoe.fused_moe`` (the whole layer) and
its public parts ``torch.ops.fusedmoe.route``, ``torch.ops.fusedmoe.moe_align`` and ``torch.ops.fusedmoe.moe_reduce``,
so users can compose them and compile them (no graph break).

Why two paths. A ``torch.library.custom_op`` costs host time on every call (its autograd and dispatch
wrappers; ``fusedmoe bench`` measures both paths: the CPU table "call path host cost", and the GPU sweep's
``triton_op`` backend with ``--eager``); in eager mode that is pure overhead, so :func:`fusedmoe.fused_moe` and
:class:`fusedmoe.FusedMoE` call the kernels directly. Under ``torch.compile`` the op is what keeps the call
opaque to the compiler (no graph break, ``fullgraph=True`` works, the torch experts' one host sync stays
inside the op) and what the fake implementation describes: a fresh ``[M, H]`` tensor in hidden_states' dtype.
``FusedMoE.forward`` and the transformers integration switch to :func:`fused_moe_op` when
``torch.compiler.is_compiling()``; callers may also use it directly (e.g. to measure the registration cost).

A :class:`~fusedmoe.workspace.manager.WorkspaceManager` cannot cross the op boundary, so it is passed by a
small integer id (:func:`workspace_id`; -1 = the device's default manager). Ids are held weakly.

Autograd: the op is differentiable (``register_autograd``) in hidden_states, w1, w2, topk_weights and the biases;
its backward is the registered op ``torch.ops.fusedmoe.fused_moe_backward`` (the same backward as
:func:`fusedmoe.fused_moe`'s, :mod:`fusedmoe.training`), so a compiled training step keeps both opaque.

CUDA graphs: the op adds no host sync of its own; with the Triton backend and a reserved, frozen arena a
captured call replays with new inputs (see tests/test_gpu_hf.py).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .workspace.manager import MANAGERS, WorkspaceManager

__all__ = ["OP_NAME", "fused_moe_op", "lookup_workspace", "moe_align_op", "moe_reduce_op", "route_op", "workspace_id"]

OP_NAME = "fusedmoe::fused_moe"


def workspace_id(manager: WorkspaceManager | None) -> int:
    """The op-level id of ``manager``: its ``id`` attribute, fixed at construction (-1 for None = the device's
    default manager). A plain int attribute, so under ``torch.compile`` it is read as a guarded constant."""
    if manager is None:
        return -1
    if not isinstance(manager, WorkspaceManager):
        raise TypeError(f"workspace must be a WorkspaceManager or None, got {type(manager).__name__}")
    return manager.id


def lookup_workspace(i: int) -> WorkspaceManager | None:
    """The manager of id ``i`` (None for -1). Raises if it was garbage-collected."""
    if i < 0:
        return None
    mgr = MANAGERS.get(i)
    if mgr is None:
        raise RuntimeError(f"fusedmoe workspace manager #{i} no longer exists")
    return mgr


def _op_problem(
    hidden_states,
    w1,
    w2,
    topk_weights,
    topk_ids,
    w1_bias,
    w2_bias,
    activation,
    apply_router_weight_on_input,
    global_num_experts,
    expert_map,
    quant=None,
    scales=(None, None, None, None),
):
    """The validated problem of the op's arguments (``global_num_experts`` < 0: the default; ``scales``: w1, w2,
    a1, a2)."""
    from .checks import check_fused_moe_args

    w1_scale, w2_scale, a1_scale, a2_scale = scales
    return check_fused_moe_args(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation=activation,
        apply_router_weight_on_input=apply_router_weight_on_input,
        expert_map=expert_map,
        global_num_experts=None if global_num_experts < 0 else global_num_experts,
        quant=quant,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        a1_scale=a1_scale,
        a2_scale=a2_scale,
        checks=None,
        w1_bias=w1_bias,
        w2_bias=w2_bias,
    )


@torch.library.custom_op(OP_NAME, mutates_args=())
def _fused_moe_impl(
    hidden_states: Tensor,
    w1: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w1_bias: Tensor | None = None,
    w2_bias: Tensor | None = None,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    global_num_experts: int = -1,
    expert_map: Tensor | None = None,
    quant: str | None = None,
    w1_scale: Tensor | None = None,
    w2_scale: Tensor | None = None,
    a1_scale: Tensor | None = None,
    a2_scale: Tensor | None = None,
    backend: str = "auto",
    workspace_id: int = -1,
    owner: str = "",
) -> Tensor:
    from .api import run_problem
    from .experts.base import ExpertsInputs

    workspace = lookup_workspace(workspace_id)
    p = _op_problem(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        w1_bias,
        w2_bias,
        activation,
        apply_router_weight_on_input,
        global_num_experts,
        expert_map,
        quant,
        (w1_scale, w2_scale, a1_scale, a2_scale),
    )
    x = ExpertsInputs(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        expert_map=expert_map,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        a1_scale=a1_scale,
        a2_scale=a2_scale,
        w1_bias=w1_bias,
        w2_bias=w2_bias,
    )
    return run_problem(x, p, backend=backend, workspace=workspace, owner=owner or None)


@_fused_moe_impl.register_fake
def _fused_moe_fake(hidden_states, *args, **kwargs):
    # Output metadata only: a fresh [M, H] tensor in hidden_states' dtype (it never aliases an input).
    torch._check(hidden_states.dim() == 2, lambda: "hidden_states must be 2-D [M, H]")
    return hidden_states.new_empty(hidden_states.shape)


# ---- autograd of the registered op: its backward is a registered op too, so compiled graphs train -------------------
_GRAD_NAMES = ("hidden_states", "w1", "w2", "topk_weights", "w1_bias", "w2_bias")


@torch.library.custom_op("fusedmoe::fused_moe_backward", mutates_args=())
def _fused_moe_backward_impl(
    grad_out: Tensor,
    hidden_states: Tensor,
    w1: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w1_bias: Tensor | None,
    w2_bias: Tensor | None,
    expert_map: Tensor | None,
    activation: str,
    apply_router_weight_on_input: bool,
    global_num_experts: int,
    backend: str,
    workspace_id: int,
    owner: str,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    from .api import resolve
    from .training import BackwardSettings
    from .training.function import moe_backward

    p = _op_problem(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        w1_bias,
        w2_bias,
        activation,
        apply_router_weight_on_input,
        global_num_experts,
        expert_map,
    )
    kernel, manager = resolve(p, hidden_states.device, backend, lookup_workspace(workspace_id))
    name = kernel.experts.name
    settings = BackwardSettings(
        activation, apply_router_weight_on_input, p.global_E, name, p, manager if name == "triton" else None, owner
    )
    grads = moe_backward(
        settings, tuple(needs), grad_out, hidden_states, w1, w2, topk_weights, topk_ids, expert_map, w1_bias, w2_bias
    )
    # a custom op's outputs may not alias each other: one empty placeholder per gradient nobody asked for
    return tuple(
        getattr(grads, n) if getattr(grads, n) is not None else hidden_states.new_empty(0) for n in _GRAD_NAMES
    )


@_fused_moe_backward_impl.register_fake
def _fused_moe_backward_fake(
    grad_out, hidden_states, w1, w2, topk_weights, topk_ids, w1_bias, w2_bias, expert_map, *settings_and_needs
):
    needs = settings_and_needs[-1]
    like = (hidden_states, w1, w2, topk_weights, w1_bias, w2_bias)
    return tuple(
        t.new_empty(t.shape) if want and t is not None else hidden_states.new_empty(0) for t, want in zip(like, needs)
    )


def _setup_context(ctx, inputs, output) -> None:
    (x, w1, w2, tw, ids, b1, b2, activation, on_input, global_E, emap, quant, *_, backend, ws_id, owner) = inputs
    ctx.save_for_backward(x, w1, w2, tw, ids, b1, b2, emap)
    ctx.settings = (activation, on_input, global_E, backend, ws_id, owner)
    ctx.quant = quant


def _backward(ctx, grad_out):
    x, w1, w2, tw, ids, b1, b2, emap = ctx.saved_tensors
    if ctx.quant is not None:
        from .checks import GradientNotSupportedError

        raise GradientNotSupportedError("fused_moe_op: quantized calls (fp8, mxfp4) have no backward")
    n = ctx.needs_input_grad
    needs = [n[0], n[1], n[2], n[3], n[5] and b1 is not None, n[6] and b2 is not None]
    grads = torch.ops.fusedmoe.fused_moe_backward(grad_out, x, w1, w2, tw, ids, b1, b2, emap, *ctx.settings, needs)
    dx, dw1, dw2, dtw, db1, db2 = (g if want else None for g, want in zip(grads, needs))
    # one entry per input of the op (19): the differentiable tensors in their positions, None for the rest
    return dx, dw1, dw2, dtw, None, db1, db2, *([None] * 12)


_fused_moe_impl.register_autograd(_backward, setup_context=_setup_context)


def fused_moe_op(
    hidden_states: Tensor,
    w1: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    expert_map: Tensor | None = None,
    global_num_experts: int | None = None,
    quant=None,
    w1_scale: Tensor | None = None,
    w2_scale: Tensor | None = None,
    a1_scale: Tensor | None = None,
    a2_scale: Tensor | None = None,
    workspace: WorkspaceManager | None = None,
    backend: str = "auto",
    w1_bias: Tensor | None = None,
    w2_bias: Tensor | None = None,
    owner: str | None = None,
) -> Tensor:
    """:func:`fusedmoe.fused_moe` through the registered op ``torch.ops.fusedmoe.fused_moe``.

    Same arguments and result as ``fused_moe`` (no caller workspaces, no ``checks``: validation is structural).
    ``quant`` may be a QuantConfig or a mode name. ``owner`` keys the arena with the ``per_layer`` strategy.
    Use it under ``torch.compile`` (FusedMoE does so automatically) or to measure the op's host cost.
    """
    if quant is not None:
        from .checks import forbid_gradients

        forbid_gradients(
            "fused_moe_op",
            "quantized calls (fp8, mxfp4) have no backward (train in bf16/fp16/float32)",
            hidden_states=hidden_states,
            w1=w1,
            w2=w2,
            topk_weights=topk_weights,
            w1_bias=w1_bias,
            w2_bias=w2_bias,
            w1_scale=w1_scale,
            w2_scale=w2_scale,
            a1_scale=a1_scale,
            a2_scale=a2_scale,
        )
    if quant is not None and not isinstance(quant, str):
        if tuple(quant.block_shape) != (128, 128) and quant.mode == "fp8_block":
            raise ValueError("fused_moe_op supports fp8_block with the default 128x128 block shape only")
        quant = quant.name
    return torch.ops.fusedmoe.fused_moe(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        w1_bias,
        w2_bias,
        activation,
        apply_router_weight_on_input,
        -1 if global_num_experts is None else int(global_num_experts),
        expert_map,
        quant,
        w1_scale,
        w2_scale,
        a1_scale,
        a2_scale,
        backend,
        workspace_id(workspace),
        owner or "",
    )


# ---- the parts: routing, alignment, top-k reduce -----------------------------------------------------------------
def _triton_runs_on(t: Tensor) -> bool:
    from .api import triton_available

    return triton_available() and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


@torch.library.custom_op("fusedmoe::route", mutates_args=())
def _route_impl(
    router_logits: Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    num_expert_groups: int = -1,
    topk_groups: int = -1,
    correction_bias: Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    from .routing import route

    return route(
        router_logits,
        top_k,
        scoring=scoring,
        renormalize=renormalize,
        num_expert_groups=None if num_expert_groups < 0 else num_expert_groups,
        topk_groups=None if topk_groups < 0 else topk_groups,
        correction_bias=correction_bias,
        routed_scaling_factor=routed_scaling_factor,
    )


@_route_impl.register_fake
def _route_fake(router_logits, top_k, *args, **kwargs):
    M = router_logits.shape[0]
    return (
        router_logits.new_empty((M, top_k), dtype=torch.float32),
        router_logits.new_empty((M, top_k), dtype=torch.int32),
    )


def route_op(
    router_logits: Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    num_expert_groups: int | None = None,
    topk_groups: int | None = None,
    correction_bias: Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """:func:`fusedmoe.route` as the registered op ``torch.ops.fusedmoe.route``: same arguments and results
    (float32 ``[M, k]`` weights, int32 ``[M, k]`` ids)."""
    from .routing import _validate

    _validate(
        router_logits,
        top_k,
        scoring,
        renormalize,
        num_expert_groups,
        topk_groups,
        correction_bias,
        routed_scaling_factor,
    )
    return torch.ops.fusedmoe.route(
        router_logits,
        top_k,
        scoring,
        renormalize,
        -1 if num_expert_groups is None else num_expert_groups,
        -1 if topk_groups is None else topk_groups,
        correction_bias,
        float(routed_scaling_factor),
    )


def _align_sizes(n_slots, num_experts: int, block_m: int):
    max_padded = n_slots + num_experts * (block_m - 1)
    return max_padded, (max_padded + block_m - 1) // block_m


@torch.library.custom_op("fusedmoe::moe_align", mutates_args=())
def _align_impl(
    topk_ids: Tensor, num_experts: int, block_m: int, expert_map: Tensor | None = None, global_num_experts: int = -1
) -> tuple[Tensor, Tensor, Tensor]:
    from .ops.align import align_reference

    gE = None if global_num_experts < 0 else global_num_experts
    n = topk_ids.numel()
    max_padded, _ = _align_sizes(n, num_experts, block_m)
    # the tail past num_padded holds the sentinel (the fused path leaves it unwritten; a public op is
    # deterministic in every element)
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=topk_ids.device)
    if _triton_runs_on(topk_ids):
        from .ops.align import moe_align

        return moe_align(
            topk_ids, num_experts, block_m, expert_map=expert_map, global_num_experts=gE, sorted_ids=sorted_ids
        )
    s, b, npad = align_reference(topk_ids, num_experts, block_m, expert_map=expert_map, global_num_experts=gE)
    s = torch.where(s == -2, n, s)
    return s.to(topk_ids.device), b.to(topk_ids.device), npad.to(topk_ids.device)


@_align_impl.register_fake
def _align_fake(topk_ids, num_experts, block_m, expert_map=None, global_num_experts=-1):
    max_padded, max_blocks = _align_sizes(topk_ids.numel(), num_experts, block_m)
    i32 = torch.int32
    return (
        topk_ids.new_empty((max_padded,), dtype=i32),
        topk_ids.new_empty((max_blocks,), dtype=i32),
        topk_ids.new_empty((1,), dtype=i32),
    )


def moe_align_op(
    topk_ids: Tensor,
    num_experts: int,
    block_m: int,
    *,
    expert_map: Tensor | None = None,
    global_num_experts: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Alignment as the registered op ``torch.ops.fusedmoe.moe_align``: ``(sorted_ids int32 [M*k + E*(block_m-1)],
    block_expert int32 [cdiv(that, block_m)], num_padded int32 [1])`` as :func:`fusedmoe.ops.align.moe_align`
    documents, except that entries of ``sorted_ids`` past ``num_padded`` hold the sentinel ``M*k`` too."""
    if not isinstance(topk_ids, Tensor) or topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError("topk_ids must be an int32/int64 tensor [M, k]")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    return torch.ops.fusedmoe.moe_align(
        topk_ids, num_experts, block_m, expert_map, -1 if global_num_experts is None else global_num_experts
    )


@torch.library.custom_op("fusedmoe::moe_reduce", mutates_args=())
def _reduce_impl(
    y: Tensor,
    topk_ids: Tensor,
    num_experts: int,
    out_dtype: torch.dtype,
    expert_map: Tensor | None = None,
    global_num_experts: int = -1,
) -> Tensor:
    M, k = topk_ids.shape
    gE = None if global_num_experts < 0 else global_num_experts
    out = torch.empty((M, y.shape[1]), dtype=out_dtype, device=y.device)
    if _triton_runs_on(y):
        from .ops.reduce import moe_reduce

        return moe_reduce(y, topk_ids.contiguous(), out, num_experts, expert_map=expert_map, global_num_experts=gE)
    from .ops.align import local_expert_reference

    local = local_expert_reference(topk_ids, num_experts, expert_map, gE) >= 0
    rows = torch.where(local[..., None], y.view(M, k, -1).float(), 0.0)  # a select: unread rows never count
    return out.copy_(rows.sum(dim=1))


@_reduce_impl.register_fake
def _reduce_fake(y, topk_ids, num_experts, out_dtype, expert_map=None, global_num_experts=-1):
    return y.new_empty((topk_ids.shape[0], y.shape[1]), dtype=out_dtype)


def moe_reduce_op(
    y: Tensor,
    topk_ids: Tensor,
    num_experts: int,
    *,
    out_dtype: torch.dtype | None = None,
    expert_map: Tensor | None = None,
    global_num_experts: int | None = None,
) -> Tensor:
    """The top-k reduce as the registered op ``torch.ops.fusedmoe.moe_reduce``: ``out[t] = sum_j y[t*k + j]``
    over the local slots of token t (float32 accumulation), a new ``[M, H]`` tensor in ``out_dtype``
    (default ``y``'s); rows of non-local slots are never read."""
    if y.dim() != 2 or topk_ids.dim() != 2 or y.shape[0] != topk_ids.numel():
        raise ValueError(f"y must be [M*k, H] for topk_ids [M, k], got {list(y.shape)} and {list(topk_ids.shape)}")
    return torch.ops.fusedmoe.moe_reduce(
        y,
        topk_ids,
        num_experts,
        out_dtype or y.dtype,
        expert_map,
        -1 if global_num_experts is None else global_num_experts,
    )
