"""transformers configs and weights in fusedmoe's terms, and layers of a given class built from them.

This module does not import :class:`fusedmoe.FusedMoE`: :func:`build_from_hf` and :func:`build_from_hf_state_dict`
take the layer class as an argument, so that ``FusedMoE``'s own ``from_hf_experts`` / ``from_hf_state_dict`` can
use them (importing this module when called) without an import cycle. :mod:`fusedmoe.integrations.loading` holds
the public entry points (the class defaults to ``FusedMoE``) and re-exports the rest.

Layouts understood (names relative to one MoE block, e.g. ``model.layers.3.mlp.``):

- transformers 5 fused experts: ``experts.gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and
  ``experts.down_proj [E, H, I]``: fusedmoe's own ``w1`` / ``w2`` layout, used as is.
- the older per-expert layout: ``experts.{e}.gate_proj.weight [I, H]``, ``experts.{e}.up_proj.weight``,
  ``experts.{e}.down_proj.weight [H, I]`` (Mixtral's ``w1`` / ``w3`` / ``w2`` names too), stacked.
- gpt-oss: ``experts.gate_up_proj [E, H, 2I]`` with gate and up *interleaved* along the last axis (column 2j is
  gate j, 2j+1 is up j), ``experts.gate_up_proj_bias [E, 2I]``, ``experts.down_proj [E, I, H]``,
  ``experts.down_proj_bias [E, H]``: converted once (:func:`gpt_oss_to_fused`) to ``w1 [E, 2I, H]`` with gate
  rows then up rows, ``w1_bias`` in the same order, ``w2 [E, H, I]``, ``w2_bias``, so the kernels need no
  interleaving or transposition; its router is ``router.weight`` / ``router.bias``.
- routers (``gate.weight``, DeepSeek-V3's ``gate.e_score_correction_bias``), shared experts
  (``shared_expert.*`` + ``shared_expert_gate.weight`` in Qwen2-MoE, ``shared_experts.*`` in DeepSeek).

Model settings (routing, sizes, activation) come from the transformers config: :func:`layer_kwargs`.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from ..problem import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "build_from_hf",
    "build_from_hf_state_dict",
    "checkpoint_quant",
    "convert_hf_state_dict",
    "fused_to_gpt_oss",
    "gate_then_up",
    "gpt_oss_to_fused",
    "hf_activation",
    "HF_ACTIVATIONS",
    "layer_kwargs",
    "load_safetensors",
    "per_expert_to_fused",
]

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")

#: transformers ``hidden_act`` values -> the fusedmoe activation computing the same function: SiLU, GELU with
#: the tanh approximation ("gelu"), exact (erf) GELU ("gelu_exact").
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu",
    "gelu_new": "gelu",
    "gelu_fast": "gelu",
    "gelu_python_tanh": "gelu",
    "gelu": "gelu_exact",
    "gelu_python": "gelu_exact",
}


def _attr(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def hf_activation(hidden_act: object) -> str:
    """The fusedmoe activation of a transformers ``hidden_act``; NotImplementedError naming it if there is none."""
    if hidden_act not in HF_ACTIVATIONS:
        raise NotImplementedError(
            f"fusedmoe has no kernel for hidden_act={hidden_act!r} (supported: {sorted(HF_ACTIVATIONS)})"
        )
    return HF_ACTIVATIONS[hidden_act]


def _activation(config) -> str:
    return hf_activation(getattr(config, "hidden_act", "silu"))


def layer_kwargs(config, *, shared_experts: bool = True) -> dict:
    """FusedMoE constructor arguments (sizes, routing, shared experts, biases) for a transformers config.

    ``shared_experts=False``: the routed experts only (no shared-expert settings or checks), for callers that
    run the model's own shared-expert modules. Raises NotImplementedError for a model type or setting fusedmoe
    does not reproduce exactly.
    """
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(f"model_type {mt!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
    H = config.hidden_size
    k = config.num_experts_per_tok
    E = _attr(config, "num_experts", "num_local_experts", "n_routed_experts")
    kw: dict = dict(num_experts=E, top_k=k, hidden_size=H)
    if mt in ("qwen3_moe", "qwen2_moe"):
        kw.update(
            intermediate_size=config.moe_intermediate_size,
            scoring="softmax",
            renormalize=bool(config.norm_topk_prob),
            activation=_activation(config),
        )
        if shared_experts and mt == "qwen2_moe" and getattr(config, "shared_expert_intermediate_size", 0):
            kw.update(
                num_shared_experts=1,
                shared_intermediate_size=config.shared_expert_intermediate_size,
                shared_expert_gate=True,
            )
    elif mt in ("mixtral", "olmoe"):
        renorm = True if mt == "mixtral" else bool(config.norm_topk_prob)
        kw.update(
            intermediate_size=config.intermediate_size,
            scoring="softmax",
            renormalize=renorm,
            activation=_activation(config),
        )
    elif mt in ("deepseek_v2", "deepseek_v3"):
        if shared_experts and getattr(config, "mlp_bias", False):
            raise NotImplementedError("DeepSeek shared experts with mlp_bias=True are not supported")
        kw.update(
            intermediate_size=config.moe_intermediate_size,
            activation=_activation(config),
            routed_scaling_factor=float(config.routed_scaling_factor),
        )
        if mt == "deepseek_v2":
            method = getattr(config, "topk_method", "greedy")
            kw.update(scoring="softmax", renormalize=False)
            if method == "group_limited_greedy":
                kw.update(num_expert_groups=config.n_group, topk_groups=config.topk_group)
            elif method != "greedy":
                raise NotImplementedError(f"DeepSeek-V2 topk_method={method!r} is not supported")
        else:
            kw.update(scoring="sigmoid", renormalize=bool(config.norm_topk_prob), correction_bias=True)
            if config.n_group is not None:
                kw.update(num_expert_groups=config.n_group, topk_groups=config.topk_group)
        n_shared = getattr(config, "n_shared_experts", 0) or 0
        if shared_experts and n_shared:
            kw.update(num_shared_experts=1, shared_intermediate_size=config.moe_intermediate_size * n_shared)
    else:  # gpt_oss
        alpha = getattr(config, "swiglu_alpha", SWIGLUOAI_ALPHA)
        limit = getattr(config, "swiglu_limit", SWIGLUOAI_LIMIT)
        if (alpha, limit) != (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT):
            raise NotImplementedError(
                f"gpt-oss swiglu_alpha={alpha}, swiglu_limit={limit}: fusedmoe's 'swigluoai' is fixed at "
                f"alpha={SWIGLUOAI_ALPHA}, limit={SWIGLUOAI_LIMIT}"
            )
        kw.update(
            intermediate_size=config.intermediate_size,
            scoring="softmax_topk",
            renormalize=False,
            activation="swigluoai",
            expert_bias=True,
            router_bias=True,
        )
    return kw


# ---- layout conversions --------------------------------------------------------------------------------------
def gpt_oss_to_fused(gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias):
    """gpt-oss expert weights -> ``(w1 [E, 2I, H], w1_bias [E, 2I], w2 [E, H, I], w2_bias [E, H])``, contiguous.

    gpt-oss stores ``gate_up_proj [E, H, 2I]`` with gate j in column 2j and up j in column 2j + 1 (applied as
    ``x @ gate_up_proj``) and ``down_proj [E, I, H]``; fusedmoe wants gate rows, then up rows, applied as
    ``x @ w1.T``. A pure permutation and transposition: exact in every dtype.
    """
    w1 = gate_then_up(gate_up_proj).transpose(1, 2).contiguous()
    b1 = gate_then_up(gate_up_proj_bias).contiguous()
    w2 = down_proj.transpose(1, 2).contiguous()
    return w1, b1, w2, down_proj_bias.contiguous()


def gate_then_up(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's interleaved last axis (gate j at 2j, up j at 2j + 1) as fusedmoe's: all gates, then all ups."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def fused_to_gpt_oss(w1, w1_bias, w2, w2_bias):
    """Inverse of :func:`gpt_oss_to_fused`: ``(gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias)``."""
    E, two_i, H = w1.shape
    I = two_i // 2
    gu = torch.stack([w1[:, :I], w1[:, I:]], dim=2).reshape(E, two_i, H).transpose(1, 2).contiguous()
    b = torch.stack([w1_bias[:, :I], w1_bias[:, I:]], dim=2).reshape(E, two_i).contiguous()
    return gu, b, w2.transpose(1, 2).contiguous(), w2_bias.contiguous()


_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def per_expert_to_fused(
    state_dict: Mapping[str, torch.Tensor], prefix: str = "experts.", num_experts: int | None = None
):
    """Stack ``{prefix}{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj`` (or Mixtral's ``w1`` / ``w3`` /
    ``w2``) into ``(w1 [E, 2I, H], w2 [E, H, I])``. Raises KeyError if an expert is missing."""
    for names in _PER_EXPERT_NAMES:
        if f"{prefix}0.{names[0]}.weight" in state_dict:
            gate, up, down = names
            break
    else:
        raise KeyError(
            f"no per-expert weights under {prefix!r} (expected {prefix}0.gate_proj.weight or {prefix}0.w1.weight)"
        )
    if num_experts is None:
        num_experts = 0
        while f"{prefix}{num_experts}.{gate}.weight" in state_dict:
            num_experts += 1
    w1, w2 = [], []
    for e in range(num_experts):
        p = f"{prefix}{e}."
        try:
            w1.append(torch.cat([state_dict[p + f"{gate}.weight"], state_dict[p + f"{up}.weight"]], dim=0))
            w2.append(state_dict[p + f"{down}.weight"])
        except KeyError as err:
            raise KeyError(f"expert {e} is incomplete in the state dict: missing {err}") from None
    return torch.stack(w1), torch.stack(w2)


def _shared(sd: Mapping[str, torch.Tensor], name: str):
    g, u, d = (sd.get(f"{name}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj"))
    if g is None:
        return None
    return torch.cat([g, u], dim=0), d


def _gpt_oss_mxfp4(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's MXFP4 experts (``experts.{gate_up,down}_proj_{blocks,scales,bias}``, the checkpoint's own names)
    -> FusedMoE's ``w1`` / ``w1_scale`` (gate rows, then up rows), ``w2`` / ``w2_scale`` and biases."""
    from ..mxfp4 import from_checkpoint_blocks, split_interleaved_rows

    w1, s1 = split_interleaved_rows(
        *from_checkpoint_blocks(sd["experts.gate_up_proj_blocks"], sd["experts.gate_up_proj_scales"])
    )
    w2, s2 = from_checkpoint_blocks(sd["experts.down_proj_blocks"], sd["experts.down_proj_scales"])
    b1 = gate_then_up(sd["experts.gate_up_proj_bias"]).contiguous()
    return dict(
        w1=w1,
        w1_scale=s1,
        w2=w2.contiguous(),
        w2_scale=s2.contiguous(),
        w1_bias=b1,
        w2_bias=sd["experts.down_proj_bias"],
    )


def _per_expert_fp8_block(sd: Mapping[str, torch.Tensor], num_experts: int, block_n: int) -> dict[str, torch.Tensor]:
    """Per-expert fp8 weights with 128x128-block ``weight_scale_inv`` (Qwen3-FP8, DeepSeek-V3 checkpoints) ->
    ``w1`` [E, 2I, H] e4m3 with ``w1_scale`` [E, 2I/bn, H/bk] (gate blocks, then up blocks) and ``w2`` / ``w2_scale``.
    Gate and up stack along block rows, so I must be a multiple of the block's ``block_n``."""
    w1, w2 = per_expert_to_fused(sd, "experts.", num_experts)
    scales = {k[: -len(".weight_scale_inv")] + ".weight": v for k, v in sd.items() if k.endswith(".weight_scale_inv")}
    s1, s2 = per_expert_to_fused(scales, "experts.", num_experts)
    I = w2.shape[2]
    if I % block_n:
        raise NotImplementedError(f"fp8 block weights with intermediate size {I} not a multiple of block {block_n}")
    return dict(w1=w1, w1_scale=s1.float(), w2=w2, w2_scale=s2.float())


def checkpoint_quant(state_dict: Mapping[str, torch.Tensor], config):
    """The :class:`~fusedmoe.quant.QuantConfig` of a converted FusedMoE state dict (None: float weights), from its
    ``w1`` dtype and, for fp8 blocks, the config's ``quantization_config.weight_block_size``."""
    from ..quant import FP8_DTYPE, QuantConfig

    w1 = state_dict["w1"]
    if w1.dtype == torch.uint8:
        return QuantConfig("mxfp4")
    if w1.dtype == FP8_DTYPE:
        return QuantConfig("fp8_block", block_shape=_block_shape(config))
    return None


def _block_shape(config) -> tuple[int, int]:
    qc = getattr(config, "quantization_config", None) or {}
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method, block = qc.get("quant_method"), qc.get("weight_block_size")
    if method != "fp8" or not block or len(block) != 2:
        raise NotImplementedError(
            f"fp8 expert weights need quantization_config quant_method='fp8' with weight_block_size [n, k], got {qc}"
        )
    return int(block[0]), int(block[1])


def convert_hf_state_dict(state_dict: Mapping[str, torch.Tensor], config, prefix: str = "") -> dict[str, torch.Tensor]:
    """One MoE block's transformers weights (keys ``prefix + name``) -> a FusedMoE state dict.

    Handles the fused (transformers 5), per-expert (older) and gpt-oss layouts, and the quantized checkpoints'
    own names: gpt-oss MXFP4 (``*_blocks`` / ``*_scales``) and per-expert fp8 blocks (``*.weight_scale_inv``);
    see the module docstring. :func:`checkpoint_quant` tells the quantization of the result.
    """
    mt = getattr(config, "model_type", None)
    sd = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    out: dict[str, torch.Tensor] = {}
    if mt == "gpt_oss" and "experts.gate_up_proj_blocks" in sd:
        out.update(_gpt_oss_mxfp4(sd), gate=sd["router.weight"], gate_bias=sd["router.bias"])
        return out
    if mt == "gpt_oss":
        w1, b1, w2, b2 = gpt_oss_to_fused(
            sd["experts.gate_up_proj"],
            sd["experts.gate_up_proj_bias"],
            sd["experts.down_proj"],
            sd["experts.down_proj_bias"],
        )
        out.update(w1=w1, w2=w2, w1_bias=b1, w2_bias=b2, gate=sd["router.weight"], gate_bias=sd["router.bias"])
        return out
    if "experts.gate_up_proj" in sd:
        out["w1"], out["w2"] = sd["experts.gate_up_proj"], sd["experts.down_proj"]
    elif any(k.endswith(".weight_scale_inv") for k in sd if k.startswith("experts.")):
        E = _attr(config, "num_experts", "num_local_experts", "n_routed_experts")
        out.update(_per_expert_fp8_block(sd, E, _block_shape(config)[0]))
    else:
        out["w1"], out["w2"] = per_expert_to_fused(
            sd, "experts.", _attr(config, "num_experts", "num_local_experts", "n_routed_experts")
        )
    out["gate"] = sd["gate.weight"]
    if "gate.e_score_correction_bias" in sd:
        out["e_score_correction_bias"] = sd["gate.e_score_correction_bias"].float()
    for name in ("shared_expert", "shared_experts"):
        sh = _shared(sd, name)
        if sh is not None:
            out["shared_w1"], out["shared_w2"] = sh
    if "shared_expert_gate.weight" in sd:
        out["shared_gate"] = sd["shared_expert_gate.weight"]
    return out


def load_safetensors(
    paths: str | os.PathLike | Iterable[str | os.PathLike], prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Read the tensors whose names start with ``prefix`` from safetensors files (a file, a list of files or a
    directory of ``*.safetensors``), keeping their full names. Only matching tensors are read."""
    from safetensors import safe_open

    if isinstance(paths, (str, os.PathLike)):
        p = os.fspath(paths)
        paths = sorted(glob.glob(os.path.join(p, "*.safetensors"))) if os.path.isdir(p) else [p]
    out: dict[str, torch.Tensor] = {}
    for path in paths:
        with safe_open(os.fspath(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    out[key] = f.get_tensor(key)
    return out


# ---- building layers ------------------------------------------------------------------------------------------
def _new_layer(cls, config, device, dtype, **kwargs):
    kw = layer_kwargs(config)
    kw.update(kwargs)
    return cls(**kw, device=device, dtype=dtype)


def build_from_hf_state_dict(
    cls,
    state_dict: Mapping[str, torch.Tensor] | str | os.PathLike,
    config,
    *,
    prefix: str = "",
    device=None,
    dtype=None,
    **kwargs,
):
    """A layer of class ``cls`` (FusedMoE or a subclass) holding one MoE block's weights from a state dict (or
    safetensors path(s)) and its config: :func:`fusedmoe.integrations.loading.from_hf_state_dict`."""
    if isinstance(state_dict, (str, os.PathLike)):
        state_dict = load_safetensors(state_dict, prefix)
    sd = convert_hf_state_dict(state_dict, config, prefix)
    quant = checkpoint_quant(sd, config)
    dtype = dtype or (sd["gate"] if quant is not None else sd["w1"]).dtype
    device = device or sd["w1"].device
    if quant is not None:
        kwargs = {**kwargs, "quant": quant}
    layer = _new_layer(cls, config, "meta", dtype, **kwargs)
    expected = set(layer.state_dict())
    missing, extra = expected - set(sd), set(sd) - expected
    if missing or extra:
        raise KeyError(f"state dict does not match the layer: missing {sorted(missing)}, unexpected {sorted(extra)}")
    stored = {"w1", "w2", "w1_scale", "w2_scale"} if quant is not None else set()  # kept as the checkpoint has them

    def cast(k, v):
        if k in stored:
            return v.to(device=device)
        return v.to(device=device, dtype=torch.float32 if k == "e_score_correction_bias" else dtype)

    layer.load_state_dict({k: cast(k, v) for k, v in sd.items()}, assign=True)
    for p in layer.parameters():
        p.requires_grad_(False)
    return layer


def _module_config(module: nn.Module):
    experts = getattr(module, "experts", module)
    config = getattr(experts, "config", None)
    if config is None:
        raise ValueError(f"{type(module).__name__} carries no transformers config; pass config=")
    return config


def build_from_hf(cls, module: nn.Module, *, config=None, share_weights: bool = True, **kwargs):
    """A layer of class ``cls`` (FusedMoE or a subclass) equivalent to a transformers MoE block or experts
    module: :func:`fusedmoe.integrations.loading.from_hf`."""
    config = config or _module_config(module)
    experts = getattr(module, "experts", module)
    if getattr(experts, "has_post_expert_norm", False) or not getattr(experts, "has_gate", True):
        raise NotImplementedError(f"{type(experts).__name__}: post-expert norms / ungated experts are not supported")
    if getattr(experts, "_is_expert_parallel", False):
        raise NotImplementedError("transformers' expert-parallel experts are not supported; use fusedmoe's EP")
    mt = config.model_type
    if mt == "gpt_oss":
        sd = dict(
            zip(
                ("w1", "w1_bias", "w2", "w2_bias"),
                gpt_oss_to_fused(
                    experts.gate_up_proj.data,
                    experts.gate_up_proj_bias.data,
                    experts.down_proj.data,
                    experts.down_proj_bias.data,
                ),
            )
        )
    else:
        sd = {"w1": experts.gate_up_proj.data, "w2": experts.down_proj.data}
    router = getattr(module, "router", None) if mt == "gpt_oss" else getattr(module, "gate", None)
    dtype = sd["w1"].dtype
    if router is not None and module is not experts:
        sd["gate"] = router.weight.data
        if getattr(router, "bias", None) is not None:
            sd["gate_bias"] = router.bias.data
        if getattr(router, "e_score_correction_bias", None) is not None:
            sd["e_score_correction_bias"] = router.e_score_correction_bias.data
    for name in ("shared_expert", "shared_experts"):
        mlp = getattr(module, name, None)
        if mlp is not None:
            sd["shared_w1"] = torch.cat([mlp.gate_proj.weight.data, mlp.up_proj.weight.data], dim=0)
            sd["shared_w2"] = mlp.down_proj.weight.data
    if getattr(module, "shared_expert_gate", None) is not None:
        sd["shared_gate"] = module.shared_expert_gate.weight.data
    layer = _new_layer(cls, config, "meta", dtype, **kwargs)
    device = sd["w1"].device
    for name, t in layer.state_dict().items():
        want = torch.float32 if name == "e_score_correction_bias" else dtype
        src = sd.get(name)
        if src is None:  # e.g. the router of a bare experts module
            src = torch.zeros(t.shape, dtype=want, device=device)
        if src.dtype != want or not share_weights:
            src = src.to(want, copy=True)
        if tuple(src.shape) != tuple(t.shape):
            raise ValueError(
                f"{name}: transformers tensor has shape {list(src.shape)}, FusedMoE expects {list(t.shape)}"
            )
        if name == "e_score_correction_bias":
            layer.e_score_correction_bias = src
        else:
            setattr(layer, name, nn.Parameter(src, requires_grad=False))
    return layer
