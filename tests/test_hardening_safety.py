"""Hardening, part 2: memory safety without value checks, proved with guard bands.

With ``checks`` off (the default), out-of-range or negative ``topk_ids``, garbage ``expert_map`` entries, NaN/inf
router logits, NaN routing weights and NaN activations must never make a kernel touch memory outside its
buffers. Two kinds of guards, for both backends (torch; Triton under the CPU interpreter in float32 on tiny
shapes with tile-unaligned H and I, so every masked edge is exercised):

* **write guards**: random canary bytes right before and right after (to the byte) every region a kernel may
  write: the whole caller workspace (``workspace13`` / ``workspace2`` as slices of a larger canary buffer,
  through the public ``fused_moe``), and, calling the experts directly, every single planned view (each in its
  own guarded slot, poisoned inside) and the output tensor. The canaries must be intact after every call.
* **read guards**: every input tensor is a view into a larger tensor whose surroundings hold NaN (floats) or a
  valid expert id (ids, maps), so an out-of-bounds read that reaches the result shows up as NaN or as a
  mismatch against the float64 reference.

Results must also be right: out-of-range ids contribute nothing (the reference's rule), and NaN is row-local:
tokens whose logits, weights and activations are finite get exactly the reference's rows.
The GPU counterpart is ``scripts/sanitize`` (compute-sanitizer memcheck on the same scenarios in bf16).
"""

from __future__ import annotations

import os

import pytest
import torch

from fusedmoe import fused_moe, get_kernel, route
from fusedmoe.checks import check_fused_moe_args
from fusedmoe.experts.base import ExpertsInputs
from fusedmoe.ops.configs import MoEConfig, pinned_config
from fusedmoe.reference import fused_moe_reference, relative_error
from fusedmoe.workspace.manager import Workspace, poison_views

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
_interp = pytest.mark.skipif(not INTERPRETING, reason="interpreter")
BACKENDS = ["torch", pytest.param("triton", marks=_interp)]
M, H, I, E, K = 9, 40, 24, 4, 3  # H, I not multiples of the pinned tiles: masked edges everywhere
GLOBAL_E = 7
PIN = MoEConfig.simple(16, 32, 32)
PAD = 256  # guard bytes on each side
PADN = 64  # guard elements around each input


@pytest.fixture(autouse=True)
def _pin():
    with pinned_config(PIN):
        yield


# ---- guards --------------------------------------------------------------------------------------------------
class Canaries:
    """Byte regions surrounded by random canary bytes; ``assert_intact`` checks every guard to the byte."""

    def __init__(self, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.regions: list[tuple[str, torch.Tensor, int, int, torch.Tensor]] = []

    def carve(self, name: str, nbytes: int) -> torch.Tensor:
        buf = torch.randint(0, 256, (PAD + nbytes + PAD,), dtype=torch.uint8, generator=self.gen)
        self.regions.append((name, buf, PAD, PAD + nbytes, buf.clone()))
        return buf[PAD : PAD + nbytes]

    def tensor(self, name: str, shape, dtype) -> torch.Tensor:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return self.carve(name, n).view(dtype).view(shape)

    def assert_intact(self) -> None:
        bad = []
        for name, buf, lo, hi, ref in self.regions:
            if not torch.equal(buf[:lo], ref[:lo]):
                bad.append(f"{name}: {int((buf[:lo] != ref[:lo]).sum())} bytes before")
            if not torch.equal(buf[hi:], ref[hi:]):
                bad.append(f"{name}: {int((buf[hi:] != ref[hi:]).sum())} bytes after")
        assert not bad, "guard bands overwritten: " + "; ".join(bad)


def embedded(t: torch.Tensor | None, fill) -> torch.Tensor | None:
    """``t``'s values in a view surrounded by PADN elements of ``fill`` (a read guard)."""
    if t is None:
        return None
    flat = torch.full((t.numel() + 2 * PADN,), fill, dtype=t.dtype)
    flat[PADN : PADN + t.numel()] = t.reshape(-1)
    return flat[PADN : PADN + t.numel()].view(t.shape)


def guarded_inputs(a: dict) -> dict:
    out = {}
    for k, v in a.items():
        if not isinstance(v, torch.Tensor):
            out[k] = v
        elif v.is_floating_point():
            out[k] = embedded(v, float("nan"))
        else:
            out[k] = embedded(v, 0)  # a valid id: a stray read would add a wrong contribution
    return out


# ---- problems ------------------------------------------------------------------------------------------------
def base(seed=0, m=M):
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(m, H, generator=g),
        "w1": torch.randn(E, 2 * I, H, generator=g) / H**0.5,
        "w2": torch.randn(E, H, I, generator=g) / I**0.5,
        "topk_weights": torch.rand(m, K, generator=g) + 0.1,
        "topk_ids": torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(m)]).to(torch.int32),
    }


I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def case(name: str) -> tuple[dict, dict]:
    """(tensors, options) of one adversarial scenario; values checks stay off."""
    a, kw = base(), {}
    ids = a["topk_ids"]
    if name == "negative_ids":
        ids[0, 0], ids[2, 1], ids[4, 2], ids[5] = -1, -7, I32_MIN, torch.tensor([-1, -2, -3])
    elif name == "too_large_ids":
        ids[0, 0], ids[2, 1], ids[4, 2], ids[6] = E, E + 1, I32_MAX, torch.tensor([E, 99, I32_MAX - 1])
    elif name == "all_ids_invalid":
        ids.copy_(torch.tensor([-1, E, I32_MAX]).repeat(M, 1))
    elif name == "int64_ids_in_int32_range":
        a["topk_ids"] = ids.long()
        a["topk_ids"][1, 0], a["topk_ids"][3, 2] = -(2**20), 2**20
    elif name == "garbage_expert_map":
        kw["expert_map"] = torch.tensor([2, -1, 0, E, -5, 3, 1], dtype=torch.int32)  # E and -5 are garbage
        g = torch.Generator().manual_seed(3)
        a["topk_ids"] = torch.randint(-3, GLOBAL_E + 3, (M, K), generator=g, dtype=torch.int32)
    elif name == "map_int32_extremes":
        kw["expert_map"] = torch.tensor([I32_MAX, 0, I32_MIN, 1, -1, 2, 3], dtype=torch.int32)
        a["topk_ids"] = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 0, 2], [1, 3, 5]] * 3, dtype=torch.int32)[:M]
    elif name == "nan_hidden":
        a["hidden_states"][1] = float("nan")
        a["hidden_states"][4, 3] = float("inf")
        a["hidden_states"][7, 0] = -float("inf")
    elif name == "nan_weights":
        a["topk_weights"][2, 1] = float("nan")
        a["topk_weights"][5, 0] = float("inf")
    elif name == "nan_logits":
        logits = torch.randn(M, E, generator=torch.Generator().manual_seed(5))
        logits[0] = float("nan")
        logits[3, 1] = float("inf")
        logits[6] = -float("inf")
        logits[8, 2] = float("nan")
        a["topk_weights"], a["topk_ids"] = route(logits, K)
    else:
        raise AssertionError(name)
    return a, kw


#: NaN/Inf inputs are the point of these cases: the Triton interpreter's numpy math warns about them (a GPU is
#: silent), and only those warnings are expected
_NONFINITE = pytest.mark.filterwarnings("ignore:invalid value encountered in (multiply|matmul|reduce):RuntimeWarning")
CASES = [
    "negative_ids",
    "too_large_ids",
    "all_ids_invalid",
    "int64_ids_in_int32_range",
    "garbage_expert_map",
    "map_int32_extremes",
    pytest.param("nan_hidden", marks=_NONFINITE),
    pytest.param("nan_weights", marks=_NONFINITE),
    "nan_logits",
]


def dirty_rows(a: dict) -> torch.Tensor:
    """Tokens whose result may legitimately be non-finite (non-finite input row or routing weight)."""
    bad = ~torch.isfinite(a["hidden_states"]).all(dim=1)
    return bad | ~torch.isfinite(a["topk_weights"]).all(dim=1)


def check_result(out: torch.Tensor, a: dict, kw: dict) -> None:
    ref = fused_moe_reference(
        *(a[k] for k in ("hidden_states", "w1", "w2", "topk_weights", "topk_ids")),
        global_num_experts=GLOBAL_E if "expert_map" in kw else None,
        **kw,
    )
    clean = ~dirty_rows(a)
    assert clean.sum() >= M // 2
    assert torch.isfinite(ref[clean]).all()
    assert torch.isfinite(out[clean]).all(), "NaN leaked into tokens whose inputs are finite"
    assert relative_error(out[clean], ref[clean]) < 1e-5


def problem(a: dict, kw: dict):
    return check_fused_moe_args(
        *(a[k] for k in ("hidden_states", "w1", "w2", "topk_weights", "topk_ids")),
        activation="silu",
        apply_router_weight_on_input=False,
        expert_map=kw.get("expert_map"),
        global_num_experts=GLOBAL_E if "expert_map" in kw else None,
        quant=None,
        w1_scale=None,
        w2_scale=None,
        a1_scale=None,
        a2_scale=None,
        checks="basic",
    )


# ---- tests ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("split", [False, True], ids=["ws13", "ws13+ws2"])
def test_caller_workspace_guard_bands(backend, name, split, monkeypatch):
    """Public path: fused_moe with the workspace(s) as exact-size slices of canary buffers, inputs read-guarded."""
    monkeypatch.delenv("FUSEDMOE_CHECKS", raising=False)
    a, kw = case(name)
    plan = get_kernel(backend).plan(problem(a, kw))
    guards = Canaries()
    if split:
        ws = {
            "workspace13": guards.carve("workspace13", plan.region_nbytes["13"]),
            "workspace2": guards.carve("workspace2", plan.region_nbytes["2"]),
        }
    else:
        ws = {"workspace13": guards.carve("workspace13", plan.nbytes)}
    for t in ws.values():  # poison inside the workspace, canaries outside
        t.fill_(0x7F)
    g = guarded_inputs({**a, **kw})
    out = fused_moe(**g, global_num_experts=GLOBAL_E if "expert_map" in kw else None, backend=backend, **ws)
    guards.assert_intact()
    check_result(out, a, kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_every_view_and_the_output_are_guarded(backend, name, monkeypatch):
    """Experts called directly: each planned buffer in its own guarded slot (no aliasing, so a stray write into a
    neighbour cannot hide), poisoned inside; the output tensor guarded too."""
    monkeypatch.delenv("FUSEDMOE_CHECKS", raising=False)
    a, kw = case(name)
    p = problem(a, kw)
    kernel = get_kernel(backend)
    plan = kernel.plan(p)
    guards = Canaries(seed=1)
    views = {b.name: guards.tensor(b.name, b.shape, b.dtype) for b in plan.buffers}
    ws = Workspace(plan, views, None)
    poison_views(ws)
    out = guards.tensor("output", (M, H), torch.float32)
    out.fill_(float("nan"))
    g = guarded_inputs({**a, **kw})
    x = ExpertsInputs(
        g["hidden_states"], g["w1"], g["w2"], g["topk_weights"], g["topk_ids"], expert_map=g.get("expert_map")
    )
    kernel.run(x, p, ws, out)
    guards.assert_intact()
    check_result(out.clone(), a, kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_ids_beyond_int32_are_non_local(backend, monkeypatch):
    """int64 ids outside int32 (e.g. 2**32 + 1, -2**32 + 2) are out of range: no contribution, like -1."""
    monkeypatch.delenv("FUSEDMOE_CHECKS", raising=False)
    a = base()
    ids = a["topk_ids"].long()
    ids[0, 0], ids[3, 1], ids[5] = 2**32 + 1, -(2**32) + 2, torch.tensor([2**40, 2**32, -(2**63)])
    a["topk_ids"] = ids
    guards = Canaries()
    plan = get_kernel(backend).plan(problem(a, {}))
    ws13 = guards.carve("workspace13", plan.nbytes)
    out = fused_moe(**guarded_inputs(a), backend=backend, workspace13=ws13)
    guards.assert_intact()
    check_result(out, a, {})


@pytest.mark.skipif(not INTERPRETING, reason="the fused routing kernel under the CPU interpreter")
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "softmax_topk"])
def test_fused_routing_kernel_non_finite_logits_give_in_range_ids(scoring):
    """The Triton routing kernel (the CUDA path of route) on NaN/inf logits: ids stay in [0, E) and distinct per
    token, nothing is written past its outputs, and rows of finite logits match the torch definition."""
    from fusedmoe.ops.routing import kernel_supports, route_fused

    e, k, m = 8, 3, 10
    assert kernel_supports(e, k, None)
    logits = torch.randn(m, e, generator=torch.Generator().manual_seed(9))
    logits[0], logits[2], logits[4] = float("nan"), float("inf"), -float("inf")
    logits[6, 3], logits[7, 0], logits[8, 5] = float("nan"), float("inf"), -float("inf")
    guarded = embedded(logits, float("nan"))
    w, ids = route_fused(
        guarded,
        k,
        scoring=scoring,
        renormalize=True,
        num_expert_groups=None,
        topk_groups=None,
        correction_bias=None,
        routed_scaling_factor=1.0,
    )
    assert ids.dtype == torch.int32 and ids.shape == (m, k)
    assert bool(((ids >= 0) & (ids < e)).all()), ids
    assert all(len(set(r)) == k for r in ids.tolist()), "duplicate experts in a token"
    finite = torch.isfinite(logits).all(dim=1)
    w_ref, ids_ref = route(logits, k, scoring=scoring)
    assert torch.equal(ids[finite], ids_ref[finite])
    torch.testing.assert_close(w[finite], w_ref[finite])


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_logits_through_route_and_layer_keep_other_tokens_exact(backend, monkeypatch):
    """End to end through route + fused_moe with a poisoned shared manager: non-finite logits of some tokens
    never disturb the others (row-local NaN), and the manager's next clean call is correct."""
    from fusedmoe import WorkspaceManager

    monkeypatch.delenv("FUSEDMOE_CHECKS", raising=False)
    mgr = WorkspaceManager("cpu", poison=True)
    a, _ = case("nan_logits")
    out = fused_moe(**a, backend=backend, workspace=mgr)
    check_result(out, a, {})
    b = base(seed=4)
    out = fused_moe(**b, backend=backend, workspace=mgr)
    check_result(out, b, {})


def test_guards_detect_a_one_element_overrun_and_underrun():
    """The guards themselves: a write one element past the end (or before the start) of a view is caught."""
    for offset in (4 * 10, -4):
        guards = Canaries(seed=2)
        t = guards.tensor("victim", (10,), torch.float32)
        t.fill_(1.0)
        guards.assert_intact()
        torch.as_strided(t, (1,), (1,), t.storage_offset() + offset // 4).fill_(2.0)
        with pytest.raises(AssertionError, match="victim"):
            guards.assert_intact()
