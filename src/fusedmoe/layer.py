"""FusedMoE: an nn.Module owning expert weights, the router and routing settings, run by a MoEKernel."""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from .api import get_kernel, resolve, resolve_backend
from .checks import check_activation, forbid_gradients, positive_int
from .experts.base import ExpertsInputs
from .ops import launcher
from .ops.launcher import UNSEEN, Replays
from .problem import MoEProblem, Routing
from .quant import QuantConfig, quantize_weights, quantized_layout
from .reference import activation_reference
from .route_stage import gate_in_launch
from .routing import fused_routing_applies, route
from .signature import input_signature
from .workspace.manager import WorkspaceManager, current_stream, default_manager
from .workspace.plan import WorkspacePlan

_LAYER_IDS = itertools.count()


class FusedMoE(nn.Module):
    """A Mixture-of-Experts block: router, routed experts and optional shared experts.

    Parameters (``dtype``/``device`` as given):
        w1: [E, 2I, H] gate rows then up rows. w2: [E, H, I]. gate: [E, H] router weight.
        e_score_correction_bias: [E] buffer, only with ``correction_bias=True`` (DeepSeek-V3 style).
        shared_w1: [2 * S * Is, H], shared_w2: [H, S * Is] for ``num_shared_experts`` S of size Is
        (``shared_intermediate_size``, default ``intermediate_size``), run as one dense gated MLP; with
        ``shared_expert_gate=True`` its output is scaled by sigmoid(x @ shared_gate.T) (Qwen2-MoE).

    ``forward(hidden_states [..., H], router_logits=None)`` routes (computing logits with ``gate`` when none
    are given), runs the experts through ``fused_moe``'s kernel and adds the shared experts.
    ``workspace`` is the WorkspaceManager to draw scratch from (default: the device's shared manager); all
    layers of a model should share one. ``quant`` (a mode of :mod:`fusedmoe.quant`: "fp8_tensor",
    "fp8_token", "fp8_block" or "mxfp4") stores the experts quantized: ``w1`` / ``w2`` in the mode's dtype and
    layout plus ``w1_scale`` / ``w2_scale`` (:func:`fusedmoe.quant.quantized_layout`); activations, router and shared
    experts stay in ``dtype``. A standard-layout MXFP4 layer holds its experts re-laid for the tensor cores
    (``quant`` becomes "mxfp4_mma", :mod:`fusedmoe.mxfp4_layout`): :meth:`load_weights` and ``load_state_dict`` take
    the checkpoint's layout and re-lay it once, keeping no other copy (weights whose scales exceed 2^1, which that
    layout cannot hold, keep the checkpoint layout). Quantized layers run both layouts, with or without
    ``ep_group`` (the batched layout needs the Triton backend); under ``ep_group`` the dynamic per-tensor activation
    scale of "fp8_tensor" is each rank's, over the rows it receives, so its output differs from a single-process
    layer's within fp8 rounding (per-token and block scales are per row: the same as a single process).
    ``recompute`` (training): recompute the experts' GEMM1 output in the backward instead of keeping it from
    the forward (less memory, a slower backward; docs/training.md).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        scoring: str = "softmax",
        renormalize: bool = True,
        num_expert_groups: int | None = None,
        topk_groups: int | None = None,
        correction_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        activation: str = "silu",
        apply_router_weight_on_input: bool = False,
        num_shared_experts: int = 0,
        shared_intermediate_size: int | None = None,
        shared_expert_gate: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        workspace: WorkspaceManager | None = None,
        backend: str = "auto",
        expert_bias: bool = False,
        router_bias: bool = False,
        ep_group=None,
        layout: str = "standard",
        max_tokens_per_rank: int | None = None,
        max_tokens_per_expert: int | None = None,
        recompute: bool = False,
        quant=None,
    ):
        super().__init__()
        E = positive_int("num_experts", num_experts)
        k = positive_int("top_k", top_k)
        if k > E:
            raise ValueError(f"top_k must be <= num_experts={E}, got {k}")
        H = positive_int("hidden_size", hidden_size)
        I = positive_int("intermediate_size", intermediate_size)
        if isinstance(num_shared_experts, bool) or not isinstance(num_shared_experts, int) or num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be an int >= 0, got {num_shared_experts!r}")
        check_activation(activation)
        if workspace is not None and not isinstance(workspace, WorkspaceManager):
            raise TypeError(f"workspace must be a WorkspaceManager or None, got {type(workspace).__name__}")
        self.num_experts, self.top_k, self.hidden_size, self.intermediate_size = E, k, H, I
        self.routing = dict(
            scoring=scoring,
            renormalize=renormalize,
            num_expert_groups=num_expert_groups,
            topk_groups=topk_groups,
            routed_scaling_factor=routed_scaling_factor,
        )
        # Validate routing settings once, on an empty batch (no data, no sync).
        route(torch.empty(0, E), k, correction_bias=torch.zeros(E) if correction_bias else None, **self.routing)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype (weights are float), got {dtype!r}")
        if shared_intermediate_size is not None:
            positive_int("shared_intermediate_size", shared_intermediate_size)
        self.activation = activation
        self.apply_router_weight_on_input = bool(apply_router_weight_on_input)
        self.recompute = bool(recompute)
        self.backend = backend
        self.workspace = workspace
        self.owner_key = f"FusedMoE#{next(_LAYER_IDS)}"  # per_layer arena key (no reference to self)
        self._verdicts: dict[tuple, tuple] = {}  # see forward
        factory = {"dtype": dtype, "device": device}
        # Expert parallelism (ep_group) / batched layout: see fusedmoe.distributed.LayerParallel. Rank r of W
        # keeps experts [r*E/W, (r+1)*E/W); expert_map: global id -> local id, -1 elsewhere (None without EP).
        self._parallel = None
        if ep_group is not None or layout != "standard" or max_tokens_per_expert is not None:
            from .distributed import LayerParallel

            self._parallel = LayerParallel(E, ep_group, layout, max_tokens_per_rank, max_tokens_per_expert)
            if self._parallel.world > 1 and expert_bias:
                raise ValueError("expert biases are not supported with ep_group yet")
        self.num_local_experts = self._parallel.local_experts if self._parallel is not None else E
        emap = self._parallel.expert_map(device) if self._parallel is not None else None
        self.register_buffer("expert_map", emap, persistent=False)
        El = self.num_local_experts
        self.quant = QuantConfig.parse(quant)
        if self.quant is not None and self.quant.mode == "mxfp4" and layout == "standard":
            self.quant = QuantConfig("mxfp4", layout="mma")  # the batched kernels read the checkpoint layout
        if self.quant is None:
            self.w1 = nn.Parameter(torch.empty(El, 2 * I, H, **factory), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(El, H, I, **factory), requires_grad=False)
            self.register_parameter("w1_scale", None)
            self.register_parameter("w2_scale", None)
        else:  # the experts as the checkpoint stores them (fusedmoe.quant.quantized_layout)
            for name, (shape, wdtype) in quantized_layout(self.quant, El, H, I).items():
                t = torch.empty(shape, dtype=wdtype, device=device)
                self.register_parameter(name, nn.Parameter(t, requires_grad=False))
        self.gate = nn.Parameter(torch.empty(E, H, **factory), requires_grad=False)
        # Optional biases (gpt-oss): router logits = x @ gate.T + gate_bias; w1_bias [E, 2I], w2_bias [E, H].
        for name, shape, on in (
            ("gate_bias", (E,), router_bias),
            ("w1_bias", (E, 2 * I), expert_bias),
            ("w2_bias", (E, H), expert_bias),
        ):
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, **factory), False) if on else None)
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32, device=device))
        else:
            self.e_score_correction_bias = None
        self.num_shared_experts = num_shared_experts
        self.shared_intermediate_size = shared_intermediate_size or I
        if num_shared_experts:
            Is = num_shared_experts * self.shared_intermediate_size
            self.shared_w1 = nn.Parameter(torch.empty(2 * Is, H, **factory), requires_grad=False)
            self.shared_w2 = nn.Parameter(torch.empty(H, Is, **factory), requires_grad=False)
            self.shared_gate = (
                nn.Parameter(torch.empty(1, H, **factory), requires_grad=False) if shared_expert_gate else None
            )
        self.reset_parameters()

    def __getstate__(self) -> dict:
        # Cached verdicts hold kernels, managers and closures: a copy or a pickle starts without them.
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__)
        state["_verdicts"] = {}
        return state

    def reset_parameters(self) -> None:
        """Random weights scaled so activations keep unit order of magnitude (for tests and benchmarks)."""
        H, I = self.hidden_size, self.intermediate_size
        with torch.no_grad():
            if self.quant is None:
                for p, fan_in in ((self.w1, H), (self.w2, I)):
                    p.normal_(0.0, 1.0 / math.sqrt(fan_in))
            elif self.gate.device.type != "meta":  # random float weights, quantized one expert at a time
                dev = self.gate.device
                for e in range(self.num_local_experts):
                    w1 = torch.randn(1, 2 * I, H, device=dev) / math.sqrt(H)
                    w2 = torch.randn(1, H, I, device=dev) / math.sqrt(I)
                    quantized = quantize_weights(w1, w2, self.quant)
                    for dst, src in zip((self.w1, self.w2, self.w1_scale, self.w2_scale), quantized):
                        dst[e : e + 1].copy_(src)
            self.gate.normal_(0.0, 1.0 / math.sqrt(H))
            if self.num_shared_experts:
                self.shared_w1.normal_(0.0, 1.0 / math.sqrt(H))
                self.shared_w2.normal_(0.0, 1.0 / math.sqrt(self.shared_w2.shape[1]))
                if self.shared_gate is not None:
                    self.shared_gate.normal_(0.0, 1.0 / math.sqrt(H))

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, activation={self.activation}, "
            f"shared={self.num_shared_experts}, scoring={self.routing['scoring']}"
            + (f", quant={self.quant.name}" if self.quant is not None else "")
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype: the weights' (the router's, for quantized weights)."""
        return self.w1.dtype if self.quant is None else self.gate.dtype

    # ---- workspace ---------------------------------------------------------------------------------------
    @property
    def manager(self) -> WorkspaceManager:
        return self.workspace if self.workspace is not None else default_manager(self.w1.device)

    def problem(self, num_tokens: int, dtype: torch.dtype | None = None) -> MoEProblem:
        E = self.num_experts
        return MoEProblem(
            M=num_tokens,
            H=self.hidden_size,
            I=self.intermediate_size,
            E=self.num_local_experts,
            global_E=E,
            has_expert_map=self.expert_map is not None,
            top_k=self.top_k,
            dtype=dtype or self.compute_dtype,
            weight_dtype=self.w1.dtype,
            quant=self.quant,
            activation=self.activation,
            apply_router_weight_on_input=self.apply_router_weight_on_input,
            has_bias=self.w1_bias is not None or self.w2_bias is not None,
            routing=None
            if self._parallel is not None
            else Routing(**self.routing, has_correction_bias=self.e_score_correction_bias is not None),
        )

    def plan(self, num_tokens: int, dtype: torch.dtype | None = None) -> WorkspacePlan:
        """The workspace plan of one forward over ``num_tokens`` tokens."""
        if self._parallel is not None:
            return self._parallel.plan(self, num_tokens, dtype)
        backend = resolve_backend(self.backend, self.w1.device)
        return get_kernel(backend).plan(self.problem(num_tokens, dtype))

    def reserve_workspace(self, max_tokens: int) -> int:
        """Size this layer's arena (its own with ``per_layer``, the shared one otherwise) for ``max_tokens``."""
        return self.manager.reserve(self.plan(max_tokens), owner=self.owner_key)

    # ---- forward -----------------------------------------------------------------------------------------
    def route(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None):
        """-> (topk_weights float32 [M, k], topk_ids int32 [M, k]) for flattened hidden_states [M, H]."""
        if router_logits is None:
            router_logits = F.linear(hidden_states, self.gate, self.gate_bias)
        return route(
            router_logits.reshape(-1, self.num_experts),
            self.top_k,
            correction_bias=self.e_score_correction_bias,
            **self.routing,
        )

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            verdict = self._verdict(hidden_states, router_logits)
            if verdict is not None:
                return self._run_validated(verdict, hidden_states, router_logits)
        return self._forward_checked(hidden_states, router_logits)

    # The eager hot path. A forward's validation verdict (problem, kernel, manager, router) depends only on the
    # input signature of its tensors and the layer's settings, so it is computed once per signature
    # (:meth:`_forward_checked`) and reused; the kernel then replays its recorded launches.
    def _key(self, hidden_states, router_logits):
        P, B = self._parameters, self._buffers
        sig = input_signature(
            hidden_states,
            router_logits,
            P["w1"],
            P["w2"],
            P["gate"],
            P["gate_bias"],
            P["w1_bias"],
            P["w2_bias"],
            P.get("w1_scale"),
            P.get("w2_scale"),
            B.get("e_score_correction_bias"),
            B.get("expert_map"),
        )
        if sig is None:
            return None, None
        return (
            sig,
            self.activation,
            self.apply_router_weight_on_input,
            self.backend,
            self.workspace,
            *self.routing.values(),
        ), sig

    def _verdict(self, hidden_states, router_logits):
        key, _ = self._key(hidden_states, router_logits)
        if key is None:
            return None
        try:
            return self._verdicts.get(key)
        except TypeError:  # unhashable settings: the checked path reports them
            return None

    def _run_validated(self, verdict, hidden_states, router_logits) -> torch.Tensor:
        p, kernel, manager, router, gate_in_kernel, layout = verdict
        P = self._parameters
        if torch.is_grad_enabled() and self._wants_grad(hidden_states, router_logits):
            return self._forward_train(hidden_states, router_logits)
        x = hidden_states.reshape(p.M, p.H)
        if gate_in_kernel:  # the kernel's routing step computes the logits too
            inputs = self._inputs(x, gate=True)
        else:
            if router_logits is None:
                router_logits = F.linear(x, P["gate"], P["gate_bias"])
            logits = router_logits.reshape(p.M, self.num_experts)
            if router is None:  # the kernel routes (a problem with routing)
                inputs = self._inputs(x, logits=logits)
            else:
                inputs = self._inputs(x, *router(logits, self._buffers.get("e_score_correction_bias")))
        out = kernel(inputs, p, manager=manager, owner=self.owner_key, layout_key=layout)
        if self.num_shared_experts:
            out = out + self.shared_experts(x)
        return out.view(hidden_states.shape)

    def _router(self, example: torch.Tensor):
        """A function ``(logits [M, E], correction bias) -> (topk_weights, topk_ids)`` for calls whose logits look
        like ``example``:
        on CUDA, when the fused routing kernel serves these settings, its launch recorded once and replayed
        (see :mod:`fusedmoe.ops.launcher`); :meth:`route`'s :func:`~fusedmoe.routing.route` otherwise."""
        E, k, R = self.num_experts, self.top_k, self.routing
        if not (example.is_cuda and fused_routing_applies(E, k, R["num_expert_groups"], R["topk_groups"])):
            return lambda logits, bias: self.route(logits, router_logits=logits)
        from .ops.routing import route_fused

        replays = Replays(limit=64)

        def router(logits: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            M = logits.shape[0]
            both = torch.empty(2 * M * k, dtype=torch.int32, device=logits.device)  # one allocation, two views
            ids = both[: M * k].view(M, k)
            weights = both[M * k :].view(torch.float32).view(M, k)
            key = input_signature(logits, bias)
            roots = (logits, bias, weights, ids)
            trace = replays.get(key) if launcher.ENABLED else None
            if trace is UNSEEN:
                replays.record(
                    key,
                    lambda: route_fused(logits, k, correction_bias=bias, weights=weights, ids=ids, **R),
                    roots,
                    None,
                )
            elif trace is None or not trace.ready():
                route_fused(logits, k, correction_bias=bias, weights=weights, ids=ids, **R)
            else:
                trace(roots, None, current_stream(logits.device.index))
            return weights, ids

        return router

    def _wants_grad(self, x, router_logits) -> bool:
        """Whether autograd needs this forward's graph: an input or a parameter requires grad. On the hot path
        (grad mode on): the layer's own parameter dict is read directly unless a subclass added submodules."""
        if x.requires_grad or (router_logits is not None and router_logits.requires_grad):
            return True
        params = self.parameters() if self._modules else self._parameters.values()
        return any(t is not None and t.requires_grad for t in params)

    def _routed_experts(self, run, x: torch.Tensor, router_logits: torch.Tensor | None, **extra) -> torch.Tensor:
        """``run`` (:func:`fusedmoe.fused_moe` or the registered op) on ``x`` [M, H] routed by :meth:`route`, with
        this layer's weights and settings (and ``extra`` keywords)."""
        topk_weights, topk_ids = self.route(x, router_logits)
        return run(
            x,
            self.w1,
            self.w2,
            topk_weights,
            topk_ids,
            activation=self.activation,
            apply_router_weight_on_input=self.apply_router_weight_on_input,
            workspace=self.workspace,
            backend=self.backend,
            w1_bias=self.w1_bias,
            w2_bias=self.w2_bias,
            **(
                {}
                if self.quant is None
                else {"quant": self.quant, "w1_scale": self.w1_scale, "w2_scale": self.w2_scale}
            ),
            **extra,
        )

    def _forward_train(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None) -> torch.Tensor:
        """The forward with autograd: routing in differentiable torch ops (:meth:`route`), the experts through
        :func:`fusedmoe.fused_moe` (its backward: :mod:`fusedmoe.training`), the shared experts as modules.

        Gradients reach the inputs, ``w1``, ``w2``, the biases, ``gate`` / ``gate_bias`` (through the routing
        weights) and the shared experts. An expert-parallel layer exchanges the tokens in a differentiable
        all-to-all (:func:`~fusedmoe.training.expert_parallel.expert_parallel_moe`: every rank runs the forward
        and the backward); a batched-layout layer trains through the standard layout."""
        x = hidden_states.reshape(-1, self.hidden_size)
        if self._parallel is not None and self._parallel.world > 1:
            out = self._expert_parallel_train(x, router_logits)
        else:
            from .api import fused_moe

            emap = self._buffers.get("expert_map")
            out = self._routed_experts(
                fused_moe,
                x,
                router_logits,
                expert_map=emap,
                global_num_experts=self.num_experts if emap is not None else None,
                recompute=self.recompute,
            )
        if self.num_shared_experts:
            out = out + self.shared_experts(x)
        return out.view(hidden_states.shape)

    def _expert_parallel_train(self, x: torch.Tensor, router_logits: torch.Tensor | None) -> torch.Tensor:
        """The routed experts of ``x`` [M, H] over the expert-parallel ranks, with autograd."""
        from .training.expert_parallel import expert_parallel_moe

        if self.quant is not None:
            forbid_gradients(
                "FusedMoE",
                "quantized experts have no backward",
                hidden_states=x,
                router_logits=router_logits,
                **dict(self.named_parameters()),
            )
        topk_weights, topk_ids = self.route(x, router_logits)
        return expert_parallel_moe(
            x,
            self.w1,
            self.w2,
            topk_weights,
            topk_ids,
            self._parallel.transport,
            self.num_experts,
            activation=self.activation,
            apply_router_weight_on_input=self.apply_router_weight_on_input,
            workspace=self.workspace,
            backend=self.backend,
            recompute=self.recompute,
        )

    def _forward_checked(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must end in hidden_size={self.hidden_size}, got shape {list(hidden_states.shape)}"
            )
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        if router_logits is not None and not isinstance(router_logits, torch.Tensor):
            raise TypeError(f"router_logits must be a torch.Tensor or None, got {type(router_logits).__name__}")
        if router_logits is not None and not router_logits.is_floating_point():
            raise TypeError(f"router_logits must have a floating dtype, got {router_logits.dtype}")
        if router_logits is not None and router_logits.device != x.device:
            raise ValueError(f"router_logits is on {router_logits.device} but hidden_states is on {x.device}")
        if router_logits is not None and router_logits.shape[-1] != self.num_experts:
            raise ValueError(
                f"router_logits must end in num_experts={self.num_experts}, got {list(router_logits.shape)}"
            )
        if router_logits is not None and router_logits.numel() // self.num_experts != x.shape[0]:
            raise ValueError(
                f"router_logits must hold one row per token ({x.shape[0]}), got {list(router_logits.shape)}"
            )
        if x.dtype != self.compute_dtype:
            what = "weights" if self.quant is None else "router and activations (quantized experts)"
            raise TypeError(f"hidden_states dtype {x.dtype} does not match the layer's {what} ({self.compute_dtype})")
        if x.device != self.w1.device:
            raise ValueError(f"hidden_states is on {x.device} but the layer's weights are on {self.w1.device}")
        if torch.is_grad_enabled() and self._wants_grad(x, router_logits):
            if not torch.compiler.is_compiling():
                return self._forward_train(hidden_states, router_logits)
            if self._parallel is not None:  # compiled local layers train through the differentiable op below
                from .training.outside_graph import forward_train_outside_graph  # imports torch._dynamo

                return forward_train_outside_graph(self, hidden_states, router_logits)
        if torch.compiler.is_compiling() and self._parallel is None:
            # the opaque registered op (fusedmoe.op): the compiler sees one node; eager calls run directly
            from .op import fused_moe_op

            out = self._routed_experts(fused_moe_op, x, router_logits, owner=self.owner_key)
        else:
            p = self.problem(x.shape[0], x.dtype)
            kernel, manager = self._resolve(p, x.device)
            key, sig = self._key(hidden_states, router_logits)
            # the kernel's routing launch computes the logits too (one F.linear and its launch fewer per call)
            gate_in_kernel = p.routing is not None and router_logits is None and gate_in_launch(x, self.gate, p.routing)
            if gate_in_kernel:  # the kernel routes and computes the logits in the same step
                inputs, router = self._inputs(x, gate=True), None
            elif p.routing is not None:  # the kernel routes: its first step turns the logits into the top-k
                logits = router_logits if router_logits is not None else F.linear(x, self.gate, self.gate_bias)
                inputs, router = self._inputs(x, logits=logits.reshape(p.M, self.num_experts)), None
            else:
                topk_weights, topk_ids = self.route(x, router_logits)
                inputs = self._inputs(x, topk_weights, topk_ids)
                router = self._router(router_logits if router_logits is not None else x)
            # the kernel's recorded launches depend on which inputs it gets (the logits, or the router's weight):
            # one layout per choice, so a changed ROUTER_GEMM_MAX_M never replays the other choice's trace
            layout = None if sig is None else (sig, gate_in_kernel)
            out = kernel(inputs, p, manager=manager, owner=self.owner_key, layout_key=layout)
            if key is not None and (self._parallel is None or self._parallel.static):
                if len(self._verdicts) > 1024:  # bounded under shape churn
                    self._verdicts.clear()
                self._verdicts[key] = (p, kernel, manager, router, gate_in_kernel, layout)
        if self.num_shared_experts:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def _resolve(self, p: MoEProblem, device: torch.device):
        """(kernel, workspace manager) of a validated problem: the backend's standard kernel, or the expert-parallel /
        batched kernel of :class:`~fusedmoe.distributed.LayerParallel` (whose token bound may need a collective)."""
        if self._parallel is None:
            return resolve(p, device, self.backend, self.workspace)
        return self._parallel.kernel_for(self, p, device), self.manager

    def _inputs(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor | None = None,
        topk_ids: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
        gate: bool = False,
    ) -> ExpertsInputs:
        """The kernel's inputs: routed (``topk_*``) or, for a problem with ``routing``, the router logits (or with
        ``gate``, the router's weight and bias, from which the kernel's routing step computes them)."""
        P, B = self._parameters, self._buffers
        routes = logits is not None or gate
        return ExpertsInputs(
            x,
            P["w1"],
            P["w2"],
            topk_weights,
            topk_ids,
            expert_map=B.get("expert_map"),
            w1_scale=P.get("w1_scale"),
            w2_scale=P.get("w2_scale"),
            w1_bias=P["w1_bias"],
            w2_bias=P["w2_bias"],
            router_logits=logits,
            correction_bias=B.get("e_score_correction_bias") if routes else None,
            router_weight=P["gate"] if gate else None,
            router_bias=P["gate_bias"] if gate else None,
        )

    @classmethod
    def from_hf_experts(cls, module: nn.Module, **kwargs) -> FusedMoE:
        """A FusedMoE from a transformers MoE block or experts module
        (see :func:`fusedmoe.integrations.loading.from_hf`)."""
        from .integrations.convert import build_from_hf  # lazily: the core imports no integration (test_layout)

        return build_from_hf(cls, module, **kwargs)

    @classmethod
    def from_hf_state_dict(cls, state_dict, config, **kwargs) -> FusedMoE:
        """A FusedMoE from one MoE block's transformers state dict (fused or per-expert layout; see
        :func:`fusedmoe.integrations.loading.from_hf_state_dict`)."""
        from .integrations.convert import build_from_hf_state_dict  # as above

        return build_from_hf_state_dict(cls, state_dict, config, **kwargs)

    def load_weights(
        self,
        w1: torch.Tensor,
        w2: torch.Tensor,
        gate: torch.Tensor | None = None,
        w1_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
    ) -> None:
        """Copy full, all-expert weights (as a checkpoint holds them: w1 [E, 2I, H], w2 [E, H, I], gate [E, H])
        into this layer, keeping only this rank's experts under expert parallelism (the router gate is global).
        A quantized layer takes its quantized weights and their scales in the layouts of :mod:`fusedmoe.quant`
        (``w1_scale`` / ``w2_scale`` beside them; MXFP4 in the checkpoint's layout or the mma layout, re-laid once
        into the layer's own)."""
        E, El, H, I = self.num_experts, self.num_local_experts, self.hidden_size, self.intermediate_size
        lo = self._parallel.rank * El if self._parallel is not None else 0
        given = {"w1": w1, "w2": w2}
        if self.quant is not None:
            given.update(w1_scale=w1_scale, w2_scale=w2_scale)
        elif w1_scale is not None or w2_scale is not None:
            raise ValueError("w1_scale / w2_scale were given but this layer is not quantized (quant=None)")
        # what the caller passes: the parameters' layout; MXFP4 in the checkpoint's layout or in the mma layout
        passed = self.quant
        if passed is not None and passed.mode == "mxfp4":
            mma = QuantConfig("mxfp4", layout="mma")
            passed = (
                mma if w1 is not None and w1.shape == quantized_layout(mma, E, H, I)["w1"][0] else QuantConfig("mxfp4")
            )
        expected = quantized_layout(passed, E, H, I) if passed is not None else {}
        for name, full in given.items():
            if full is None:
                raise ValueError(f"{name} is required for quant={passed.name!r}")
            shape, dtype = expected.get(name, ((E, *getattr(self, name).shape[1:]), getattr(self, name).dtype))
            if tuple(full.shape) != shape or full.dtype != dtype:
                raise ValueError(f"{name} must be {dtype} of shape {list(shape)}, got {full.dtype} {list(full.shape)}")
        local = self._relaid_mxfp4({name: full[lo : lo + El] for name, full in given.items()})
        with torch.no_grad():
            for name, t in local.items():
                getattr(self, name).copy_(t)
            if gate is not None:
                if tuple(gate.shape) != tuple(self.gate.shape):
                    raise ValueError(f"gate must have shape {list(self.gate.shape)}, got {list(gate.shape)}")
                self.gate.copy_(gate)

    def _relaid_mxfp4(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` (``w1``, ``w2``, ``w1_scale``, ``w2_scale``) in this layer's MXFP4 layout: checkpoint-layout
        weights re-laid into an mma-layout layer's, mma-layout ones back into a checkpoint-layout layer's (the
        batched layout's), as given when they already match. Weights the mma layout cannot hold (a scale byte above
        128) switch the layer to the checkpoint layout, where they are returned as given."""
        if self.quant is None or self.quant.mode != "mxfp4" or tensors["w1"].shape[1:] == self.w1.shape[1:]:
            return tensors
        from .mxfp4_layout import from_mma_layout, holds_scales, to_mma_layout

        if self.quant.layout != "mma":
            w1, s1 = from_mma_layout(tensors["w1"], tensors["w1_scale"], self.hidden_size, gated=True)
            w2, s2 = from_mma_layout(tensors["w2"], tensors["w2_scale"], self.intermediate_size, gated=False)
            return {"w1": w1, "w2": w2, "w1_scale": s1, "w2_scale": s2}
        if not (holds_scales(tensors["w1_scale"]) and holds_scales(tensors["w2_scale"])):
            self._keep_checkpoint_layout()
            return tensors
        w1, s1 = to_mma_layout(tensors["w1"], tensors["w1_scale"], gated=True)
        w2, s2 = to_mma_layout(tensors["w2"], tensors["w2_scale"], gated=False)
        return {"w1": w1, "w2": w2, "w1_scale": s1, "w2_scale": s2}

    def _keep_checkpoint_layout(self) -> None:
        """Hold MXFP4 experts in the checkpoint layout from now on (empty parameters of its shapes)."""
        self.quant = QuantConfig("mxfp4")
        self._verdicts.clear()
        El, H, I = self.num_local_experts, self.hidden_size, self.intermediate_size
        for name, (shape, wdtype) in quantized_layout(self.quant, El, H, I).items():
            t = torch.empty(shape, dtype=wdtype, device=self.w1.device)
            setattr(self, name, nn.Parameter(t, requires_grad=False))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # MXFP4 experts in the other layout (a converted checkpoint, or a layer of the other layout) are re-laid
        names = [prefix + n for n in ("w1", "w2", "w1_scale", "w2_scale")]
        if self.quant is not None and self.quant.mode == "mxfp4" and all(n in state_dict for n in names):
            relaid = self._relaid_mxfp4({n[len(prefix) :]: state_dict[n] for n in names})
            state_dict.update({prefix + k: v for k, v in relaid.items()})
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def shared_experts(self, x: torch.Tensor) -> torch.Tensor:
        """The dense gated MLP of the shared experts, [M, H] -> [M, H]."""
        h = activation_reference(F.linear(x, self.shared_w1), self.activation)
        y = F.linear(h, self.shared_w2)
        if self.shared_gate is not None:
            y = torch.sigmoid(F.linear(x, self.shared_gate)) * y
        return y
