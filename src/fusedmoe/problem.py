"""The static description of one MoE call, from which plans and kernel configs are derived."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import Enum

import torch

from .quant import QuantConfig

ACTIVATIONS = ("silu", "gelu", "swigluoai", "gelu_exact")

#: "swigluoai" (gpt-oss): ``(clamp(up, -L, L) + 1) * g * sigmoid(ALPHA * g)`` with ``g = min(gate, L)``.
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def hash_once(self) -> int:
    """``__hash__`` for frozen dataclasses used as per-call cache keys: the fields' hash, computed once per
    object (assign it in the class body; a frozen dataclass would otherwise rehash every field each lookup)."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(self, f.name) for f in fields(self)))
        object.__setattr__(self, "_hash", h)
    return h


def state_without_hash(self) -> dict:
    """``__getstate__`` pairing :func:`hash_once`: string hashes differ between processes, so none travels."""
    state = dict(self.__dict__)
    state.pop("_hash", None)
    return state


class Layout(Enum):
    """How tokens are laid out between prepare and the experts."""

    STANDARD = "standard"  # [M, H] rows plus topk_ids [M, k]
    BATCHED = "batched"  # [E_local, max_tokens_per_expert, H] plus expert_num_tokens [E_local]


@dataclass(frozen=True)
class Routing:
    """Router settings of a call that routes inside the kernel (:func:`fusedmoe.routing.route`'s keywords).

    The router logits ``[M, E]`` (and the correction bias ``[E]`` when ``has_correction_bias``) arrive as inputs;
    the program's first step writes ``topk_weights`` float32 / ``topk_ids`` int32 ``[M, top_k]`` into workspace
    buffers that the experts read (:mod:`fusedmoe.route_stage`).
    """

    scoring: str = "softmax"
    renormalize: bool = True
    num_expert_groups: int | None = None
    topk_groups: int | None = None
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False

    def kwargs(self) -> dict:
        """The keywords of :func:`fusedmoe.routing.route` (all but the correction bias)."""
        return {
            "scoring": self.scoring,
            "renormalize": self.renormalize,
            "num_expert_groups": self.num_expert_groups,
            "topk_groups": self.topk_groups,
            "routed_scaling_factor": self.routed_scaling_factor,
        }


@dataclass(frozen=True)
class MoEProblem:
    """Everything a plan or a kernel config may depend on; hashable, so plans are cached per problem.

    Attributes:
        M: tokens on this rank. H: hidden size. I: intermediate size per expert (w2.shape[2]).
        E: experts held locally (w1.shape[0]). global_E: experts of the whole model (ids range over it).
        top_k: experts per token. dtype: activation dtype (= hidden_states.dtype, = output dtype).
        weight_dtype: w1/w2 dtype (fp8 when quantized).
        activation: "silu" (SwiGLU), "gelu" (GeGLU, tanh approximation), "swigluoai" (gpt-oss's clamped
            SwiGLU, see SWIGLUOAI_ALPHA / SWIGLUOAI_LIMIT) or "gelu_exact" (GeGLU with the exact, erf GELU).
        apply_router_weight_on_input: scale the input rows instead of the expert outputs.
        has_expert_map: an expert_map translates global ids to local ones (-1 = not on this rank).
        quant: fp8 settings or None.
        max_tokens_per_expert: batched layout only: rows per expert in the batched buffers.
        has_bias: expert biases are given (w1_bias [E, 2I] added to GEMM1's output before the activation,
            w2_bias [E, H] added to GEMM2's output before the routing weight).
        routing: None when the caller routes (topk_weights / topk_ids are inputs); else the router settings
            of a call that routes inside the kernel from router logits.
    """

    M: int
    H: int
    I: int
    E: int
    global_E: int
    top_k: int
    dtype: torch.dtype
    weight_dtype: torch.dtype
    activation: str = "silu"
    apply_router_weight_on_input: bool = False
    has_expert_map: bool = False
    quant: QuantConfig | None = None
    max_tokens_per_expert: int = 0
    has_bias: bool = False
    routing: Routing | None = None

    __hash__ = hash_once  # the problem keys several caches on every call
    __getstate__ = state_without_hash

    @property
    def slots(self) -> int:
        """Number of (token, expert) pairs: M * top_k."""
        return self.M * self.top_k

    def with_tokens(self, M: int) -> MoEProblem:
        """The same problem with another token count (e.g. to reserve for the largest batch)."""
        return replace(self, M=M)
