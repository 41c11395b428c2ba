"""The fused call as a registered torch op: ``torch.ops.fusedmoe.fused_moe`` (schema + fake implementation).

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

CUDA graphs: the op adds no host sync of its own; with the Triton backend and a reserved, frozen arena a
captured call replays with new inputs (see tests/test_gpu_hf.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .workspace.manager import MANAGERS, WorkspaceManager

__all__ = ["OP_NAME", "fused_moe_op", "lookup_workspace", "workspace_id"]

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


def _run(
    hidden_states, w1, w2, topk_weights, topk_ids, w1_bias, w2_bias, activation, apply_router_weight_on_input,
    global_num_experts, expert_map, quant, w1_scale, w2_scale, a1_scale, a2_scale, backend, workspace, owner,
    checks,
) -> Tensor:
    from .api import run_problem
    from .checks import check_fused_moe_args
    from .experts.base import ExpertsInputs

    p = check_fused_moe_args(
        hidden_states, w1, w2, topk_weights, topk_ids,
        activation=activation, apply_router_weight_on_input=apply_router_weight_on_input, expert_map=expert_map,
        global_num_experts=None if global_num_experts < 0 else global_num_experts, quant=quant,
        w1_scale=w1_scale, w2_scale=w2_scale, a1_scale=a1_scale, a2_scale=a2_scale, checks=checks,
        w1_bias=w1_bias, w2_bias=w2_bias,
    )
    x = ExpertsInputs(hidden_states, w1, w2, topk_weights, topk_ids, expert_map=expert_map, w1_scale=w1_scale,
                      w2_scale=w2_scale, a1_scale=a1_scale, a2_scale=a2_scale, w1_bias=w1_bias, w2_bias=w2_bias)
    return run_problem(x, p, backend=backend, workspace=workspace, owner=owner or None)


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
    return _run(
        hidden_states, w1, w2, topk_weights, topk_ids, w1_bias, w2_bias, activation, apply_router_weight_on_input,
        global_num_experts, expert_map, quant, w1_scale, w2_scale, a1_scale, a2_scale, backend,
        lookup_workspace(workspace_id), owner, None,
    )


@_fused_moe_impl.register_fake
def _fused_moe_fake(
    hidden_states, w1, w2, topk_weights, topk_ids, w1_bias=None, w2_bias=None, activation="silu",
    apply_router_weight_on_input=False, global_num_experts=-1, expert_map=None, quant=None, w1_scale=None,
    w2_scale=None, a1_scale=None, a2_scale=None, backend="auto", workspace_id=-1, owner="",
):
    # Output metadata only: a fresh [M, H] tensor in hidden_states' dtype (it never aliases an input).
    torch._check(hidden_states.dim() == 2, lambda: "hidden_states must be 2-D [M, H]")
    return hidden_states.new_empty(hidden_states.shape)


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
    if quant is not None and not isinstance(quant, str):
        if tuple(quant.block_shape) != (128, 128) and quant.mode == "fp8_block":
            raise ValueError("fused_moe_op supports fp8_block with the default 128x128 block shape only")
        quant = quant.name
    return torch.ops.fusedmoe.fused_moe(
        hidden_states, w1, w2, topk_weights, topk_ids, w1_bias, w2_bias, activation, apply_router_weight_on_input,
        -1 if global_num_experts is None else int(global_num_experts), expert_map, quant, w1_scale, w2_scale,
        a1_scale, a2_scale, backend, workspace_id(workspace), owner or "",
    )
