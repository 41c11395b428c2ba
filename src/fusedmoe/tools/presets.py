"""MoE layer shapes of public models (from their Hugging Face configs), used by bench, tune and the GPU tests."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..layer import FusedMoE
from ..problem import Routing


@dataclass(frozen=True)
class Preset:
    """One model's MoE layer.

    Attributes:
        num_experts: routed experts of the model (routing ranges over them). top_k: experts per token.
        hidden_size (H), intermediate_size (I, per routed expert), num_layers: MoE layers of the model.
        num_shared_experts, shared_intermediate_size: always-on experts (I of each).
        scoring, renormalize, num_expert_groups, topk_groups, routed_scaling_factor: router settings, as
            :func:`fusedmoe.routing.route` takes them (``routing`` gives the kwargs).
        local_experts: experts held on one GPU when a single GPU holds an expert-parallel slice (else None).
        activation: our activation closest to the model's ("silu" for SwiGLU).
    """

    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    scoring: str = "softmax"
    renormalize: bool = True
    num_expert_groups: int | None = None
    topk_groups: int | None = None
    routed_scaling_factor: float = 1.0
    local_experts: int | None = None
    activation: str = "silu"
    note: str = ""

    @property
    def routing(self) -> dict[str, object]:
        """Keyword arguments of :func:`fusedmoe.routing.route` for this model: its router settings, which carry
        the names of :class:`fusedmoe.problem.Routing`'s fields (that class says which of them route takes)."""
        return Routing(**{f.name: getattr(self, f.name) for f in fields(Routing) if hasattr(self, f.name)}).kwargs()

    @property
    def experts_on_gpu(self) -> int:
        return self.local_experts or self.num_experts

    def routed_layer(self, **kwargs) -> FusedMoE:
        """A randomly initialised FusedMoE of this model's routed experts (no shared experts) with its router
        settings; ``kwargs`` go to :class:`fusedmoe.FusedMoE` (dtype, device, backend, workspace, layout, ...)."""
        return FusedMoE(
            self.num_experts, self.top_k, self.hidden_size, self.intermediate_size, **self.routing, **kwargs
        )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("qwen3-30b-a3b", 128, 8, 2048, 768, 48),
        Preset("qwen3-235b-a22b", 128, 8, 4096, 1536, 94),
        Preset(
            "deepseek-v2-lite",
            64,
            6,
            2048,
            1408,
            26,
            num_shared_experts=2,
            shared_intermediate_size=1408,
            renormalize=False,
        ),
        Preset(
            "deepseek-v3",
            256,
            8,
            7168,
            2048,
            58,
            num_shared_experts=1,
            shared_intermediate_size=2048,
            scoring="sigmoid",
            num_expert_groups=8,
            topk_groups=4,
            routed_scaling_factor=2.5,
            local_experts=32,
            note="one GPU holds an expert-parallel slice of 32 of the 256 experts",
        ),
        Preset(
            "deepseek-v3-routed",
            256,
            8,
            7168,
            2048,
            58,
            scoring="sigmoid",
            num_expert_groups=8,
            topk_groups=4,
            routed_scaling_factor=2.5,
            note="all 256 routed experts on one GPU (its fp8 weights take 11.3 GB); no shared expert",
        ),
        Preset("mixtral-8x7b", 8, 2, 4096, 14336, 32),
        Preset(
            "gpt-oss-20b",
            32,
            4,
            2880,
            2880,
            24,
            scoring="softmax_topk",
            note="gpt-oss uses a clamped SwiGLU with biases; shapes only",
        ),
        Preset(
            "gpt-oss-120b",
            128,
            4,
            2880,
            2880,
            36,
            scoring="softmax_topk",
            note="gpt-oss uses a clamped SwiGLU with biases; shapes only",
        ),
    )
}

#: Presets whose tuned-config files we ship (one GPU holds all their experts).
CONFIG_PRESETS = (
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "deepseek-v2-lite",
    "deepseek-v3-routed",
    "mixtral-8x7b",
    "gpt-oss-20b",
)


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None


__all__ = ["CONFIG_PRESETS", "PRESETS", "Preset", "get_preset"]
