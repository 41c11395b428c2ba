"""The functional entry point ``fused_moe`` and backend selection."""

from __future__ import annotations

import dataclasses
import os
import weakref

import torch

from .checks import check_fused_moe_args, check_level, forbid_gradients
from .experts.base import Experts, ExpertsInputs
from .experts.torch_experts import TorchExperts
from .kernel import MoEKernel
from .prepare_finalize.local import LocalPrepareFinalize
from .problem import MoEProblem
from .signature import input_signature
from .workspace.manager import WorkspaceManager, default_manager

BACKENDS = ("auto", "torch", "triton")

_KERNELS: dict[str, MoEKernel] = {}


def triton_available() -> bool:
    """True if the Triton experts can run here (a CUDA device, or the CPU interpreter is switched on)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _make_experts(name: str) -> Experts:
    if name == "torch":
        return TorchExperts()
    from .experts.triton_experts import TritonExperts

    return TritonExperts()


def get_kernel(backend: str) -> MoEKernel:
    """The standard-layout, single-rank kernel of a backend ("torch" or "triton"), built once."""
    kernel = _KERNELS.get(backend)
    if kernel is None:
        kernel = _KERNELS[backend] = MoEKernel(LocalPrepareFinalize(), _make_experts(backend))
    return kernel


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` picks Triton on CUDA devices and the torch experts elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def _manager_for(workspace: WorkspaceManager | None, device: torch.device) -> WorkspaceManager:
    if workspace is None:
        return default_manager(device)
    if not isinstance(workspace, WorkspaceManager):
        raise TypeError(f"workspace must be a WorkspaceManager or None, got {type(workspace).__name__}")
    if workspace.device != device:
        raise ValueError(f"workspace manager is for {workspace.device} but hidden_states is on {device}")
    return workspace


def fused_moe(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
    quant=None,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    workspace: WorkspaceManager | None = None,
    workspace13: torch.Tensor | None = None,
    workspace2: torch.Tensor | None = None,
    backend: str = "auto",
    checks: str | None = None,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    recompute: bool = False,
) -> torch.Tensor:
    """Apply a Mixture-of-Experts layer to routed tokens.

    Args:
        hidden_states: [M, H] float32 / float16 / bfloat16.
        w1: [E, 2I, H] gate rows then up rows (fp8 e4m3 with ``quant``). w2: [E, H, I].
        topk_weights: [M, k] float routing weights. topk_ids: [M, k] int32/int64 global expert ids.
        activation: "silu" (SwiGLU), "gelu" (GeGLU, tanh approximation), "gelu_exact" (GeGLU, erf GELU) or
            "swigluoai" (gpt-oss's clamped SwiGLU: ``g * sigmoid(1.702 g) * (u + 1)``, ``g = min(gate, 7)``,
            ``u = clamp(up, -7, 7)``).
        apply_router_weight_on_input: multiply the input rows by the routing weight instead of the outputs.
        expert_map: int32 [global_num_experts], global id -> local id or -1 (not on this rank: contributes 0).
        global_num_experts: size of the global id space (default: len(expert_map) or E).
        quant: None or a QuantConfig / mode name: fp8 w8a8 ("fp8_tensor", "fp8_tensor_static", "fp8_token",
            "fp8_block") with the matching ``w*_scale`` / ``a*_scale`` tensors, or "mxfp4" (weights only: ``w1``
            uint8 [E, 2I, H/2], ``w2`` uint8 [E, H, I/2], e8m0 ``w1_scale`` / ``w2_scale`` uint8 [..., K/32]);
            see fusedmoe.quant and fusedmoe.mxfp4.
        workspace: the WorkspaceManager to take scratch from (default: the device's shared manager).
        workspace13, workspace2: caller-owned scratch instead of a manager: contiguous tensors of
            hidden_states' dtype (any shape, used as flat storage) or uint8. See docs/architecture.md.
        backend: "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch".
        checks: "full" also validates tensor values (one host sync); default from env FUSEDMOE_CHECKS.
        w1_bias: optional [E, 2I] (gate then up) added to GEMM1's output before the activation.
        w2_bias: optional [E, H] added to GEMM2's output before the routing weight multiplies it.
            Both in hidden_states' dtype (gpt-oss; see fusedmoe.integrations.loading for its weight conversion).
        recompute: training only: recompute GEMM1's output in the backward instead of saving it ([M*k, 2I] in
            hidden_states' dtype kept from forward to backward; docs/training.md has the trade-off).

    Returns:
        A new tensor [M, H] in hidden_states' dtype (never a view of the workspace). Differentiable: when
        autograd records and any of hidden_states, w1, w2, topk_weights or the biases requires grad, the
        backward (:mod:`fusedmoe.training`) gives their gradients (not for quantized calls: fp8, mxfp4).
    """
    tensors = (
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        expert_map,
        w1_scale,
        w2_scale,
        a1_scale,
        a2_scale,
        w1_bias,
        w2_bias,
    )
    level = check_level(checks)
    sig = key = None
    if level == "basic" and workspace13 is None and workspace2 is None:
        sig = input_signature(*tensors)
        if sig is not None:
            # the caller's manager by identity: the cache must not keep it (and its arena) alive
            owner = None if workspace is None else id(workspace)
            key = (sig, activation, apply_router_weight_on_input, global_num_experts, quant, backend, owner)
            try:
                verdict = _VERDICTS.get(key)
            except TypeError:  # an unhashable argument: the full validation below names it
                verdict = key = None
            manager = verdict[2]() if verdict is not None else None
            if manager is not None and (workspace is None or manager is workspace):
                p, kernel, _ = verdict
                x = ExpertsInputs(*tensors[:6], None, *tensors[6:])
                if torch.is_grad_enabled() and _wants_grad(x):
                    return _differentiable(kernel, x, p, manager, sig, recompute=recompute)
                return kernel(x, p, manager=manager, layout_key=sig)
    p = check_fused_moe_args(
        *tensors[:5],
        activation=activation,
        apply_router_weight_on_input=apply_router_weight_on_input,
        expert_map=expert_map,
        global_num_experts=global_num_experts,
        quant=quant,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        a1_scale=a1_scale,
        a2_scale=a2_scale,
        checks=level,
        w1_bias=w1_bias,
        w2_bias=w2_bias,
    )
    kernel, manager = resolve(p, hidden_states.device, backend, workspace)
    if key is not None:
        if len(_VERDICTS) > 4096:  # bounded under shape churn
            _VERDICTS.clear()
        _VERDICTS[key] = (p, kernel, weakref.ref(manager))
    x = ExpertsInputs(*tensors[:6], None, *tensors[6:])
    if torch.is_grad_enabled() and _wants_grad(x):
        return _differentiable(kernel, x, p, manager, sig, workspace13, workspace2, recompute=recompute)
    return kernel(x, p, manager=manager, workspace13=workspace13, workspace2=workspace2, layout_key=sig)


#: fused_moe's validation verdicts by (input signature, settings, the caller's manager's id): the problem, the
#: kernel and a weak reference to the manager to run (a dead or different manager is a miss).
_VERDICTS: dict[tuple, tuple[MoEProblem, MoEKernel, weakref.ref]] = {}


def _wants_grad(x: ExpertsInputs) -> bool:
    """Whether any input of ``x`` that could carry a gradient requires grad (the caller checked grad mode)."""
    for t in (
        x.hidden_states,
        x.w1,
        x.w2,
        x.topk_weights,
        x.w1_bias,
        x.w2_bias,
        x.w1_scale,
        x.w2_scale,
        x.a1_scale,
        x.a2_scale,
    ):
        if t is not None and t.requires_grad:
            return True
    return False


def _differentiable(
    kernel: MoEKernel,
    x: ExpertsInputs,
    p: MoEProblem,
    manager: WorkspaceManager,
    layout_key=None,
    workspace13: torch.Tensor | None = None,
    workspace2: torch.Tensor | None = None,
    owner: object = None,
    recompute: bool = False,
) -> torch.Tensor:
    """The call of ``p`` on ``x`` with autograd: the same forward, a backward for the inputs that require grad
    (:mod:`fusedmoe.training`). Quantized calls and gradients of scales are refused. On the Triton backend the
    forward also writes GEMM1's raw output into a saved ``preact`` tensor unless ``recompute``."""
    if p.quant is not None:
        forbid_gradients(
            "fused_moe",
            "quantized calls (fp8, mxfp4) have no backward (train in bf16/fp16/float32)",
            hidden_states=x.hidden_states,
            w1=x.w1,
            w2=x.w2,
            topk_weights=x.topk_weights,
            w1_bias=x.w1_bias,
            w2_bias=x.w2_bias,
            w1_scale=x.w1_scale,
            w2_scale=x.w2_scale,
            a1_scale=x.a1_scale,
            a2_scale=x.a2_scale,
        )
    from .training import BackwardSettings, differentiable_moe

    backend = kernel.experts.name
    triton_manager = manager if backend == "triton" else None  # the torch backward takes no scratch
    settings = BackwardSettings(
        p.activation, p.apply_router_weight_on_input, p.global_E, backend, p, triton_manager, owner
    )

    preact = None
    if backend == "triton" and not recompute and p.quant is None and p.M > 0:
        preact = torch.empty((p.slots, 2 * p.I), dtype=p.dtype, device=x.hidden_states.device)
        if manager.poison:  # rows of non-local slots stay unwritten: prove the backward never reads them
            preact.fill_(float("nan"))
    run = x if preact is None else dataclasses.replace(x, preact=preact)

    def forward() -> torch.Tensor:
        return kernel(
            run, p, manager=manager, owner=owner, workspace13=workspace13, workspace2=workspace2, layout_key=layout_key
        )

    return differentiable_moe(
        forward,
        settings,
        x.hidden_states,
        x.w1,
        x.w2,
        x.topk_weights,
        x.topk_ids,
        x.expert_map,
        x.w1_bias,
        x.w2_bias,
        preact=preact,
    )


def resolve(
    p: MoEProblem,
    device: torch.device,
    backend: str,
    workspace: WorkspaceManager | None,
) -> tuple[MoEKernel, WorkspaceManager]:
    """The kernel and the workspace manager that run a validated problem ``p`` on ``device``.

    Raises ValueError when the backend cannot run ``p`` or the manager serves another device."""
    kernel = get_kernel(resolve_backend(backend, device))
    reason = kernel.unsupported(p)
    if reason is not None:
        raise ValueError(f"backend {kernel.experts.name!r} cannot run this problem: {reason}")
    return kernel, _manager_for(workspace, device)


def run_problem(
    x: ExpertsInputs,
    p: MoEProblem,
    *,
    backend: str = "auto",
    workspace: WorkspaceManager | None = None,
    workspace13: torch.Tensor | None = None,
    workspace2: torch.Tensor | None = None,
    owner: object = None,
) -> torch.Tensor:
    """Run a validated problem through the chosen backend's kernel (the registered op's eager implementation).

    Differentiable like :func:`fused_moe` when autograd is recording and an input requires grad."""
    kernel, manager = resolve(p, x.hidden_states.device, backend, workspace)
    if torch.is_grad_enabled() and _wants_grad(x):
        return _differentiable(kernel, x, p, manager, None, workspace13, workspace2, owner)
    return kernel(x, p, manager=manager, owner=owner, workspace13=workspace13, workspace2=workspace2)
