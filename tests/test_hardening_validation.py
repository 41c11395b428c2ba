"""Hardening, part 1: the validation matrix.

Every row is one malformed input to ``route``, ``fused_moe``, ``FusedMoE`` (constructor, forward, reserve),
``WorkspaceManager`` or the caller-workspace path. Each must raise the listed exception type (and not the other
of TypeError / ValueError) with a message naming the argument, and must leave a warm, poisoned, shared manager
exactly as it was: calls, reserved bytes, growths, device allocations, peak bytes and the arena's address are
unchanged, and the same manager (and a layer drawing from it) then serves a call that matches the float64
reference. ``docs/errors.md`` is the human-readable twin of this table; rows complementing
tests/test_validation.py (which covers the basic shape/dtype/device cases of fused_moe) rather than repeating it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from fusedmoe import FusedMoE, QuantConfig, WorkspaceFrozenError, WorkspaceManager, fused_moe, get_kernel, route
from fusedmoe.checks import check_fused_moe_args
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.workspace.manager import WorkspaceError

M, H, I, E, K = 6, 48, 32, 8, 2
FP8 = torch.float8_e4m3fn
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


# ---- local helpers (not imported across test files) ----------------------------------------------------------
def good_args(m: int = M, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(m, H, generator=g),
        "w1": torch.randn(E, 2 * I, H, generator=g) / H**0.5,
        "w2": torch.randn(E, H, I, generator=g) / I**0.5,
        "topk_weights": torch.rand(m, K, generator=g) + 0.1,
        "topk_ids": torch.rand(m, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32),
    }


def fp8_args(quant: str) -> dict[str, object]:
    """Valid fp8 arguments for ``quant`` (weights quantized, scales of the right shapes)."""
    from fusedmoe.quant import quantize_weights

    a = good_args()
    q = QuantConfig.parse(quant)
    w1, w2, s1, s2 = quantize_weights(a["w1"], a["w2"], q)
    a.update(w1=w1, w2=w2, w1_scale=s1, w2_scale=s2, quant=q)
    if q.static_activation_scale:
        a.update(a1_scale=torch.tensor([0.01]), a2_scale=torch.tensor([0.01]))
    return a


def plan_nbytes(args: dict, backend: str = "torch", **kw) -> int:
    t = {k: args[k] for k in ("hidden_states", "w1", "w2", "topk_weights", "topk_ids")}
    opts = dict(
        activation="silu",
        apply_router_weight_on_input=False,
        expert_map=None,
        global_num_experts=None,
        quant=None,
        w1_scale=None,
        w2_scale=None,
        a1_scale=None,
        a2_scale=None,
    )
    opts.update(kw)
    p = check_fused_moe_args(*t.values(), **opts)
    return get_kernel(backend).plan(p).nbytes


def snapshot(mgr: WorkspaceManager) -> dict[str, object]:
    s = mgr.stats
    arenas = getattr(mgr, "_arenas", {})
    return {
        "calls": s.calls,
        "reserved_bytes": s.reserved_bytes,
        "growths": s.growths,
        "device_allocations": s.device_allocations,
        "peak_bytes": s.peak_bytes,
        "frozen": mgr.frozen,
        "arenas": {str(k): (a.data.data_ptr(), a.nbytes) for k, a in arenas.items()},
    }


def serves_correctly(mgr: WorkspaceManager, layer: FusedMoE, seed: int = 1) -> None:
    a = good_args(seed=seed)
    out = fused_moe(**a, backend="torch", workspace=mgr)
    assert relative_error(out, fused_moe_reference(*a.values())) < 1e-5
    x = a["hidden_states"]
    w, ids = layer.route(x)
    assert relative_error(layer(x), fused_moe_reference(x, layer.w1, layer.w2, w, ids)) < 1e-5


@dataclass
class Ctx:
    mgr: WorkspaceManager
    layer: FusedMoE
    args: dict


def fm(ctx: Ctx, **over) -> torch.Tensor:
    """fused_moe on the good arguments with ``over`` replacing / adding keywords (torch backend by default)."""
    kw = dict(ctx.args)
    kw.update(over)
    kw.setdefault("backend", "torch")
    kw.setdefault("workspace", ctx.mgr)
    return fused_moe(**kw)


def fm8(ctx: Ctx, mode: str, **over) -> torch.Tensor:
    """fused_moe on valid fp8 arguments of quant ``mode`` with ``over`` replacing keywords (Triton backend)."""
    kw = fp8_args(mode)
    kw.update(over)
    kw = {k: v for k, v in kw.items() if v is not _DROP}
    return fused_moe(**kw, backend="triton", workspace=ctx.mgr)


_DROP = object()


def layer(ctx: Ctx, **kw) -> FusedMoE:
    base = {
        "num_experts": E,
        "top_k": K,
        "hidden_size": H,
        "intermediate_size": I,
        "backend": "torch",
        "workspace": ctx.mgr,
    }
    base.update(kw)
    return FusedMoE(**base)


def logits(m: int = M, e: int = E, **kw) -> torch.Tensor:
    return torch.randn(m, e, **kw)


def storage_with(t: torch.Tensor, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A uint8 storage whose first bytes hold a copy of ``t`` (returned as a view) and ``extra`` more bytes."""
    n = t.numel() * t.element_size()
    st = torch.zeros(n + extra + 256, dtype=torch.uint8)
    view = st[:n].view(t.dtype).view(t.shape)
    view.copy_(t)
    return st, view


def frozen_layer_forward(ctx: Ctx):
    ctx.layer.reserve_workspace(M)
    ctx.mgr.freeze()
    ctx.layer(torch.randn(512, H))  # needs more than the reserved arena


def frozen_reserve(ctx: Ctx):
    ctx.mgr.freeze()
    ctx.mgr.reserve(1 << 22)


def frozen_release(ctx: Ctx):
    ctx.mgr.freeze()
    ctx.mgr.release()


def ws_aliasing_bias(ctx: Ctx):
    bias = torch.randn(E, 2 * I)
    st, view = storage_with(bias, plan_nbytes(ctx.args) + 4096)
    fm(ctx, w1_bias=view, workspace13=st, workspace=None)


def ws_aliasing_scale(ctx: Ctx):
    a = fp8_args("fp8_tensor")
    st, view = storage_with(a["w1_scale"], 1 << 16)
    fm8(ctx, "fp8_tensor", w1_scale=view, workspace13=st)


def ws2_aliasing_topk_weights(ctx: Ctx):
    st, view = storage_with(ctx.args["topk_weights"], 1 << 16)
    fm(ctx, topk_weights=view, workspace13=torch.empty(1 << 16, dtype=torch.uint8), workspace2=st, workspace=None)


def xfail(reason: str):
    return pytest.mark.xfail(strict=True, reason=f"BUG: {reason}")


# ---- the matrix ----------------------------------------------------------------------------------------------
@dataclass
class Row:
    id: str
    call: Callable[[Ctx], object]
    exc: type[BaseException]
    arg: str  # regex that the message must contain (the argument's name)
    marks: tuple = ()


R = Row
ROWS: list[Row] = [
    # ---- route ----
    R("route_logits_not_tensor", lambda c: route(logits().tolist(), K), TypeError, "router_logits"),
    R("route_logits_int", lambda c: route(logits().to(torch.int32), K), TypeError, "router_logits"),
    R("route_logits_1d", lambda c: route(logits()[0], K), ValueError, "router_logits"),
    R("route_top_k_zero", lambda c: route(logits(), 0), ValueError, "top_k"),
    R("route_top_k_gt_E", lambda c: route(logits(), E + 1), ValueError, "top_k"),
    R("route_top_k_float", lambda c: route(logits(), 2.0), ValueError, "top_k"),
    R("route_top_k_bool", lambda c: route(logits(), True), ValueError, "top_k"),
    R("route_zero_experts", lambda c: route(logits(e=0), 1), ValueError, "top_k.*E = 0"),
    R("route_scoring_unknown", lambda c: route(logits(), K, scoring="argmax"), ValueError, "scoring"),
    R("route_renormalize_int", lambda c: route(logits(), K, renormalize=1), TypeError, "renormalize"),
    R(
        "route_groups_without_topk_groups",
        lambda c: route(logits(), K, num_expert_groups=2),
        ValueError,
        "num_expert_groups",
    ),
    R(
        "route_groups_not_dividing_E",
        lambda c: route(logits(), K, num_expert_groups=3, topk_groups=1),
        ValueError,
        "num_expert_groups",
    ),
    R(
        "route_topk_groups_gt_groups",
        lambda c: route(logits(), K, num_expert_groups=2, topk_groups=3),
        ValueError,
        "topk_groups",
    ),
    R(
        "route_groups_with_softmax_topk",
        lambda c: route(logits(), K, scoring="softmax_topk", num_expert_groups=2, topk_groups=1),
        ValueError,
        "num_expert_groups",
    ),
    R(
        "route_bias_shape",
        lambda c: route(logits(), K, correction_bias=torch.zeros(E + 1)),
        ValueError,
        "correction_bias",
    ),
    R(
        "route_bias_int",
        lambda c: route(logits(), K, correction_bias=torch.zeros(E, dtype=torch.int32)),
        TypeError,
        "correction_bias",
    ),
    R(
        "route_bias_other_device",
        lambda c: route(logits(), K, correction_bias=torch.zeros(E, device="meta")),
        ValueError,
        "correction_bias.*meta",
    ),
    R(
        "route_bias_with_softmax_topk",
        lambda c: route(logits(), K, scoring="softmax_topk", correction_bias=torch.zeros(E)),
        ValueError,
        "correction_bias",
    ),
    R(
        "route_scaling_negative",
        lambda c: route(logits(), K, routed_scaling_factor=-1.0),
        ValueError,
        "routed_scaling_factor",
    ),
    R(
        "route_scaling_nan",
        lambda c: route(logits(), K, routed_scaling_factor=float("nan")),
        ValueError,
        "routed_scaling_factor",
    ),
    R(
        "route_scaling_inf",
        lambda c: route(logits(), K, routed_scaling_factor=float("inf")),
        ValueError,
        "routed_scaling_factor",
    ),
    R(
        "route_scaling_str",
        lambda c: route(logits(), K, routed_scaling_factor="2.5"),
        TypeError,
        "routed_scaling_factor",
    ),
    # ---- fused_moe: shapes, sizes, dtypes ----
    R("fm_hidden_1d", lambda c: fm(c, hidden_states=c.args["hidden_states"][0]), ValueError, "hidden_states"),
    R(
        "fm_hidden_size_0",
        lambda c: fm(c, hidden_states=torch.randn(M, 0), w1=torch.randn(E, 2 * I, 0), w2=torch.randn(E, 0, I)),
        ValueError,
        "hidden_states",
    ),
    R("fm_hidden_f64", lambda c: fm(c, hidden_states=c.args["hidden_states"].double()), TypeError, "hidden_states"),
    R("fm_w1_not_tensor", lambda c: fm(c, w1=c.args["w1"].tolist()), TypeError, "w1"),
    R("fm_intermediate_0", lambda c: fm(c, w1=torch.randn(E, 0, H), w2=torch.randn(E, H, 0)), ValueError, "w1"),
    R("fm_activation_none", lambda c: fm(c, activation=None), ValueError, "activation"),
    R("fm_activation_case", lambda c: fm(c, activation="SiLU"), ValueError, "activation"),
    R("fm_global_E_bool", lambda c: fm(c, global_num_experts=True), TypeError, "global_num_experts"),
    R("fm_global_E_negative", lambda c: fm(c, global_num_experts=-E), ValueError, "global_num_experts"),
    R("fm_global_E_float", lambda c: fm(c, global_num_experts=float(E)), TypeError, "global_num_experts"),
    R("fm_expert_map_int16", lambda c: fm(c, expert_map=torch.arange(E, dtype=torch.int16)), TypeError, "expert_map"),
    R("fm_expert_map_empty", lambda c: fm(c, expert_map=torch.empty(0, dtype=torch.int32)), ValueError, "expert_map"),
    R(
        "fm_ids_beyond_int32_full_checks",
        lambda c: fm(c, topk_ids=c.args["topk_ids"].long().index_fill(0, torch.tensor([2]), 1 << 40), checks="full"),
        ValueError,
        "topk_ids",
    ),
    R(
        "fm_weights_inf_full_checks",
        lambda c: fm(
            c, topk_weights=c.args["topk_weights"].index_fill(0, torch.tensor([1]), float("inf")), checks="full"
        ),
        ValueError,
        "topk_weights",
    ),
    R(
        "fm_expert_map_negative_local_full_checks",
        lambda c: fm(c, expert_map=torch.tensor([0, 1, 2, 3, 4, 5, 6, -7], dtype=torch.int32), checks="full"),
        ValueError,
        "expert_map",
    ),
    # ---- fused_moe: quantization ----
    R("fm_quant_unknown_mode", lambda c: fm(c, quant="int4"), ValueError, "quant"),
    R("fm_quant_wrong_type", lambda c: fm(c, quant=8), TypeError, "quant"),
    R(
        "fm_quant_static_on_token",
        lambda c: fm(c, quant=QuantConfig("fp8_token", static_activation_scale=True)),
        ValueError,
        "static_activation_scale",
    ),
    R(
        "fm_fp8_weights_without_scales",
        lambda c: fm8(c, "fp8_tensor", w1_scale=_DROP, w2_scale=_DROP),
        ValueError,
        "w1_scale",
    ),
    R(
        "fm_fp8_weights_without_quant",
        lambda c: fm8(c, "fp8_tensor", quant=None, w1_scale=_DROP, w2_scale=_DROP),
        TypeError,
        "w1",
    ),
    R(
        "fm_quant_with_float_weights",
        lambda c: fm(c, quant="fp8_tensor", w1_scale=torch.ones(E), w2_scale=torch.ones(E)),
        TypeError,
        "w1 and w2",
    ),
    R("fm_w1_scale_wrong_shape", lambda c: fm8(c, "fp8_tensor", w1_scale=torch.ones(E + 1)), ValueError, "w1_scale"),
    R(
        "fm_w2_scale_fp16",
        lambda c: fm8(c, "fp8_tensor", w2_scale=torch.ones(E, dtype=torch.float16)),
        TypeError,
        "w2_scale",
    ),
    R("fm_w1_scale_not_tensor", lambda c: fm8(c, "fp8_tensor", w1_scale=[1.0] * E), TypeError, "w1_scale"),
    R(
        "fm_w2_scale_other_device",
        lambda c: fm8(c, "fp8_tensor", w2_scale=torch.ones(E, device="meta")),
        ValueError,
        "w2_scale.*meta",
    ),
    R(
        "fm_token_scales_per_tensor_shape",
        lambda c: fm8(c, "fp8_token", w1_scale=torch.ones(E)),
        ValueError,
        "w1_scale",
    ),
    R(
        "fm_block_scales_wrong_shape",
        lambda c: fm8(c, "fp8_block", w2_scale=torch.ones(E, 2, 2)),
        ValueError,
        "w2_scale",
    ),
    R("fm_static_without_a2_scale", lambda c: fm8(c, "fp8_tensor_static", a2_scale=_DROP), ValueError, "a2_scale"),
    R(
        "fm_static_a1_scale_shape",
        lambda c: fm8(c, "fp8_tensor_static", a1_scale=torch.ones(2)),
        ValueError,
        "a1_scale",
    ),
    R("fm_dynamic_with_a1_scale", lambda c: fm8(c, "fp8_token", a1_scale=torch.ones(1)), ValueError, "a1_scale"),
    R(
        "fm_triton_bf16_in_interpreter",
        lambda c: fm(c, **{k: v.bfloat16() for k, v in c.args.items() if v.is_floating_point()}, backend="triton"),
        ValueError,
        "backend",
        () if INTERPRETING else (pytest.mark.skip(reason="interpreter only"),),
    ),
    # ---- fused_moe: expert biases ----
    R("fm_w1_bias_shape", lambda c: fm(c, w1_bias=torch.zeros(E, I)), ValueError, "w1_bias"),
    R("fm_w2_bias_dtype", lambda c: fm(c, w2_bias=torch.zeros(E, H, dtype=torch.float16)), TypeError, "w2_bias"),
    R("fm_w1_bias_not_tensor", lambda c: fm(c, w1_bias=0.0), TypeError, "w1_bias"),
    R(
        "fm_w2_bias_other_device",
        lambda c: fm(c, w2_bias=torch.zeros(E, H, device="meta")),
        ValueError,
        "w2_bias.*meta",
    ),
    # ---- caller workspaces ----
    R(
        "ws13_bool_dtype",
        lambda c: fm(c, workspace13=torch.zeros(1 << 16, dtype=torch.bool), workspace=None),
        TypeError,
        "workspace13",
    ),
    R(
        "ws13_empty",
        lambda c: fm(c, workspace13=torch.empty(0, dtype=torch.uint8), workspace=None),
        ValueError,
        "workspace13",
    ),
    R(
        "ws13_one_byte_short",
        lambda c: fm(c, workspace13=torch.empty(plan_nbytes(c.args) - 1, dtype=torch.uint8), workspace=None),
        ValueError,
        "workspace13 is too small",
    ),
    R(
        "ws13_stride_0",
        lambda c: fm(c, workspace13=torch.zeros(1).expand(1 << 16), workspace=None),
        ValueError,
        "workspace13.*contiguous",
    ),
    R("ws2_aliases_topk_weights", ws2_aliasing_topk_weights, ValueError, "workspace2 overlaps topk_weights"),
    R("ws13_aliases_w1_scale", ws_aliasing_scale, ValueError, "workspace13 overlaps w1_scale"),
    R("ws13_aliases_w1_bias", ws_aliasing_bias, ValueError, "workspace13 overlaps w1_bias"),
    # ---- WorkspaceManager ----
    R("mgr_strategy_not_str", lambda c: WorkspaceManager("cpu", strategy=3), ValueError, "strategy"),
    R("mgr_device_unknown", lambda c: WorkspaceManager("nonsense"), ValueError, "device"),
    R("mgr_reserve_frozen", frozen_reserve, WorkspaceFrozenError, r"frozen.*bytes"),
    R("mgr_release_frozen", frozen_release, WorkspaceFrozenError, "release"),
    R("mgr_reserve_negative", lambda c: WorkspaceManager("cpu").reserve(-1), ValueError, "reserve|bytes"),
    R("mgr_reserve_float", lambda c: c.mgr.reserve(1.5), TypeError, "reserve|plan"),
    R("mgr_reserve_unallocatable", lambda c: c.mgr.reserve(1 << 62), WorkspaceError, "bytes"),
    R("layer_forward_frozen_oversize", frozen_layer_forward, WorkspaceFrozenError, r"frozen.*bytes"),
    # ---- FusedMoE ----
    R("layer_hidden_size_bool", lambda c: layer(c, hidden_size=True), TypeError, "hidden_size"),
    R("layer_intermediate_float", lambda c: layer(c, intermediate_size=2.5), TypeError, "intermediate_size"),
    R("layer_top_k_bool", lambda c: layer(c, top_k=True), TypeError, "top_k"),
    R("layer_scaling_zero", lambda c: layer(c, routed_scaling_factor=0.0), ValueError, "routed_scaling_factor"),
    R(
        "layer_bias_with_softmax_topk",
        lambda c: layer(c, scoring="softmax_topk", correction_bias=True),
        ValueError,
        "correction_bias",
    ),
    R(
        "layer_shared_size_negative",
        lambda c: layer(c, num_shared_experts=1, shared_intermediate_size=-4),
        ValueError,
        "shared_intermediate_size",
    ),
    R("layer_dtype_int", lambda c: layer(c, dtype=torch.int32), TypeError, "dtype"),
    R(
        "layer_logits_int",
        lambda c: c.layer(torch.randn(M, H), torch.randint(0, 3, (M, E))),
        TypeError,
        "router_logits",
    ),
    R("layer_logits_not_tensor", lambda c: c.layer(torch.randn(M, H), logits().tolist()), TypeError, "router_logits"),
    R(
        "layer_logits_other_device",
        lambda c: c.layer(torch.randn(M, H), logits(device="meta")),
        ValueError,
        "router_logits",
    ),
]


def test_matrix_is_large_and_ids_unique():
    assert len(ROWS) >= 30
    assert len({r.id for r in ROWS}) == len(ROWS)


@pytest.fixture
def ctx():
    mgr = WorkspaceManager("cpu", strategy="shared", poison=True)
    c = Ctx(mgr, FusedMoE(E, K, H, I, workspace=mgr, backend="torch"), good_args())
    yield c
    mgr.unfreeze()


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=r.marks) for r in ROWS])
def test_bad_input_raises_typed_error_and_leaves_manager_unchanged(row: Row, ctx: Ctx):
    serves_correctly(ctx.mgr, ctx.layer, seed=2)  # warm: the arena exists and has served
    before = snapshot(ctx.mgr)
    with pytest.raises(row.exc) as info:
        row.call(ctx)
    err = info.value
    if issubclass(row.exc, (TypeError, ValueError)):
        other = TypeError if issubclass(row.exc, ValueError) else ValueError
        assert not isinstance(err, other), f"{type(err).__name__} is also a {other.__name__}"
    assert re.search(row.arg, str(err)), f"message does not name {row.arg!r}: {err}"
    after = snapshot(ctx.mgr)
    ctx.mgr.unfreeze()  # rows that freeze to provoke an error
    after["frozen"] = before["frozen"]
    assert after == before, "the failed call changed the manager's state"
    serves_correctly(ctx.mgr, ctx.layer)
    assert snapshot(ctx.mgr)["growths"] == before["growths"]
