"""Training support: autograd for the MoE layer (forward as in inference, backward recomputing activations)."""

from .activations import gated_activation_backward
from .function import BackwardSettings, differentiable_moe, needs_grad
from .torch_backward import MoEGradients, expert_segments, moe_backward_torch, moe_forward_torch

__all__ = [
    "BackwardSettings",
    "MoEGradients",
    "differentiable_moe",
    "expert_segments",
    "gated_activation_backward",
    "moe_backward_torch",
    "moe_forward_torch",
    "needs_grad",
]
