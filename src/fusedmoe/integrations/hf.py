"""fusedmoe inside transformers (>= 5) models.

Two ways in:

- :func:`register` adds ``"fusedmoe"`` to transformers' experts interface, so
  ``from_pretrained(..., experts_implementation="fusedmoe")`` or ``model.set_experts_implementation("fusedmoe")``
  runs every ``@use_experts_implementation`` experts module through fusedmoe's kernels. Routing stays
  transformers' (the function receives ``top_k_index`` / ``top_k_weights``); only the experts are replaced.
  Standard layout (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) is used in place; gpt-oss's layout is
  converted once per module and cached (a second copy of its expert weights).
- :func:`patch_model` replaces whole MoE blocks (router, experts, shared experts) with :class:`FusedMoEBlock`
  wrappers around :class:`fusedmoe.FusedMoE` layers that share the model's weight tensors where layouts agree
  (gpt-oss's experts are converted). All patched layers of a model share one WorkspaceManager.
  :func:`unpatch_model` puts the original blocks back.

Both are inference paths so far: a forward that would need a gradient (autograd recording and a weight or input
requiring grad) raises :class:`fusedmoe.checks.GradientNotSupportedError` instead of dropping the gradient;
run inference under ``torch.no_grad()`` / ``torch.inference_mode()`` (``generate`` does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..api import fused_moe
from ..checks import forbid_gradients
from ..layer import FusedMoE
from .loading import SUPPORTED_MODEL_TYPES, from_hf, gpt_oss_to_fused
from ..op import fused_moe_op, workspace_id
from ..problem import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from ..workspace.manager import WorkspaceManager

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "PATCHABLE_BLOCKS",
    "FusedMoEBlock",
    "attach_workspace",
    "experts_modules",
    "fusedmoe_experts_forward",
    "patch_model",
    "register",
    "reserve_workspace",
    "unpatch_model",
]

EXPERTS_IMPLEMENTATION = "fusedmoe"

#: transformers MoE block classes that patch_model replaces (class name -> model_type).
PATCHABLE_BLOCKS = {
    "Qwen3MoeSparseMoeBlock": "qwen3_moe",
    "Qwen2MoeSparseMoeBlock": "qwen2_moe",
    "MixtralSparseMoeBlock": "mixtral",
    "OlmoeSparseMoeBlock": "olmoe",
    "DeepseekV2Moe": "deepseek_v2",
    "DeepseekV3MoE": "deepseek_v3",
    "GptOssMLP": "gpt_oss",
}

_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}
_CACHE_ATTR = "_fusedmoe_converted"
#: Parameters of a transformers experts module that the fused call reads (directly or converted).
_EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


# ---- experts interface --------------------------------------------------------------------------------------
def register(name: str = EXPERTS_IMPLEMENTATION) -> None:
    """Register fusedmoe as an experts implementation of transformers (idempotent)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as err:  # pragma: no cover
        raise ImportError("fusedmoe.integrations.hf needs transformers>=5 (transformers.integrations.moe)") from err
    ExpertsInterface.register(name, fusedmoe_experts_forward)


def attach_workspace(model: nn.Module, workspace: WorkspaceManager | None = None, backend: str = "auto"):
    """Make every experts module of ``model`` run through ``workspace`` (one manager for the whole model; a new
    one on the model's device when None) and ``backend`` when the ``"fusedmoe"`` implementation is active.
    Returns the manager."""
    if workspace is None:
        workspace = WorkspaceManager(_model_device(model))
    workspace_id(workspace)
    for m in experts_modules(model):
        m._fusedmoe_workspace = workspace
        m._fusedmoe_backend = backend
    return workspace


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The transformers experts modules of ``model``: those its experts interface dispatches (and that the
    ``"fusedmoe"`` implementation computes)."""
    return [
        m for m in model.modules()
        if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and hasattr(m, "is_transposed")
    ]


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _activation_of(experts: nn.Module) -> str:
    if type(experts).__name__ == "GptOssExperts":
        if (getattr(experts, "alpha", None), getattr(experts, "limit", None)) != (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT):
            raise NotImplementedError(
                f"gpt-oss swiglu alpha={experts.alpha}, limit={experts.limit} differ from fusedmoe's swigluoai"
            )
        return "swigluoai"
    from transformers.integrations.moe import _default_apply_gate

    if getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        raise NotImplementedError(f"{type(experts).__name__} has a custom gate fusedmoe does not implement")
    act = getattr(getattr(experts, "config", None), "hidden_act", "silu")
    if act not in _ACTS:
        raise NotImplementedError(f"{type(experts).__name__}: hidden_act={act!r} has no fusedmoe kernel")
    return _ACTS[act]


def _expert_weights(experts: nn.Module):
    """(w1, w2, w1_bias, w2_bias) in fusedmoe's layout for a transformers experts module."""
    if getattr(experts, "has_post_expert_norm", False) or not getattr(experts, "has_gate", True):
        raise NotImplementedError(f"{type(experts).__name__}: post-expert norms / ungated experts are not supported")
    if getattr(experts, "_is_expert_parallel", False):
        raise NotImplementedError("transformers' expert parallelism is not supported by the fusedmoe experts")
    if getattr(experts, "is_concatenated", True) and not getattr(experts, "is_transposed", False):
        b1 = getattr(experts, "gate_up_proj_bias", None) if getattr(experts, "has_bias", False) else None
        b2 = getattr(experts, "down_proj_bias", None) if getattr(experts, "has_bias", False) else None
        return experts.gate_up_proj, experts.down_proj, b1, b2
    if not (experts.is_transposed and not experts.is_concatenated and experts.has_bias):
        raise NotImplementedError(f"{type(experts).__name__}: weight layout not supported")
    # gpt-oss layout: convert once, reuse while the parameters are unchanged (same storage and version).
    params = (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias)
    cached = experts.__dict__.get(_CACHE_ATTR)
    if torch.compiler.is_compiling():
        if cached is not None:
            return cached[1]
        w1, b1, w2, b2 = gpt_oss_to_fused(*params)
        return w1, w2, b1, b2
    key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            w1, b1, w2, b2 = gpt_oss_to_fused(*(p.detach() for p in params))
        cached = (key, (w1, w2, b1, b2))
        experts.__dict__[_CACHE_ATTR] = cached
    return cached[1]


def fusedmoe_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers experts contract: ``(hidden [T, H], top_k_index [T, k] int, top_k_weights [T, k] or
    [T, E] dense) -> [T, H]`` in hidden's dtype, computed by fusedmoe (``self`` is the experts module)."""
    w1, w2, b1, b2 = _expert_weights(self)
    activation = _activation_of(self)
    if top_k_weights.shape != top_k_index.shape:  # dense [T, E] routing weights (older DeepSeek-V2 style)
        top_k_weights = top_k_weights.gather(1, top_k_index.long())
    weights = top_k_weights.float()
    workspace = getattr(self, "_fusedmoe_workspace", None)
    backend = getattr(self, "_fusedmoe_backend", "auto")
    x = hidden_states
    if x.dtype != w1.dtype:
        x = x.to(w1.dtype)
    forbid_gradients(f"{type(self).__name__} (experts_implementation='fusedmoe')", hidden_states=hidden_states,
                     top_k_weights=top_k_weights, **{n: getattr(self, n, None) for n in _EXPERT_PARAMS})
    if torch.compiler.is_compiling():
        out = fused_moe_op(x, w1, w2, weights, top_k_index, activation=activation, workspace=workspace,
                           backend=backend, w1_bias=b1, w2_bias=b2)
    else:
        out = fused_moe(x, w1, w2, weights, top_k_index, activation=activation, workspace=workspace,
                        backend=backend, w1_bias=b1, w2_bias=b2)
    return out.to(hidden_states.dtype)


# ---- whole-block patching ------------------------------------------------------------------------------------
class FusedMoEBlock(nn.Module):
    """Drop-in replacement of a transformers MoE block: ``forward(hidden [B, S, H]) -> [B, S, H]`` (a tuple
    ``(out, None)`` where the original returned one, as gpt-oss's ``GptOssMLP``), computed by ``self.moe``.

    ``router_weight``: when the original router computes its logits in float32 from a float32 weight
    (DeepSeek), that weight (shared), so routing matches in bf16 too.
    """

    def __init__(self, moe: FusedMoE, *, router_weight: torch.Tensor | None = None, returns_tuple: bool = False,
                 original: nn.Module | None = None, model_type: str = ""):
        super().__init__()
        self.moe = moe
        self.returns_tuple = returns_tuple
        self.model_type = model_type
        self.router_weight = router_weight
        self.__dict__["original"] = original  # not a submodule: kept for unpatch_model only
        # the original's parameters (the weights fusedmoe reads, shared or converted): a forward that would need
        # their gradient must fail rather than drop it
        self.__dict__["grad_sources"] = dict(original.named_parameters()) if original is not None else {}

    def extra_repr(self) -> str:
        return f"model_type={self.model_type!r}"

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = None
        if self.router_weight is not None:
            logits = F.linear(x.float(), self.router_weight.float())
        forbid_gradients(f"patched {self.model_type} MoE block", hidden_states=hidden_states,
                         router_weight=self.router_weight, **self.__dict__["grad_sources"])
        out = self.moe(x, logits).view(shape)
        return (out, None) if self.returns_tuple else out


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def patch_model(
    model: nn.Module, workspace: WorkspaceManager | None = None, *, backend: str = "auto"
) -> WorkspaceManager:
    """Replace every supported MoE block of ``model`` (see :data:`PATCHABLE_BLOCKS`) by a :class:`FusedMoEBlock`.

    All patched layers share ``workspace`` (a new ``shared`` manager on the model's device when None), which is
    returned. Weights are shared with the model where the layouts agree (routed experts of every supported
    model but gpt-oss, routers, shared-expert down projections and gates); gpt-oss's experts are converted
    once to fusedmoe's layout (a second copy until :func:`unpatch_model`). Patch after moving the model to its
    final device and dtype. Raises ValueError if the model has no supported MoE block.
    """
    blocks = [(n, m) for n, m in model.named_modules() if type(m).__name__ in PATCHABLE_BLOCKS]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no MoE block fusedmoe can patch (supported: {sorted(PATCHABLE_BLOCKS)}; "
            "for other models with standard experts use register() and experts_implementation='fusedmoe')"
        )
    if workspace is None:
        workspace = WorkspaceManager(_model_device(model))
    workspace_id(workspace)
    for name, block in blocks:
        mt = PATCHABLE_BLOCKS[type(block).__name__]
        moe = from_hf(block, workspace=workspace, backend=backend)
        router_weight = None
        if mt in ("deepseek_v2", "deepseek_v3"):
            router_weight = block.gate.weight
        new = FusedMoEBlock(moe, router_weight=router_weight, returns_tuple=mt == "gpt_oss", original=block,
                            model_type=mt)
        _set_child(model, name, new)
    return workspace


def reserve_workspace(model: nn.Module, max_tokens: int, *, slot: object = None) -> int:
    """Size the shared arena of a patched model for ``max_tokens`` tokens per forward (every patched layer's
    plan), in ``slot`` (default: the current one), e.g. before ``manager.freeze()`` and CUDA-graph capture.
    Returns the arena's capacity in bytes."""
    blocks = [m for m in model.modules() if isinstance(m, FusedMoEBlock)]
    if not blocks:
        raise ValueError("the model has no patched MoE block; call patch_model first")
    nbytes = 0
    for b in blocks:
        nbytes = b.moe.manager.reserve(b.moe.plan(max_tokens), owner=b.moe.owner_key, slot=slot)
    return nbytes


def unpatch_model(model: nn.Module) -> int:
    """Put back the original blocks replaced by :func:`patch_model`; returns how many."""
    patched = [(n, m) for n, m in model.named_modules() if isinstance(m, FusedMoEBlock)]
    for name, block in patched:
        _set_child(model, name, block.original)
    return len(patched)


assert set(PATCHABLE_BLOCKS.values()) == set(SUPPORTED_MODEL_TYPES)
