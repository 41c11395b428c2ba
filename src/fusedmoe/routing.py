"""Router scoring and top-k expert selection for the MoE models fusedmoe serves.

One function, :func:`route`, turns router logits ``[M, E]`` into ``(topk_weights, topk_ids)`` the way each
supported model family does it; :data:`ROUTING_PRESETS` holds the keyword settings per family.

Non-finite logits (padding rows of CUDA-graph batches carry them in real serving) follow one rule in every
mode and on every path: ``+inf`` counts as the largest finite float32, ``NaN`` as ``-inf`` (never chosen over
a logit that is not -inf; it fills the top-k only behind every real candidate, with weight 0), and a row
without any logit above ``-inf`` (all NaN or -inf) selects experts ``0..k-1`` with weight 0. So ids are always
distinct and in ``[0, E)`` and weights always finite, whatever the logits.

On CUDA tensors the whole computation runs as one Triton launch (:mod:`fusedmoe.ops.routing`) with the same
rules; the torch code below is the definition and the path everywhere else.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

__all__ = ["ROUTING_PRESETS", "SCORING_MODES", "route"]

SCORING_MODES = ("softmax", "sigmoid", "softmax_topk")

# Keyword settings of route() per model family (top_k is the model's num_experts_per_tok and is passed
# separately; DeepSeek-V3's correction_bias is a model weight, e_score_correction_bias).
ROUTING_PRESETS: dict[str, dict] = {
    # Qwen3-MoE (norm_topk_prob=True in the released checkpoints) and Mixtral: softmax over all experts,
    # top-k, renormalize over the k.
    "qwen3-moe": {"scoring": "softmax", "renormalize": True},
    "mixtral": {"scoring": "softmax", "renormalize": True},
    # DeepSeek-V2 (236B, topk_method="group_limited_greedy"): softmax, keep the 3 best of 8 groups (group
    # rank = max score in the group), top-k, no renormalization, times 16.
    "deepseek-v2": {
        "scoring": "softmax",
        "renormalize": False,
        "num_expert_groups": 8,
        "topk_groups": 3,
        "routed_scaling_factor": 16.0,
    },
    # DeepSeek-V2-Lite (topk_method="greedy"): softmax, top-k, no renormalization, no scaling.
    "deepseek-v2-lite": {"scoring": "softmax", "renormalize": False},
    # DeepSeek-V3 / R1 (topk_method="noaux_tc"): sigmoid, bias-corrected group-limited choice, renormalize,
    # times 2.5.
    "deepseek-v3": {
        "scoring": "sigmoid",
        "renormalize": True,
        "num_expert_groups": 8,
        "topk_groups": 4,
        "routed_scaling_factor": 2.5,
    },
    # gpt-oss: top-k on the raw logits, softmax over the k chosen logits.
    "gpt-oss": {"scoring": "softmax_topk"},
}

# Added to the renormalization denominator (as DeepSeek-V3's reference does) so that k scores that all
# underflow to 0 give weights 0 instead of NaN; it is far below float32 resolution for any real sum.
_RENORM_EPS = 1e-20
_NEG_INF = float("-inf")
_FLOAT_MAX = torch.finfo(torch.float32).max


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _validate(
    router_logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, correction_bias, routed_scaling_factor
) -> None:
    # Shape / dtype / attribute checks only: nothing here reads tensor values (no device-to-host sync).
    if not isinstance(router_logits, Tensor):
        raise TypeError(f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}")
    if not router_logits.is_floating_point():
        raise TypeError(f"router_logits must have a floating dtype, got {router_logits.dtype}")
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be 2-D [M, E], got shape {tuple(router_logits.shape)}")
    E = router_logits.shape[1]
    if not _is_int(top_k):
        raise ValueError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must satisfy 1 <= top_k <= E = {E}, got {top_k}")
    if scoring not in SCORING_MODES:
        raise ValueError(f"scoring must be one of {SCORING_MODES}, got {scoring!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")

    if (num_expert_groups is None) != (topk_groups is None):
        raise ValueError(
            "num_expert_groups and topk_groups must be given together or both be None, got "
            f"num_expert_groups={num_expert_groups!r}, topk_groups={topk_groups!r}"
        )
    if num_expert_groups is not None:
        if scoring == "softmax_topk":
            raise ValueError("num_expert_groups/topk_groups are not supported with scoring='softmax_topk'")
        if not _is_int(num_expert_groups) or num_expert_groups < 1 or E % num_expert_groups != 0:
            raise ValueError(f"num_expert_groups must be a positive int dividing E = {E}, got {num_expert_groups!r}")
        if not _is_int(topk_groups) or not 1 <= topk_groups <= num_expert_groups:
            raise ValueError(
                "topk_groups must be an int with 1 <= topk_groups <= num_expert_groups = "
                f"{num_expert_groups}, got {topk_groups!r}"
            )

    if correction_bias is not None:
        if scoring == "softmax_topk":
            raise ValueError("correction_bias is not supported with scoring='softmax_topk'")
        if not isinstance(correction_bias, Tensor):
            raise TypeError(f"correction_bias must be a torch.Tensor, got {type(correction_bias).__name__}")
        if not correction_bias.is_floating_point():
            raise TypeError(f"correction_bias must have a floating dtype, got {correction_bias.dtype}")
        if tuple(correction_bias.shape) != (E,):
            raise ValueError(f"correction_bias must have shape ({E},), got {tuple(correction_bias.shape)}")
        if correction_bias.device != router_logits.device:
            raise ValueError(
                f"correction_bias is on {correction_bias.device} but router_logits is on {router_logits.device}"
            )

    if not isinstance(routed_scaling_factor, numbers.Real) or isinstance(routed_scaling_factor, bool):
        raise TypeError(f"routed_scaling_factor must be a real number, got {type(routed_scaling_factor).__name__}")
    if not (math.isfinite(routed_scaling_factor) and routed_scaling_factor > 0):
        raise ValueError(f"routed_scaling_factor must be positive and finite, got {routed_scaling_factor!r}")


def _fused_kernel_supports(E: int, top_k: int, num_expert_groups: int | None) -> bool:
    try:
        from .ops.routing import kernel_supports
    except ImportError:  # no triton
        return False
    return kernel_supports(E, top_k, num_expert_groups)


def fused_routing_applies(E: int, top_k: int, num_expert_groups: int | None, topk_groups: int | None) -> bool:
    """Whether :func:`route` takes the one-launch kernel for these settings on CUDA (top-k beyond the kept
    groups' experts stays on the torch path)."""
    return not _fills_from_dropped(E, top_k, num_expert_groups, topk_groups) and _fused_kernel_supports(
        E, top_k, num_expert_groups
    )


def _fills_from_dropped(E: int, top_k: int, num_expert_groups: int | None, topk_groups: int | None) -> bool:
    """Whether ``top_k`` exceeds the experts of the kept groups (the rest then come from dropped groups)."""
    return num_expert_groups is not None and top_k > topk_groups * (E // num_expert_groups)


def _fill_from_dropped(scores: Tensor, choice: Tensor, top_k: int, *, weights_from_choice: bool):
    """Top-k when ``top_k`` exceeds the experts of the kept groups, as transformers' DeepSeek routers do it.

    ``choice`` holds the dropped groups' experts at one fill value (-inf, or 0.0 for group_limited_greedy), so
    the last slots go to some of them: whichever ``torch.topk(..., sorted=False)`` returns among the tied fills,
    the very call transformers makes, so both pick the same experts. Their weight is their choice value (0.0)
    when ``weights_from_choice`` (group_limited_greedy takes its weights from the masked scores), else their
    score. Slots are then ordered by descending choice value, ties in topk's order."""
    values, ids = torch.topk(choice, top_k, dim=-1, sorted=False)
    order = values.sort(dim=-1, descending=True, stable=True).indices
    ids = ids.gather(1, order)
    weights = values.gather(1, order) if weights_from_choice else scores.gather(1, ids)
    return weights, ids


def route(
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
    """Score the router logits and choose ``top_k`` experts per token.

    Args:
        router_logits: ``[M, E]`` tensor of any floating dtype (computed in float32). ``M = 0`` is allowed.
        top_k: experts per token, ``1 <= top_k <= E``.
        scoring:
            * ``"softmax"``: ``scores = softmax(logits)`` over all ``E`` experts; choose the top-k scores.
            * ``"sigmoid"``: ``scores = sigmoid(logits)``; choose the top-k scores.
            * ``"softmax_topk"``: choose the top-k raw logits, weights = softmax over those ``k`` logits
              (they already sum to 1, so ``renormalize`` has no effect). No groups, no bias.
        renormalize: for "softmax"/"sigmoid", divide the k chosen scores by their sum.
        num_expert_groups, topk_groups: group-limited selection (both or neither). The ``E`` experts are split
            into ``G = num_expert_groups`` contiguous groups of ``E // G``; each group gets a rank, the
            ``topk_groups`` best groups are kept and the experts of the others can not be chosen. The rank is:
              * ``"noaux_tc"`` (scoring="sigmoid", or any scoring with ``correction_bias``): the sum of the
                group's 2 best (biased) scores (its single score if the group holds one expert);
              * ``"group_limited_greedy"`` (scoring="softmax" without ``correction_bias``): the group's best
                score.
            Requires ``G | E`` and ``1 <= topk_groups <= G``. When ``top_k`` exceeds the ``topk_groups * (E // G)``
            experts of the kept groups, the remaining slots go to experts of the dropped groups, exactly as
            transformers' DeepSeek routers fill them: with noaux_tc the dropped experts tie at ``-inf`` and those
            ``torch.topk`` returns first are taken with their (unbiased) scores as weights; with
            group_limited_greedy they tie at score 0.0 and are taken with weight 0. (This case runs the torch
            code below on every device.)
        correction_bias: ``[E]`` float tensor on the logits' device, added to the scores ONLY to rank groups
            and choose experts; the weights are always the unbiased scores of the chosen experts.
        routed_scaling_factor: positive finite number multiplied into the final weights (every mode).

    Returns:
        ``(topk_weights, topk_ids)``: float32 ``[M, top_k]`` and int32 ``[M, top_k]``, both contiguous, on
        ``router_logits.device``; per token in descending order of the choice score (ties as torch.topk).
        Ids are distinct and in ``[0, E)`` and weights finite for any logits (non-finite ones: module docs).
        The weights are differentiable in ``router_logits`` (and the scores) when autograd records: such calls
        take the torch code on every device.

    Model settings (see :data:`ROUTING_PRESETS`):
        * Qwen3-MoE, Mixtral: ``scoring="softmax", renormalize=True``.
        * DeepSeek-V2-Lite: ``scoring="softmax", renormalize=False`` (scaling 1.0). DeepSeek-V2:
          additionally ``num_expert_groups=8, topk_groups=3, routed_scaling_factor=16.0``.
        * DeepSeek-V3/R1: ``scoring="sigmoid", renormalize=True, num_expert_groups=8, topk_groups=4,
          routed_scaling_factor=2.5, correction_bias=e_score_correction_bias``.
        * gpt-oss: ``scoring="softmax_topk"`` (the router's linear bias belongs in the logits).

    Raises:
        TypeError / ValueError naming the offending argument; only shapes, dtypes and devices are checked,
        so validation never synchronizes with the device.
    """
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
    E = router_logits.shape[1]
    needs_graph = router_logits.requires_grad and torch.is_grad_enabled()  # the fused kernel has no backward
    if router_logits.is_cuda and not needs_graph and fused_routing_applies(E, top_k, num_expert_groups, topk_groups):
        from .ops.routing import route_fused

        return route_fused(
            router_logits,
            top_k,
            scoring=scoring,
            renormalize=renormalize,
            num_expert_groups=num_expert_groups,
            topk_groups=topk_groups,
            correction_bias=correction_bias,
            routed_scaling_factor=routed_scaling_factor,
        )
    fills_from_dropped = _fills_from_dropped(E, top_k, num_expert_groups, topk_groups)
    logits = torch.nan_to_num(router_logits.float(), nan=_NEG_INF, posinf=_FLOAT_MAX, neginf=_NEG_INF)
    M = logits.shape[0]
    dead = logits.amax(dim=-1, keepdim=True) == _NEG_INF  # rows with nothing to choose (see module docs)
    logits = logits.masked_fill(dead, 0.0)  # any finite row: ranks tie, the weights are replaced below

    if scoring == "softmax_topk":
        top_logits, topk_ids = torch.topk(logits, top_k, dim=-1)
        topk_weights = torch.softmax(top_logits, dim=-1)
    else:
        scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        noaux = scoring == "sigmoid" or correction_bias is not None
        if num_expert_groups is not None and topk_groups < num_expert_groups:
            group_size = E // num_expert_groups
            grouped = choice.view(M, num_expert_groups, group_size)
            if noaux:  # noaux_tc
                group_rank = grouped.topk(min(2, group_size), dim=-1).values.sum(dim=-1)
            else:  # group_limited_greedy
                group_rank = grouped.amax(dim=-1)
            group_idx = torch.topk(group_rank, topk_groups, dim=-1, sorted=False).indices
            dropped = torch.ones(M, num_expert_groups, dtype=torch.bool, device=logits.device)
            dropped.scatter_(1, group_idx, False)
            fill = 0.0 if fills_from_dropped and not noaux else _NEG_INF
            choice = grouped.masked_fill(dropped.unsqueeze(-1), fill).view(M, E)
        if fills_from_dropped:
            topk_weights, topk_ids = _fill_from_dropped(scores, choice, top_k, weights_from_choice=not noaux)
        elif choice is scores:
            topk_weights, topk_ids = torch.topk(scores, top_k, dim=-1)
        else:
            topk_ids = torch.topk(choice, top_k, dim=-1).indices
            topk_weights = scores.gather(1, topk_ids)
        if renormalize:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + _RENORM_EPS)

    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    topk_weights = topk_weights.masked_fill(dead, 0.0)
    topk_ids = torch.where(dead, torch.arange(top_k, device=logits.device), topk_ids)
    return topk_weights.contiguous(), topk_ids.to(torch.int32).contiguous()
