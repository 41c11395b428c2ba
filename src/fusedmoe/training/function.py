"""Autograd for the MoE layer: one :class:`torch.autograd.Function` around the inference path.

The forward runs exactly what inference runs (same kernels, same workspace; on the Triton backend GEMM1 also
writes its raw output into a saved tensor unless ``recompute``); the backward reads (or recomputes) the expert
activations and returns gradients for the hidden states, both weights, the routing weights and the biases
(those that require grad). ``topk_ids`` and ``expert_map`` are integer inputs and get none; slots of experts
that are not local to this rank contribute nothing to any gradient. Double backward is not supported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ..problem import MoEProblem
from ..workspace.manager import WorkspaceManager
from .torch_backward import MoEGradients, moe_backward_torch

_TRITON_BACKWARD = None


def _triton_backward():
    global _TRITON_BACKWARD
    if _TRITON_BACKWARD is None:
        from .triton_backward import TritonBackward

        _TRITON_BACKWARD = TritonBackward()
    return _TRITON_BACKWARD


@dataclass(frozen=True)
class BackwardSettings:
    """What the backward needs besides the saved tensors.

    ``backend`` is the forward's resolved backend. With "triton", ``problem`` (the forward's validated
    :class:`~fusedmoe.problem.MoEProblem`) and ``manager`` (its workspace manager) are given and the backward
    runs the Triton kernels on that manager's arena; otherwise the torch backward runs.
    """

    activation: str
    apply_router_weight_on_input: bool
    global_num_experts: int
    backend: str = "torch"
    problem: MoEProblem | None = None
    manager: WorkspaceManager | None = None
    owner: object = None


#: The differentiable inputs in the order of :class:`MoEGradients`' fields, as positions of the Function's inputs.
_DIFFERENTIABLE = (2, 3, 4, 5, 8, 9)


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward, settings, x, w1, w2, topk_weights, topk_ids, expert_map, w1_bias, w2_bias, preact):
        ctx.settings = settings
        out = forward()  # writes preact, when given
        ctx.save_for_backward(x, w1, w2, topk_weights, topk_ids, expert_map, w1_bias, w2_bias, preact)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, w1, w2, topk_weights, topk_ids, expert_map, w1_bias, w2_bias, preact = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[i] for i in _DIFFERENTIABLE)
        grads = moe_backward(
            ctx.settings, needs, grad_out, x, w1, w2, topk_weights, topk_ids, expert_map, w1_bias, w2_bias, preact
        )
        return (
            None,
            None,
            grads.hidden_states,
            grads.w1,
            grads.w2,
            grads.topk_weights,
            None,
            None,
            grads.w1_bias,
            grads.w2_bias,
            None,
        )


def moe_backward(
    settings: BackwardSettings,
    needs: tuple[bool, bool, bool, bool, bool, bool],
    grad_out: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    w1_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    preact: torch.Tensor | None = None,
) -> MoEGradients:
    """Gradients of one MoE call for ``grad_out`` [M, H]; ``needs`` flags (hidden_states, w1, w2, topk_weights,
    w1_bias, w2_bias). The Triton backward when ``settings.backend`` is "triton" (reading the forward's saved
    raw GEMM1 output ``preact`` [M*k, 2I] when given, else recomputing it), the torch backward otherwise."""
    s = settings
    if s.backend == "triton":
        from .triton_backward import BackwardInputs

        inputs = BackwardInputs(
            *(_rows(t) for t in (x, w1, w2)),
            topk_weights.contiguous(),
            topk_ids,
            expert_map,
            *(_rows(t) for t in (w1_bias, w2_bias)),
            grad_out.contiguous(),
            preact,
        )
        return _triton_backward()(inputs, s.problem, needs, s.manager, s.owner)
    return moe_backward_torch(
        grad_out.contiguous(),
        x,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation=s.activation,
        apply_router_weight_on_input=s.apply_router_weight_on_input,
        expert_map=expert_map,
        global_num_experts=s.global_num_experts,
        w1_bias=w1_bias,
        w2_bias=w2_bias,
        needs=needs,
    )


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` contiguous along its last dimension (what the Triton backward kernels address)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def differentiable_moe(
    forward: Callable[[], torch.Tensor],
    settings: BackwardSettings,
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    preact: torch.Tensor | None = None,
) -> torch.Tensor:
    """``forward()`` (the inference call on exactly these tensors, returning a fresh [M, H]) made differentiable
    in ``hidden_states``, ``w1``, ``w2``, ``topk_weights`` and the biases. ``preact``: a tensor ``forward()``
    fills with GEMM1's raw output, saved for the (Triton) backward."""
    return _MoEFunction.apply(
        forward, settings, hidden_states, w1, w2, topk_weights, topk_ids, expert_map, w1_bias, w2_bias, preact
    )


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """True when autograd is recording and any of ``tensors`` requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
