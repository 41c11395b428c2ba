"""fusedmoe: fused Mixture-of-Experts inference layers for PyTorch + Triton.

Public API: ``route``, ``fused_moe``, ``FusedMoE``, ``WorkspaceManager``, ``QuantConfig``, ``quantize_weights``,
``MoEKernel`` and its parts. See README.md and docs/architecture.md.
"""

from .api import BACKENDS, fused_moe, get_kernel, resolve_backend
from .experts import BatchedTorchExperts, Experts, ExpertsInputs, TorchExperts
from .kernel import MoEKernel
from .layer import FusedMoE
from .prepare_finalize import (
    AllToAllPrepareFinalize,
    BatchedCapacityError,
    BatchedPrepareFinalize,
    LocalPrepareFinalize,
    PrepareFinalize,
)
from .problem import Layout, MoEProblem
from .quant import QuantConfig
from .routing import route
from .steps import Call, Program, Step, step
from .workspace import (
    STRATEGIES,
    BufferSpec,
    PlanError,
    Workspace,
    WorkspaceError,
    WorkspaceFrozenError,
    WorkspaceManager,
    WorkspacePlan,
    WorkspaceStats,
)

__version__ = "0.1.0"


def __getattr__(name):
    # quantize_weights lives with the fp8 kernels' helpers; imported lazily to keep `import fusedmoe` light.
    if name == "quantize_weights":
        from .quant import quantize_weights

        return quantize_weights
    if name == "BatchedTritonExperts":
        from .experts.batched_triton_experts import BatchedTritonExperts

        return BatchedTritonExperts
    if name in ("Transport", "TorchDistributedTransport"):
        from . import distributed

        return getattr(distributed, name)
    if name == "TritonExperts":
        from .experts.triton_experts import TritonExperts

        return TritonExperts
    if name == "fused_moe_op":  # the registered torch op (torch.ops.fusedmoe.fused_moe); see fusedmoe.op
        from .op import fused_moe_op

        return fused_moe_op
    raise AttributeError(f"module 'fusedmoe' has no attribute {name!r}")


__all__ = [
    "AllToAllPrepareFinalize",
    "BACKENDS",
    "BatchedCapacityError",
    "BatchedPrepareFinalize",
    "BatchedTorchExperts",
    "BatchedTritonExperts",
    "TorchDistributedTransport",
    "Transport",
    "STRATEGIES",
    "BufferSpec",
    "Call",
    "Experts",
    "ExpertsInputs",
    "FusedMoE",
    "Layout",
    "LocalPrepareFinalize",
    "MoEKernel",
    "MoEProblem",
    "PlanError",
    "PrepareFinalize",
    "Program",
    "QuantConfig",
    "Step",
    "TorchExperts",
    "TritonExperts",
    "Workspace",
    "WorkspaceError",
    "WorkspaceFrozenError",
    "WorkspaceManager",
    "WorkspacePlan",
    "WorkspaceStats",
    "fused_moe",
    "fused_moe_op",
    "get_kernel",
    "quantize_weights",
    "resolve_backend",
    "route",
    "step",
]
