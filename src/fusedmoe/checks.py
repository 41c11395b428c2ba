"""Argument validation for the public entry points.

Structural checks (types, shapes, dtypes, devices) always run and never touch tensor data, so they cost no
device-to-host sync. Value checks (ids in range, finite logits, a consistent expert_map) need the data; they
run only with ``checks="full"`` or the environment variable ``FUSEDMOE_CHECKS=full``. Without them an
out-of-range id is treated as non-local by every backend (it never reads or writes out of bounds).
"""

from __future__ import annotations

import os

import torch

from .problem import ACTIVATIONS, MoEProblem
from .quant import FP8_DTYPE, QuantConfig, quantized_layout

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CHECK_LEVELS = ("basic", "full")


class GradientNotSupportedError(RuntimeError):
    """A fusedmoe call was asked for a gradient it cannot compute (fp8-quantized calls, scales, expert
    parallelism)."""


def forbid_gradients(where: str, reason: str, **tensors: torch.Tensor | None) -> None:
    """Raise :class:`GradientNotSupportedError` when autograd is recording and any of ``tensors`` requires grad:
    the result would carry no gradient, and a silently missing gradient is a wrong answer. ``reason`` says why
    this call has no backward."""
    if not torch.is_grad_enabled():
        return
    needing = [name for name, t in tensors.items() if t is not None and t.requires_grad]
    if needing:
        raise GradientNotSupportedError(
            f"{where}: {', '.join(needing)} require{'s' if len(needing) == 1 else ''} grad, but {reason}. For "
            "inference run under torch.no_grad() or torch.inference_mode() (or set requires_grad=False)."
        )


def check_level(checks: str | None) -> str:
    level = checks if checks is not None else os.environ.get("FUSEDMOE_CHECKS", "basic")
    if level not in CHECK_LEVELS:
        raise ValueError(f"checks must be one of {CHECK_LEVELS} (or env FUSEDMOE_CHECKS), got {level!r}")
    return level


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but hidden_states is on {device}")


def positive_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v <= 0:
        raise ValueError(f"{name} must be > 0, got {v}")
    return v


def check_activation(activation: object) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation  # type: ignore[return-value]


def _check_scale(
    name: str, t: torch.Tensor | None, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32
) -> None:
    dt = str(dtype).removeprefix("torch.")
    if t is None:
        raise ValueError(f"{name} is required for this quantization mode (expected {dt} {list(shape)})")
    _tensor(name, t)
    _same_device(name, t, device)
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dt}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _check_mma_scales(quant, w1, w2, w1_scale, w2_scale, a1_scale, a2_scale, H, I, device) -> None:
    """mma-layout MXFP4 (fusedmoe.mxfp4_layout.to_mma_layout): uint8 values and scale bytes of the layout's shapes,
    and no activation scales."""
    want = quantized_layout(quant, w1.shape[0], H, I)
    for name, t in (("w1", w1), ("w2", w2), ("w1_scale", w1_scale), ("w2_scale", w2_scale)):
        _check_scale(name, t, want[name][0], device, torch.uint8)
    for name, t in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if t is not None:
            raise ValueError(f"{name} was given but quant='mxfp4_mma' quantizes weights only (activations stay float)")


def _check_mxfp4(w1, w2, w1_scale, w2_scale, a1_scale, a2_scale, H, I, device) -> None:
    """MXFP4 weights (packed uint8 and e8m0 scales of the logical [E, 2I, H] / [E, H, I]) and no activation
    scales."""
    from .mxfp4 import check_mxfp4

    E = w1.shape[0]
    for name, w, s, shape in (("w1", w1, w1_scale, (E, 2 * I, H)), ("w2", w2, w2_scale, (E, H, I))):
        if s is None:
            raise ValueError(f"quant='mxfp4' needs {name}_scale (uint8 e8m0 exponents {[*shape[:2], shape[2] // 32]})")
        _same_device(f"{name}_scale", s, device)
        check_mxfp4(name, w, s, shape)
    for name, t in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if t is not None:
            raise ValueError(f"{name} was given but quant='mxfp4' quantizes weights only (activations stay float)")


def _mma_intermediate_size(w1, w2, quant, H: int) -> int:
    """I of mma-layout MXFP4 weights (w1 [E, 2I/16, 8 Kp(H)]: a row block per 8 columns of I), after checking that
    both weights have the layout's shapes for H (from hidden_states) and that I."""
    from .mxfp4 import GROUP

    I = 8 * w1.shape[1]
    if H % GROUP or I % GROUP or I == 0:
        raise ValueError(f"quant={quant.name!r} needs H and I multiples of {GROUP}, got H={H}, I={I} (from w1)")
    want = quantized_layout(quant, w1.shape[0], H, I)
    for name, w in (("w1", w1), ("w2", w2)):
        if tuple(w.shape) != want[name][0]:
            raise ValueError(
                f"{name} must be the mma layout {list(want[name][0])} of a weight with H={H} (from hidden_states) "
                f"and I={I} (from w1's {w1.shape[1]} row blocks), got {list(w.shape)}"
            )
    return I


def check_quant_scales(quant, w1, w2, w1_scale, w2_scale, a1_scale, a2_scale, device, H=None, I=None) -> None:
    """Scale tensors must match the quantization mode's shapes (see fusedmoe.quant); ``H``/``I``: the logical
    sizes (MXFP4 packs two weights per byte)."""
    if quant is None:
        for name, t in (("w1_scale", w1_scale), ("w2_scale", w2_scale), ("a1_scale", a1_scale), ("a2_scale", a2_scale)):
            if t is not None:
                raise ValueError(f"{name} was given but quant is None")
        return
    if quant.layout == "mma":
        _check_mma_scales(quant, w1, w2, w1_scale, w2_scale, a1_scale, a2_scale, H, I, device)
        return
    if quant.mode == "mxfp4":
        _check_mxfp4(w1, w2, w1_scale, w2_scale, a1_scale, a2_scale, H, I, device)
        return
    if w1.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise TypeError(f"quant={quant.name!r} needs w1 and w2 in {FP8_DTYPE}, got {w1.dtype} and {w2.dtype}")
    layout = quantized_layout(quant, w1.shape[0], w1.shape[2], w2.shape[2])
    _check_scale("w1_scale", w1_scale, layout["w1_scale"][0], device)
    _check_scale("w2_scale", w2_scale, layout["w2_scale"][0], device)
    if quant.static_activation_scale:
        _check_scale("a1_scale", a1_scale, (1,), device)
        _check_scale("a2_scale", a2_scale, (1,), device)
    else:
        for name, t in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
            if t is not None:
                raise ValueError(
                    f"{name} was given but quant={quant.name!r} computes activation scales dynamically; "
                    "use QuantConfig('fp8_tensor', static_activation_scale=True) for static scales"
                )


def check_fused_moe_args(
    hidden_states,
    w1,
    w2,
    topk_weights,
    topk_ids,
    *,
    activation,
    apply_router_weight_on_input,
    expert_map,
    global_num_experts,
    quant,
    w1_scale,
    w2_scale,
    a1_scale,
    a2_scale,
    checks: str | None = None,
    w1_bias=None,
    w2_bias=None,
) -> MoEProblem:
    """Validate ``fused_moe``'s arguments and describe the call as a :class:`MoEProblem`.

    Raises TypeError / ValueError naming the offending argument. Only ``checks="full"`` reads tensor data.
    """
    level = check_level(checks)
    _tensor("hidden_states", hidden_states)
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D [M, H], got shape {list(hidden_states.shape)}")
    if hidden_states.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden_states must be one of {FLOAT_DTYPES}, got {hidden_states.dtype}")
    M, H = hidden_states.shape
    if H == 0:
        raise ValueError("hidden_states has hidden size 0")
    device = hidden_states.device
    quant = QuantConfig.parse(quant)

    for name, w in (("w1", w1), ("w2", w2)):
        _tensor(name, w)
        _same_device(name, w, device)
        if w.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {list(w.shape)}")
    E = w1.shape[0]
    if E <= 0:
        raise ValueError(f"num_experts (w1.shape[0]) must be > 0, got {E}")
    if w2.shape[0] != E:
        raise ValueError(f"w1 and w2 disagree on the number of experts: {E} vs {w2.shape[0]}")
    if quant is not None and quant.layout == "mma":
        I = _mma_intermediate_size(w1, w2, quant, H)
    else:
        packed = 2 if quant is not None and quant.mode == "mxfp4" else 1  # MXFP4: two weights per byte along K
        what = " (MXFP4: H/2 bytes per row)" if packed == 2 else ""
        if w1.shape[2] * packed != H:
            raise ValueError(f"w1 must be [E, 2I, H] with H={H} (from hidden_states){what}, got {list(w1.shape)}")
        if w2.shape[1] != H:
            raise ValueError(f"w2 must be [E, H, I] with H={H} (from hidden_states), got {list(w2.shape)}")
        I = w2.shape[2] * packed
        if I <= 0 or w1.shape[1] != 2 * I:
            raise ValueError(
                f"w1 rows must be 2 x w2's I (gate rows then up rows): w1 {list(w1.shape)}, w2 {list(w2.shape)}"
            )
    if quant is None and (w1.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype):
        raise TypeError(
            f"w1/w2 dtype ({w1.dtype}, {w2.dtype}) must match hidden_states ({hidden_states.dtype}) unless quant is set"
        )
    check_quant_scales(quant, w1, w2, w1_scale, w2_scale, a1_scale, a2_scale, device, H, I)
    check_biases(w1_bias, w2_bias, E, I, H, device, hidden_states.dtype)

    _tensor("topk_ids", topk_ids)
    _tensor("topk_weights", topk_weights)
    _same_device("topk_ids", topk_ids, device)
    _same_device("topk_weights", topk_weights, device)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != M:
        raise ValueError(f"topk_ids must be [M={M}, k], got shape {list(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    k = topk_ids.shape[1]
    if tuple(topk_weights.shape) != (M, k):
        raise ValueError(f"topk_weights must have topk_ids' shape {[M, k]}, got {list(topk_weights.shape)}")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"topk_weights must be a floating tensor, got {topk_weights.dtype}")

    if expert_map is not None:
        _tensor("expert_map", expert_map)
        _same_device("expert_map", expert_map, device)
        if expert_map.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"expert_map must be an int32 tensor [global_num_experts], got {expert_map.dtype}")
        if expert_map.dim() != 1 or expert_map.shape[0] == 0:
            raise ValueError(
                f"expert_map must be 1-D and non-empty [global_num_experts], got shape {list(expert_map.shape)}"
            )
    if global_num_experts is None:
        global_E = expert_map.shape[0] if expert_map is not None else E
    else:
        global_E = positive_int("global_num_experts", global_num_experts)
    if expert_map is not None and expert_map.shape[0] != global_E:
        raise ValueError(f"expert_map must have global_num_experts={global_E} entries, got {expert_map.shape[0]}")
    if expert_map is None and global_E != E:
        raise ValueError(
            f"global_num_experts={global_E} differs from the {E} experts in w1 but no expert_map was given"
        )
    if k <= 0 or k > global_E:
        raise ValueError(f"top_k (topk_ids.shape[1]) must be in [1, {global_E}], got {k}")
    check_activation(activation)
    if not isinstance(apply_router_weight_on_input, bool):
        raise TypeError("apply_router_weight_on_input must be a bool")

    if level == "full":
        _full_checks(topk_ids, topk_weights, expert_map, global_E, E)

    return MoEProblem(
        M=M,
        H=H,
        I=I,
        E=E,
        global_E=global_E,
        top_k=k,
        dtype=hidden_states.dtype,
        weight_dtype=w1.dtype,
        activation=activation,
        apply_router_weight_on_input=apply_router_weight_on_input,
        has_expert_map=expert_map is not None,
        quant=quant,
        has_bias=w1_bias is not None or w2_bias is not None,
    )


def check_biases(w1_bias, w2_bias, E: int, I: int, H: int, device: torch.device, dtype: torch.dtype) -> None:
    """Expert biases (optional, independently): w1_bias [E, 2I], w2_bias [E, H], in hidden_states' dtype."""
    for name, t, shape in (("w1_bias", w1_bias, (E, 2 * I)), ("w2_bias", w2_bias, (E, H))):
        if t is None:
            continue
        _tensor(name, t)
        _same_device(name, t, device)
        if t.dtype != dtype:
            raise TypeError(f"{name} must have hidden_states' dtype {dtype}, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _full_checks(topk_ids, topk_weights, expert_map, global_E: int, E: int) -> None:
    """Data checks (one device-to-host sync): ids in range, finite weights, consistent expert_map."""
    if topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= global_E:
            raise ValueError(f"topk_ids must lie in [0, {global_E}), found values in [{lo}, {hi}]")
        if not bool(torch.isfinite(topk_weights).all()):
            raise ValueError("topk_weights contains NaN or inf")
    if expert_map is not None:
        local = expert_map[expert_map >= 0]
        if bool((expert_map < -1).any()) or bool((local >= E).any()):
            raise ValueError(f"expert_map values must be -1 or a local expert id in [0, {E})")
        if local.numel() != E or torch.unique(local).numel() != E:
            raise ValueError(f"expert_map must map exactly {E} global experts to distinct local ids 0..{E - 1}")
