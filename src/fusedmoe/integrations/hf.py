"""fusedmoe inside transformers (>= 5) models.

Two ways in:

- :func:`register` adds ``"fusedmoe"`` to transformers' experts interface, so
  ``from_pretrained(..., experts_implementation="fusedmoe")`` or ``model.set_experts_implementation("fusedmoe")``
  runs every ``@use_experts_implementation`` experts module through fusedmoe's kernels. Routing stays
  transformers' (the function receives ``top_k_index`` / ``top_k_weights``); only the experts are replaced.
  Standard layout (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) is used in place; gpt-oss's layout is
  converted once per module and cached for inference (a second copy of its expert weights), and converted in
  differentiable ops on every call that trains its experts.
- :func:`patch_model` makes whole MoE blocks (router, routed experts) run through :class:`fusedmoe.FusedMoE`
  layers. A patched block is the same module object with the same submodules, parameters and buffers (so
  ``state_dict``, ``save_pretrained``, ``load_state_dict``, ``named_parameters`` and ``.to()`` see exactly
  transformers' names and tensors); only its class gains :class:`FusedMoEBlock`, whose forward computes the
  router logits as the original router does and hands them to a FusedMoE layer holding the very same weight
  tensors (gpt-oss's experts are converted). Shared experts run the model's own modules. All patched layers of
  a model share one WorkspaceManager. :func:`unpatch_model` restores the original classes.

Both refuse, when they are set up, a model they cannot compute exactly (a NotImplementedError naming the module
and what is unsupported), and leave the model as it was. float64 models run transformers' own code (fusedmoe's
kernels compute in float32 at best), with a warning.

Both train: a forward that autograd records while an input or a parameter requires grad computes the experts
through fusedmoe's differentiable ``fused_moe`` on the model's own parameters (routing in differentiable torch
ops), so every parameter gets transformers' gradient and a parameter the user froze gets none; ``requires_grad``
is never changed. Inference under ``torch.no_grad()`` / ``torch.inference_mode()`` (``generate``) takes the
inference path.

What does not match transformers, and why: docs/transformers.md.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module

from ..api import fused_moe
from ..checks import forbid_gradients
from ..layer import FusedMoE
from ..op import fused_moe_op, workspace_id
from ..problem import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from ..quant import FP8_DTYPE, QuantConfig
from ..workspace.manager import WorkspaceManager
from .convert import HF_ACTIVATIONS, SUPPORTED_MODEL_TYPES, gpt_oss_to_fused, layer_kwargs
from .hf_quantized import is_quantized, run_quantized_experts
from .hf_support import (
    SERVED_DTYPES,
    _act_kinds,
    _activation_of,
    _dtype_unsupported,
    _module_activation,
    _source_key,
    act_fn_activation,
    experts_unsupported,
)

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "PATCHABLE_BLOCKS",
    "FusedMoEBlock",
    "act_fn_activation",
    "attach_workspace",
    "check_experts_implementation",
    "experts_modules",
    "experts_unsupported",
    "fusedmoe_experts_forward",
    "patch_model",
    "patched_blocks",
    "register",
    "reserve_workspace",
    "unpatch_model",
]

EXPERTS_IMPLEMENTATION = "fusedmoe"

#: transformers MoE block classes that patch_model handles (class name -> model_type).
PATCHABLE_BLOCKS = {
    "Qwen3MoeSparseMoeBlock": "qwen3_moe",
    "Qwen2MoeSparseMoeBlock": "qwen2_moe",
    "MixtralSparseMoeBlock": "mixtral",
    "OlmoeSparseMoeBlock": "olmoe",
    "DeepseekV2Moe": "deepseek_v2",
    "DeepseekV3MoE": "deepseek_v3",
    "GptOssMLP": "gpt_oss",
}

_CACHE_ATTR = "_fusedmoe_converted"
_WARNED_ATTR = "_fusedmoe_warned"
#: Parameters of a transformers experts module that the fused call reads (directly or converted).
_EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
#: Names registered with :func:`register`: the implementations whose selection is checked.
_REGISTERED: set[str] = set()


# ---- what fusedmoe can compute (of one experts module: hf_support) -----------------------------------------
def _warn_once(module: nn.Module, what: str, reason: str) -> None:
    warned = module.__dict__.setdefault(_WARNED_ATTR, set())
    if reason not in warned:
        warned.add(reason)
        warnings.warn(f"{what}: {reason}", UserWarning, stacklevel=3)


def _named_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers' experts modules (``@use_experts_implementation``) of ``model``, ungated ones included (their
    ``up_proj`` takes the place of ``gate_up_proj``; fusedmoe refuses them)."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if hasattr(m, "down_proj")
        and hasattr(m, "is_transposed")
        and (hasattr(m, "gate_up_proj") or not getattr(m, "has_gate", True))
    ]


def check_experts_implementation(model: nn.Module) -> None:
    """Raise NotImplementedError naming every experts module of ``model`` that fusedmoe cannot compute, and
    why (see :func:`experts_unsupported`); warn for those whose dtype fusedmoe leaves to transformers' code.

    A model whose modules are not built yet (transformers checks the implementation in ``__init__``) is
    checked on its config: its ``hidden_act`` and gpt-oss's SwiGLU constants."""
    problems, left_to_transformers = [], []
    named = _named_experts(model)
    for name, experts in named:
        fp8 = _is_fp8_experts(experts)  # transformers' FP8Experts: fusedmoe_fp8_experts_forward serves them
        reason = fp8_experts_unsupported(experts) if fp8 else experts_unsupported(experts)
        if reason is not None:
            problems.append(f"{name or '<model>'} ({type(experts).__name__}): {reason}")
        elif not fp8 and _dtype_unsupported(experts.gate_up_proj.dtype) is not None:
            left_to_transformers.append(_dtype_unsupported(experts.gate_up_proj.dtype))
    if left_to_transformers and not problems:
        _warn_once(
            model,
            f"{type(model).__name__} with experts_implementation='fusedmoe': "
            f"{len(left_to_transformers)} experts modules run transformers' eager experts",
            left_to_transformers[0],
        )
    if not named:
        reason = _config_unsupported(getattr(model, "config", None))
        if reason is not None:
            problems.append(f"{type(model).__name__}: {reason}")
    if problems:
        raise NotImplementedError(
            "fusedmoe cannot compute these experts exactly, so experts_implementation='fusedmoe' is refused "
            "(the model keeps its current implementation):\n  " + "\n  ".join(problems)
        )


def _config_unsupported(config) -> str | None:
    if config is None:
        return None
    if getattr(config, "model_type", None) == "gpt_oss":
        alpha = getattr(config, "swiglu_alpha", SWIGLUOAI_ALPHA)
        limit = getattr(config, "swiglu_limit", SWIGLUOAI_LIMIT)
        if (alpha, limit) != (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT):
            return f"gpt-oss swiglu_alpha={alpha}, swiglu_limit={limit} differ from fusedmoe's swigluoai"
        return None
    act = getattr(config, "hidden_act", None)
    if act is not None and act not in HF_ACTIVATIONS:
        return f"hidden_act={act!r} has no fusedmoe kernel (supported: {sorted(HF_ACTIVATIONS)})"
    return None


# ---- experts interface --------------------------------------------------------------------------------------
def register(name: str = EXPERTS_IMPLEMENTATION) -> None:
    """Register fusedmoe as an experts implementation of transformers (idempotent).

    Also makes transformers check, whenever a model selects ``name`` (``set_experts_implementation``,
    ``from_pretrained(..., experts_implementation=...)``), that fusedmoe can compute its experts
    (:func:`check_experts_implementation`): a model it cannot serve is refused there, not at its first forward.
    """
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as err:  # pragma: no cover
        raise ImportError("fusedmoe.integrations.hf needs transformers>=5 (transformers.integrations.moe)") from err
    ExpertsInterface.register(name, fusedmoe_experts_forward)
    _act_kinds()  # filled eagerly: a compiled forward then only reads it
    try:  # transformers' fp8 experts (FineGrainedFP8) dispatch through an interface of their own
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # pragma: no cover - older transformers
        pass
    else:
        FP8ExpertsInterface.register(name, fusedmoe_fp8_experts_forward)
    _REGISTERED.add(name)
    _install_selection_check()


def _install_selection_check() -> None:
    """Wrap ``PreTrainedModel.get_correct_experts_implementation`` (where transformers validates a requested
    experts implementation, and checks its own ``grouped_mm`` can dispatch) so that selecting a fusedmoe
    implementation runs :func:`check_experts_implementation` first. Once per process."""
    from transformers import PreTrainedModel

    current = getattr(PreTrainedModel, "get_correct_experts_implementation", None)
    if current is None or getattr(current, "_fusedmoe_check", False):
        return

    @functools.wraps(current)
    def get_correct_experts_implementation(self, requested_experts):
        chosen = current(self, requested_experts)
        if chosen in _REGISTERED:
            if self._can_set_experts_implementation():
                check_experts_implementation(self)
            elif next(self.children(), None) is not None and not _named_experts(self):
                # built, and nothing here dispatches through the experts interface (llama4, jetmoe, dense models):
                # transformers would accept the name and never call fusedmoe
                raise NotImplementedError(
                    f"{type(self).__name__} has no transformers experts module (@use_experts_implementation) for "
                    f"experts_implementation={chosen!r} to run; patch_model serves the MoE blocks it lists "
                    "(fusedmoe.integrations.hf.PATCHABLE_BLOCKS)"
                )
        return chosen

    get_correct_experts_implementation._fusedmoe_check = True
    PreTrainedModel.get_correct_experts_implementation = get_correct_experts_implementation

    # from_pretrained / from_config select the implementation in __init__, before the experts modules exist (only
    # the config could be checked then): check the modules once the model is built, at the end of its __init__.
    post_init = PreTrainedModel.post_init

    @functools.wraps(post_init)
    def checked_post_init(self, *args, **kwargs):
        out = post_init(self, *args, **kwargs)
        if getattr(self.config, "_experts_implementation", None) in _REGISTERED and _named_experts(self):
            check_experts_implementation(self)
        return out

    PreTrainedModel.post_init = checked_post_init


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
    return [m for _, m in _named_experts(model)]


_REQUIRED = object()


def _param(module: nn.Module, name: str, default=_REQUIRED):
    """``module.<name>``: a parameter read from the module's dict (nn.Module's ``__getattr__`` costs ~0.7 us a name
    per call), anything else (a buffer, a plain attribute) through ``getattr``, which returns ``default`` where one
    is given and the module has no such name, and raises AttributeError otherwise."""
    p = module._parameters.get(name)
    if p is not None:
        return p
    return getattr(module, name) if default is _REQUIRED else getattr(module, name, default)


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _expert_weights(experts: nn.Module):
    """(w1, w2, w1_bias, w2_bias) in fusedmoe's layout for a transformers experts module, to compute a forward
    with: its own tensors (standard layout), or gpt-oss's converted to fusedmoe's layout.

    gpt-oss: while autograd records and one of its expert parameters requires grad, the conversion runs in
    differentiable ops on every call (no cache), so the gradients reach ``gate_up_proj``, ``down_proj`` and their
    biases; otherwise the inference copy of :func:`_layer_weights` (converted once)."""
    if getattr(experts, "is_transposed", False):
        params = (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias)
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            w1, b1, w2, b2 = gpt_oss_to_fused(*params)
            return w1, w2, b1, b2
    return _layer_weights(experts)


def _layer_weights(experts: nn.Module):
    """(w1, w2, w1_bias, w2_bias) in fusedmoe's layout that a layer can hold as parameters: the module's own
    Parameter objects, or for gpt-oss a converted copy (no autograd history, ``requires_grad=False``), made
    once and remade when a source tensor changes (storage, version, dtype, device, shape; checked in eager mode, reused
    as is while compiling). The copy is for inference: a forward that trains gpt-oss's experts computes with
    :func:`_expert_weights`."""
    if not getattr(experts, "is_transposed", False):
        P = experts._parameters  # inline rather than _param: this runs on every call
        w1, w2 = P.get("gate_up_proj"), P.get("down_proj")
        if w1 is None or w2 is None:
            w1, w2 = _param(experts, "gate_up_proj"), _param(experts, "down_proj")
        if not getattr(experts, "has_bias", False):
            return w1, w2, None, None
        return w1, w2, _param(experts, "gate_up_proj_bias", None), _param(experts, "down_proj_bias", None)
    params = (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias)
    cached = experts.__dict__.get(_CACHE_ATTR)
    if torch.compiler.is_compiling():
        if cached is not None:
            return cached[1]
        w1, b1, w2, b2 = gpt_oss_to_fused(*(p.detach() for p in params))
        return w1, w2, b1, b2
    key = _source_key(*params)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            w1, b1, w2, b2 = (
                nn.Parameter(t, requires_grad=False) for t in gpt_oss_to_fused(*(p.detach() for p in params))
            )
        cached = (key, (w1, w2, b1, b2))
        experts.__dict__[_CACHE_ATTR] = cached
    return cached[1]


def _eager_experts_forward(experts: nn.Module):
    """The experts class's own forward (transformers' "eager" implementation), under every experts-interface
    dispatcher transformers wrapped around it: FineGrainedFP8 decorates ``FP8Experts`` once per MoE layer it
    replaces, each dispatcher wrapping the previous one, and one level down is a dispatcher that calls fusedmoe
    again (an endless recursion). Other decorators on the class's forward are kept."""
    fn = type(experts).forward
    while getattr(fn, "__wrapped__", None) is not None and _is_experts_dispatcher(fn):
        fn = fn.__wrapped__
    if fn is type(experts).forward:  # pragma: no cover - transformers' decorator keeps it via functools.wraps
        raise NotImplementedError(f"{type(experts).__name__}: transformers' own forward is not reachable")
    return fn


def _is_experts_dispatcher(fn) -> bool:
    """Whether ``fn`` is the forward ``use_experts_implementation`` puts on an experts class (defined in
    transformers.integrations.moe: functools.wraps copies the name, not the code)."""
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_filename.replace("\\", "/").endswith("transformers/integrations/moe.py")


def _experts_verdict(experts: nn.Module, dtype: torch.dtype):
    """(activation, None) when fusedmoe computes ``experts`` for inputs of ``dtype``, else (None, reason);
    cached per module, hidden_act, act_fn and dtype."""
    if torch.compiler.is_compiling():  # traced once per compilation; the cache is eager mode's
        reason = experts_unsupported(experts) or _dtype_unsupported(dtype)
        return (None, reason) if reason is not None else (_activation_of(experts), None)
    key = (_hidden_act_of(experts), id(_act_fn_of(experts)), dtype)
    cache = experts.__dict__.setdefault("_fusedmoe_verdicts", {})
    verdict = cache.get(key)
    if verdict is None:
        reason = experts_unsupported(experts) or _dtype_unsupported(dtype)
        verdict = (None, reason) if reason is not None else (_activation_of(experts), None)
        cache[key] = verdict
    return verdict


def _hidden_act_of(experts: nn.Module):
    """``experts.config.hidden_act`` (None without a config), read from the config's own attributes where it is one:
    a transformers config's ``__getattribute__`` costs ~1 us per read, on every call of the verdict lookup."""
    config = experts.__dict__.get("config")
    if config is None:
        return None
    try:
        own = object.__getattribute__(config, "__dict__")
    except AttributeError:  # a config object without an instance dict (slots)
        own = {}
    return own["hidden_act"] if "hidden_act" in own else getattr(config, "hidden_act", None)


def _act_fn_of(experts: nn.Module):
    """``experts.act_fn`` (a submodule or a plain attribute), None without one, without nn.Module's ``__getattr__``."""
    fn = experts._modules.get("act_fn")
    return fn if fn is not None else experts.__dict__.get("act_fn")


def fusedmoe_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers experts contract: ``(hidden [T, H], top_k_index [T, k] int, top_k_weights [T, k] or
    [T, E] dense) -> [T, H]`` in hidden's dtype, computed by fusedmoe (``self`` is the experts module).

    A module fusedmoe cannot compute (float64, or a module changed after the implementation was selected) runs
    the experts class's own forward instead, with a warning naming the module and the reason. A module whose
    weights :func:`fusedmoe.integrations.hf_quant.quantize_experts` quantized runs its quantized weights."""
    if is_quantized(self):
        return run_quantized_experts(self, hidden_states, top_k_index, top_k_weights)
    activation, reason = _experts_verdict(self, hidden_states.dtype)
    if reason is not None:
        _warn_once(
            self, f"{type(self).__name__} (experts_implementation='fusedmoe') runs transformers' eager experts", reason
        )
        return _eager_experts_forward(self)(self, hidden_states, top_k_index, top_k_weights)
    workspace = self.__dict__.get("_fusedmoe_workspace")
    backend = self.__dict__.get("_fusedmoe_backend", "auto")
    return _run_experts(self, hidden_states, top_k_index, top_k_weights, activation, workspace, backend)


def _run_experts(
    experts: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    activation: str,
    workspace: WorkspaceManager | None,
    backend: str,
) -> torch.Tensor:
    """The routed experts of the transformers module ``experts`` on its own parameters, through fusedmoe: [T, H]
    in hidden's dtype. Differentiable in the hidden states, the routing weights and every expert parameter
    (gpt-oss's converted per call while they need a gradient, :func:`_expert_weights`); casts and the gather of
    dense [T, E] routing weights are autograd ops too."""
    w1, w2, b1, b2 = _expert_weights(experts)
    expert_map = _sentinel_map(experts, w1) if getattr(experts, "_is_expert_parallel", False) else None
    if top_k_weights.shape != top_k_index.shape:  # dense [T, E] routing weights (older DeepSeek-V2 style)
        top_k_weights = top_k_weights.gather(1, top_k_index.long())
    x = hidden_states
    if x.dtype != w1.dtype:
        x = x.to(w1.dtype)
    run = fused_moe_op if torch.compiler.is_compiling() else fused_moe  # the op keeps a compiled graph whole
    out = run(
        x,
        w1,
        w2,
        top_k_weights,  # in transformers' dtype: the kernels read any float dtype and compute in float32
        top_k_index,
        activation=activation,
        workspace=workspace,
        backend=backend,
        w1_bias=b1,
        w2_bias=b2,
        expert_map=expert_map,
        global_num_experts=None if expert_map is None else expert_map.numel(),
    )
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


def _sentinel_map(experts: nn.Module, w1: torch.Tensor) -> torch.Tensor:
    """The expert map of a module sharded by transformers' expert parallelism: its ids are local, and its
    all-reduce implementation marks the slots of other ranks' experts with the id ``E_local`` (weight 0). The map
    [E_local + 1] sends ``e -> e`` and ``E_local -> -1``: the slot contributes nothing and gets no gradient, and the
    sentinel is an id in range, so ``checks="full"`` (which rejects out-of-range ids) accepts the call. Cached per
    module, size and device."""
    E, device = w1.shape[0], w1.device
    cached = experts.__dict__.get("_fusedmoe_sentinel_map")
    if cached is None or cached.numel() != E + 1 or cached.device != device:
        cached = torch.arange(E + 1, dtype=torch.int32, device=device)
        cached[E] = -1
        experts.__dict__["_fusedmoe_sentinel_map"] = cached
    return cached


# ---- transformers' fp8 experts (FineGrainedFP8) -------------------------------------------------------------
def _is_fp8_experts(experts: nn.Module) -> bool:
    """Whether ``experts`` is transformers' block-scaled fp8 experts module (``FP8Experts``)."""
    return hasattr(experts, "gate_up_proj_scale_inv") and hasattr(experts, "down_proj_scale_inv")


def fp8_experts_unsupported(experts: nn.Module) -> str | None:
    """Why fusedmoe cannot compute transformers' ``FP8Experts`` module ``experts`` (block-scaled e4m3 weights with
    ``*_scale_inv``, as FineGrainedFP8 loads Qwen3-MoE-FP8 and DeepSeek-V3), or None when it can."""
    if not getattr(experts, "has_gate", True) or getattr(experts, "has_bias", False):
        return "ungated experts and expert biases are not supported with fp8 weights"
    if getattr(experts, "_is_expert_parallel", False):
        return "transformers' expert parallelism is not supported with fp8 weights"
    if getattr(experts, "activation_scheme", "dynamic") != "dynamic":
        return "static fp8 activation scales are not supported (fusedmoe quantizes activations per token group)"
    if getattr(experts, "gate_softcap", None) is not None:
        return "softcapped gates are not supported"
    w, s = experts.gate_up_proj, experts.gate_up_proj_scale_inv
    if w.dtype != FP8_DTYPE or s.dtype != torch.float32:
        return f"weights {w.dtype} with {s.dtype} scales: fusedmoe takes float8_e4m3fn with float32 scales"
    block = getattr(experts, "block_size", None)
    if block is None:
        return "fp8 experts without a weight block size are not supported"
    bn, bk = block
    E, two_i, H = w.shape
    if tuple(s.shape) != (E, -(-two_i // bn), -(-H // bk)):
        return f"gate_up_proj_scale_inv {list(s.shape)} is not one scale per {bn}x{bk} block of {list(w.shape)}"
    alpha = getattr(experts, "swiglu_alpha", None)
    limit = getattr(experts, "limit", None)  # the clamp FP8Experts applies (swiglu_limit in earlier transformers)
    if limit is None:
        limit = getattr(experts, "swiglu_limit", None)
    if alpha is not None and (alpha, limit) != (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT):
        return f"swiglu alpha={alpha}, limit={limit} differ from fusedmoe's swigluoai"
    if alpha is None and limit is not None:
        # FP8Experts clamps gate and up at swiglu_limit before the activation (GLM-5-Next, HY-V4, DeepSeek-V4)
        return f"a gate and up clamped at swiglu_limit={limit} without swiglu_alpha are not supported"
    if alpha is None:
        try:
            _module_activation(experts)
        except NotImplementedError as err:
            return str(err)
    return None


#: The FP8Experts tensors and plain settings a verdict (:func:`_fp8_verdict`) depends on.
_FP8_TENSORS = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")
_FP8_SETTINGS = ("has_gate", "has_bias", "_is_expert_parallel", "activation_scheme", "gate_softcap", "block_size")
_FP8_SETTINGS += ("swiglu_alpha", "swiglu_limit", "limit", "limit_after_act")


def _fp8_tensors(experts: nn.Module) -> tuple[torch.Tensor, ...]:
    """(gate_up_proj, gate_up_proj_scale_inv, down_proj, down_proj_scale_inv) of an ``FP8Experts`` module
    (:func:`_param`)."""
    P = experts._parameters  # inline rather than _param: this runs on every call
    return tuple(P[n] if n in P else _param(experts, n) for n in _FP8_TENSORS)


def _fp8_verdict(
    experts: nn.Module, dtype: torch.dtype, tensors: tuple[torch.Tensor, ...]
) -> tuple[str | None, QuantConfig | None, str | None]:
    """``(activation, quant, None)`` when fusedmoe computes transformers' ``FP8Experts`` module ``experts`` (its
    :func:`_fp8_tensors` are ``tensors``) for hidden states of ``dtype``, else ``(None, None, reason)``. Cached per
    module, keyed by what decides it: the dtype, the shapes and dtypes of its weights and scales, its plain
    settings, its ``act_fn`` and ``hidden_act`` (the checks read ~20 attributes: ~12 us of Python per call
    uncached, on the CPU machine)."""
    if torch.compiler.is_compiling():  # traced once per compilation; the cache is eager mode's
        return _fp8_checked(experts, dtype)
    own = experts.__dict__
    key = (
        dtype,
        *((t.shape, t.dtype) for t in tensors),
        *(own.get(a) for a in _FP8_SETTINGS),
        _hidden_act_of(experts),
        id(_act_fn_of(experts)),
    )
    cached = own.get("_fusedmoe_fp8_verdict")
    try:
        if cached is not None and cached[0] == key:
            return cached[1]
        hash(key)
    except TypeError:  # an unhashable setting (e.g. block_size as a list): checked on every call
        return _fp8_checked(experts, dtype)
    verdict = _fp8_checked(experts, dtype)
    own["_fusedmoe_fp8_verdict"] = (key, verdict)
    return verdict


def _fp8_checked(experts: nn.Module, dtype: torch.dtype) -> tuple[str | None, QuantConfig | None, str | None]:
    """:func:`_fp8_verdict` computed, not looked up."""
    reason = fp8_experts_unsupported(experts) or _dtype_unsupported(dtype)
    if reason is not None:
        return None, None, reason
    activation = "swigluoai" if experts.swiglu_alpha is not None else _module_activation(experts)
    return activation, QuantConfig("fp8_block", block_shape=tuple(experts.block_size)), None


def fusedmoe_fp8_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts contract for transformers' ``FP8Experts`` (registered in its ``FP8ExpertsInterface`` by
    :func:`register`): ``fused_moe(quant="fp8_block")`` on the module's e4m3 weights and ``*_scale_inv`` block
    scales. Modules it cannot compute, and calls that need a gradient (fusedmoe's quantized experts have no
    backward), run the class's own forward, with a warning naming the reason."""
    w1, s1, w2, s2 = _fp8_tensors(self)
    activation, quant, reason = _fp8_verdict(self, hidden_states.dtype, (w1, s1, w2, s2))
    grad = torch.is_grad_enabled()
    if reason is None and grad and (hidden_states.requires_grad or top_k_weights.requires_grad):
        reason = "a gradient is needed and fusedmoe's fp8 experts have no backward"
    if reason is not None:
        _warn_once(
            self, f"{type(self).__name__} (experts_implementation='fusedmoe') runs transformers' fp8 experts", reason
        )
        return _eager_experts_forward(self)(self, hidden_states, top_k_index, top_k_weights)
    if top_k_weights.shape != top_k_index.shape:
        top_k_weights = top_k_weights.gather(1, top_k_index.long())
    if grad:  # quantized weights and their scales take no gradient
        w1, s1, w2, s2 = w1.detach(), s1.detach(), w2.detach(), s2.detach()
    run = fused_moe_op if torch.compiler.is_compiling() else fused_moe
    return run(
        hidden_states,
        w1,
        w2,
        top_k_weights,  # in transformers' dtype, as above
        top_k_index,
        activation=activation,
        quant=quant,
        w1_scale=s1,
        w2_scale=s2,
        workspace=self.__dict__.get("_fusedmoe_workspace"),
        backend=self.__dict__.get("_fusedmoe_backend", "auto"),
    )


# ---- whole-block patching ------------------------------------------------------------------------------------
def _router_of(block: nn.Module, model_type: str) -> nn.Module:
    name = "router" if model_type == "gpt_oss" else "gate"
    router = block._modules.get(name)  # by dict: nn.Module's __getattr__ costs ~0.7 us a name per call
    return router if router is not None else getattr(block, name)


def _experts_implementation_of(experts: nn.Module):
    """The experts implementation ``experts``' transformers config selects, without the config's
    ``__getattribute__`` (~1 us a read) where the config keeps it in its own attributes (in eager mode)."""
    config = experts.__dict__.get("config")
    if torch.compiler.is_compiling():  # dynamo does not trace object.__getattribute__
        return getattr(config, "_experts_implementation", None)
    try:
        own = object.__getattribute__(config, "__dict__")
    except AttributeError:
        own = {}
    if "_experts_implementation_internal" in own:
        return own["_experts_implementation_internal"]
    return getattr(config, "_experts_implementation", None)


def _router_logits(router: nn.Module, model_type: str, x: torch.Tensor) -> torch.Tensor:
    """[T, E] logits exactly as ``router``'s forward computes them (its dtype and precision) from x [T, H]."""
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return F.linear(x.float(), router.weight.float())
    return F.linear(x, router.weight, router.bias if model_type == "gpt_oss" else None)


def _observed(module: nn.Module) -> bool:
    """Whether a hook (transformers' output recorders for ``output_router_logits``, a user's) may want to see
    ``module`` run. transformers' own recorder hooks count only while a forward records router logits."""
    if _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks:
        return True
    if not (module._forward_hooks or module._forward_pre_hooks):
        return False
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    if any(not _is_output_recorder(h) for h in hooks):
        return True
    return _recording("router_logits")


def _is_output_recorder(hook) -> bool:
    return (
        getattr(hook, "__module__", None) == "transformers.utils.output_capturing"
        and getattr(hook, "__name__", None) == "output_capturing_hook"
    )


def _recording(key: str) -> bool:
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - another transformers: assume it records
        return True
    collected = _active_collector.get()
    return collected is not None and key in collected


@dataclass(eq=False, repr=False)
class _Patch:
    """The fusedmoe state of one patched block: its model type, the workspace group and backend, the
    experts implementation under which the fused path runs, and the FusedMoE layer (built on demand)."""

    model_type: str
    group: _WorkspaceGroup
    backend: str
    implementation: str | None
    original_class: type
    previous_implementation: str | None
    layer: FusedMoE | None = field(default=None, init=False)

    def __deepcopy__(self, memo):
        # a copy shares the workspace managers (they serve any number of layers); its layer is rebuilt on the
        # copied block's own tensors
        new = memo[id(self)] = replace(self)
        return new

    def __getstate__(self):
        raise TypeError(
            "a model patched by fusedmoe cannot be pickled (its workspace managers hold locks and device "
            "memory); save it with save_pretrained / state_dict, or unpatch_model first"
        )


class _WorkspaceGroup:
    """The workspace managers of one patch_model call: the one given or created, and one more per device the
    model is moved to, each shared by all its blocks."""

    def __init__(self, manager: WorkspaceManager):
        self.managers = {manager.device: manager}
        self.strategy = manager.strategy

    def manager_for(self, device: torch.device) -> WorkspaceManager:
        manager = self.managers.get(device)
        if manager is None:
            manager = self.managers[device] = WorkspaceManager(device, strategy=self.strategy)
            workspace_id(manager)
        return manager


def _build_layer(block: nn.Module, patch: _Patch) -> FusedMoE:
    """A FusedMoE layer (routed experts only) for ``block``, holding no weights of its own: :func:`_sync`
    points it at the block's."""
    config = block.experts.config
    kw = layer_kwargs(config, shared_experts=False)
    layer = FusedMoE(**kw, device="meta", dtype=torch.float32, workspace=None, backend=patch.backend)
    _sync(block, patch, layer)
    if patch.model_type == "gpt_oss":
        layer.register_forward_pre_hook(_copy_does_not_train(weakref.ref(block)))
    return layer


def _copy_does_not_train(block_ref):
    """A forward pre-hook for the layer of a patched gpt-oss block: it holds an inference copy of the experts
    (fusedmoe's layout), which their gradients would not reach, so a direct call that would train them raises
    (the block's forward trains them: it converts them differentiably)."""

    def hook(layer, args):
        block = block_ref()
        if block is not None and torch.is_grad_enabled():
            forbid_gradients(
                f"{type(block).__name__}.moe (a patched gpt-oss block's FusedMoE layer, called directly)",
                "it computes with a converted inference copy of the experts that their gradients would not reach; "
                "call the block itself to train them",
                **{f"experts.{name}": getattr(block.experts, name) for name in _EXPERT_PARAMS},
            )

    return hook


def _sync(block: nn.Module, patch: _Patch, layer: FusedMoE) -> None:
    """Point ``layer`` at the block's current tensors (the same Parameter and buffer objects, or gpt-oss's
    converted copy) and at the workspace manager of their device."""
    experts = block.experts
    router = _router_of(block, patch.model_type)
    w1, w2, b1, b2 = _layer_weights(experts)
    P = layer._parameters
    P["w1"], P["w2"], P["gate"] = w1, w2, router.weight
    if b1 is not None or b2 is not None:
        P["w1_bias"], P["w2_bias"] = b1, b2
    if patch.model_type == "gpt_oss":
        P["gate_bias"] = router.bias
    if patch.model_type == "deepseek_v3":
        layer._buffers["e_score_correction_bias"] = router.e_score_correction_bias
    device = w1.device
    if layer.workspace is None or layer.workspace.device != device:
        layer.workspace = patch.group.manager_for(device)


def _in_sync(block: nn.Module, patch: _Patch, layer: FusedMoE) -> bool:
    experts = block._modules["experts"]
    router = _router_of(block, patch.model_type)
    P = layer._parameters
    if patch.model_type == "gpt_oss":
        w = _layer_weights(experts)
        if P["w1"] is not w[0] or P["gate_bias"] is not _param(router, "bias", None):
            return False
    elif P["w1"] is not _param(experts, "gate_up_proj") or P["w2"] is not _param(experts, "down_proj"):
        return False
    if (
        patch.model_type == "deepseek_v3"
        and layer._buffers["e_score_correction_bias"] is not router.e_score_correction_bias
    ):
        return False
    return P["gate"] is _param(router, "weight")


class FusedMoEBlock(nn.Module):
    """What :func:`patch_model` adds to a transformers MoE block: a patched block's class is
    ``FusedMoEBlock`` + the original class (same object, same submodules and tensors, so the same state dict).

    Its forward computes the router logits as the original router does (running the router module itself while
    a hook, e.g. ``output_router_logits``, records it, and whenever it trains; otherwise from the router's own
    weight, on CUDA up to ``ROUTER_GEMM_MAX_M`` rows inside the routing launch, whose float32 sums round to the
    same dtype but may break a bf16 tie between two experts the other way in a rare row), routes and runs
    the routed experts in a :class:`fusedmoe.FusedMoE` layer (:attr:`moe`) that holds the block's own weight
    tensors, and adds the block's own shared experts. In training mode Mixtral's router jitter multiplies the
    block's input by noise drawn exactly as transformers draws it (out of place: the caller's tensor is not
    modified). It runs the original class's forward instead while the model's experts implementation is not
    the one set by :func:`patch_model` (after ``set_experts_implementation``) and for inputs of a dtype
    fusedmoe does not compute (float64, with a warning). gpt-oss's block returns ``(hidden, None)``: the router
    scores it returns beside the hidden states are not computed (its decoder layer discards them).

    Training: while autograd records and the input, a router or an expert parameter requires grad, the block
    routes with :meth:`FusedMoE.route` (differentiable torch ops, so the router gets its gradient) and runs the
    experts module's own parameters through the differentiable ``fused_moe`` (gpt-oss's converted per call),
    not through :attr:`moe`, whose gpt-oss experts are an inference copy (a direct call of it that would train
    them raises :class:`~fusedmoe.checks.GradientNotSupportedError`).
    """

    @property
    def moe(self) -> FusedMoE:
        """The FusedMoE layer computing this block, pointed at the block's current tensors."""
        patch = self.__dict__["_fusedmoe"]
        layer = patch.layer
        if layer is None:
            layer = patch.layer = _build_layer(self, patch)
        elif not torch.compiler.is_compiling() and not _in_sync(self, patch, layer):
            _sync(self, patch, layer)
        return layer

    def extra_repr(self) -> str:
        return f"fusedmoe: model_type={self.__dict__['_fusedmoe'].model_type!r}"

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        patch = self.__dict__["_fusedmoe"]
        if patch.layer is not None:
            _sync(self, patch, patch.layer)
        return out

    def _fused_path(self, hidden_states: torch.Tensor) -> bool:
        patch = self.__dict__["_fusedmoe"]
        if _experts_implementation_of(self._modules["experts"]) != patch.implementation:
            return False
        if hidden_states.dtype not in SERVED_DTYPES:
            _warn_once(
                self,
                f"patched {patch.model_type} MoE block runs transformers' forward",
                _dtype_unsupported(hidden_states.dtype),
            )
            return False
        return True

    def forward(self, hidden_states: torch.Tensor):
        if not self._fused_path(hidden_states):
            return super().forward(hidden_states)
        patch = self.__dict__["_fusedmoe"]
        model_type = patch.model_type
        layer = self.moe
        jitter = getattr(self, "jitter_noise", 0) if self.training else 0
        if jitter > 0:  # Mixtral's training-mode router jitter: the same draw as transformers' (same RNG use)
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        router = _router_of(self, model_type)
        trains = torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for m in (router, self._modules["experts"]) for p in m.parameters())
        )
        if trains or _observed(router):
            # training runs the router module whether observed or not: an activation-checkpointing recompute
            # (where no recorder is active) then builds the graph its forward built
            logits = router(hidden_states if model_type.startswith("deepseek") else x)[0]
        elif model_type.startswith("deepseek"):  # float32 logits, which the layer's bf16 gate would not give
            logits = _router_logits(router, model_type, x)
        else:
            # the layer's gate (and gpt-oss' bias) are the router's own tensors (``self.moe`` keeps them so): the
            # layer computes the same logits, in its routing launch at decode sizes (one torch op fewer)
            logits = None
        if trains:
            # route in differentiable torch ops and run the experts on the experts module's own parameters
            # (gpt-oss's converted per call), so every gradient lands on the model's leaves
            weights, ids = layer.route(x, logits)
            out = _run_experts(self.experts, x, ids, weights, layer.activation, layer.workspace, layer.backend)
        else:
            out = layer(x, logits)
        if model_type == "qwen2_moe":
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        out = out.view(hidden_states.shape)
        if model_type in ("deepseek_v2", "deepseek_v3"):
            out = out + self.shared_experts(hidden_states)
        return (out, None) if model_type == "gpt_oss" else out


_PATCHED_CLASSES: dict[type, type] = {}


def _patched_class(cls: type) -> type:
    new = _PATCHED_CLASSES.get(cls)
    if new is None:
        name = f"FusedMoE{cls.__name__}"
        new = type(name, (FusedMoEBlock, cls), {"__module__": __name__, "__qualname__": name})
        setattr(sys.modules[__name__], name, new)  # importable by name, as classes are
        _PATCHED_CLASSES[cls] = new
    return new


def patched_blocks(model: nn.Module) -> list[FusedMoEBlock]:
    """The blocks of ``model`` that :func:`patch_model` patched."""
    return [m for m in model.modules() if isinstance(m, FusedMoEBlock)]


def _patch_problems(blocks) -> list[str]:
    problems = []
    for name, block in blocks:
        experts = getattr(block, "experts", None)
        config = getattr(experts, "config", None) or getattr(block, "config", None)
        where = f"{name} ({type(block).__name__})"
        if experts is None or config is None:
            problems.append(f"{where}: no experts module with a transformers config")
            continue
        reason = experts_unsupported(experts)
        if reason is None and getattr(experts, "_is_expert_parallel", False):
            reason = (
                "transformers' expert parallelism sharded its experts and replaced their forward: use "
                "experts_implementation='fusedmoe', which computes the local experts"
            )
        if reason is None and experts.__dict__.get("_fusedmoe_quant") is not None:
            reason = "its experts are quantized (quantize_experts): they run with experts_implementation='fusedmoe'"
        if reason is None and "forward" in block.__dict__:
            reason = (
                "its forward is replaced on the instance (e.g. by an accelerate hook), which would bypass "
                "the patch: patch before dispatching, or use experts_implementation='fusedmoe'"
            )
        if reason is None:
            try:
                layer_kwargs(config, shared_experts=False)
            except NotImplementedError as err:
                reason = str(err)
        if reason is not None:
            problems.append(f"{where}: {reason}")
    return problems


def patch_model(
    model: nn.Module, workspace: WorkspaceManager | None = None, *, backend: str = "auto"
) -> WorkspaceManager:
    """Make every supported MoE block of ``model`` (see :data:`PATCHABLE_BLOCKS`) run through fusedmoe
    (:class:`FusedMoEBlock`), and the model's experts implementation ``"fusedmoe"`` (:func:`register`).

    All patched layers share ``workspace`` (a new ``shared`` manager on the model's device when None), which is
    returned; moving the model to another device gives its blocks one new manager there. No weight is copied
    (gpt-oss's experts are converted to fusedmoe's layout: a second copy until :func:`unpatch_model`), and the
    model's modules, parameters (their ``requires_grad`` included), buffers and state-dict names stay
    transformers' own. The patched model trains: its gradients are those of the model's own parameters.

    Raises, before changing anything: ValueError if the model has no supported MoE block or is patched
    already; NotImplementedError naming every block fusedmoe cannot compute exactly, and why. A float64 model
    is patched with a warning: its blocks run transformers' code until it is cast to a dtype fusedmoe computes.
    """
    if patched_blocks(model):
        raise ValueError(f"{type(model).__name__} is patched already (call unpatch_model first)")
    blocks = [(n, m) for n, m in model.named_modules() if type(m).__name__ in PATCHABLE_BLOCKS]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no MoE block fusedmoe can patch (supported: {sorted(PATCHABLE_BLOCKS)}; "
            "for other models with standard experts use register() and experts_implementation='fusedmoe')"
        )
    problems = _patch_problems(blocks)
    if problems:
        raise NotImplementedError(
            "fusedmoe cannot compute these MoE blocks exactly; the model is left as it was:\n  " + "\n  ".join(problems)
        )
    if workspace is None:
        workspace = WorkspaceManager(_model_device(model))
    workspace_id(workspace)
    register()
    config = blocks[0][1].experts.config
    previous = config._experts_implementation
    if hasattr(model, "set_experts_implementation") and model._can_set_experts_implementation():
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    group = _WorkspaceGroup(workspace)
    implementation = config._experts_implementation
    for _, block in blocks:
        mt = PATCHABLE_BLOCKS[type(block).__name__]
        patch = _Patch(mt, group, backend, implementation, type(block), previous)
        patch.layer = _build_layer(block, patch)
        block.__dict__["_fusedmoe"] = patch
        block.__class__ = _patched_class(type(block))
        block.register_load_state_dict_post_hook(_after_load)
    reason = _dtype_unsupported(blocks[0][1].experts.gate_up_proj.dtype)
    if reason is not None and implementation != EXPERTS_IMPLEMENTATION:  # else the selection check warned
        _warn_once(model, f"patch_model({type(model).__name__}): the patched blocks run transformers' forward", reason)
    return workspace


def _after_load(block: nn.Module, incompatible_keys) -> None:
    """Load post-hook of patched blocks: re-point the layer at tensors a load replaced or updated in place
    (gpt-oss's converted copy), so that a compiled forward, which does not check, sees them."""
    patch = block.__dict__.get("_fusedmoe")
    if patch is not None and patch.layer is not None:
        _sync(block, patch, patch.layer)


def reserve_workspace(model: nn.Module, max_tokens: int, *, slot: object = None) -> int:
    """Size the shared arena of a patched model for ``max_tokens`` tokens per forward (every patched layer's
    plan), in ``slot`` (default: the current one), e.g. before ``manager.freeze()`` and CUDA-graph capture.
    Returns the arena's capacity in bytes."""
    blocks = patched_blocks(model)
    if not blocks:
        raise ValueError("the model has no patched MoE block; call patch_model first")
    nbytes = 0
    for b in blocks:
        layer = b.moe
        nbytes = layer.manager.reserve(layer.plan(max_tokens), owner=layer.owner_key, slot=slot)
    return nbytes


def unpatch_model(model: nn.Module) -> int:
    """Undo :func:`patch_model`: the blocks get their original classes back (nothing else of them changed) and
    the model the experts implementation it had before, unless another was set since. Returns how many blocks."""
    blocks = patched_blocks(model)
    for block in blocks:
        patch = block.__dict__.pop("_fusedmoe")
        block.__class__ = patch.original_class
        hooks = block._load_state_dict_post_hooks
        for key in [k for k, h in hooks.items() if h is _after_load]:
            del hooks[key]
    if blocks:
        patch_config = blocks[0].experts.config
        previous = patch.previous_implementation
        if (
            patch_config._experts_implementation == patch.implementation != previous
            and hasattr(model, "set_experts_implementation")
            and model._can_set_experts_implementation()
        ):
            model.set_experts_implementation(previous)
    return len(blocks)


assert set(PATCHABLE_BLOCKS.values()) == set(SUPPORTED_MODEL_TYPES)
