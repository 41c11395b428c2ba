"""Other libraries' MoE kernels, run in the same process and run as ours (``fusedmoe bench kernel --peers``).

Each peer is a factory ``make(x, w1, w2, top_k, routing)`` returning a function of router logits that runs
routing + one bf16 SwiGLU layer on the peer (or None where the peer cannot run the shape), and a version label.
A peer that is not importable is reported by :func:`available` with the reason, never silently dropped.

- ``vllm``: vLLM's Triton ``fused_experts`` (tuned tables of the installed vLLM) after our routing.
- ``triton_kernels``: OpenAI's ``triton_kernels`` (the ``matmul_ogs`` generation: its own routing, GEMM1 with
  the SwiGLU fused in, GEMM2 with the scatter and top-k sum fused in). Its SwiGLU is gpt-oss's
  ``silu(g) * (u + 1)`` (alpha 1, no clamp here); an up-column bias of -1 makes it the standard ``silu(g) * u``,
  so its output is comparable with ours (:func:`check_close` verifies it). Installing it: docs/benchmarks.md.
- ``grouped_mm``: ``torch._grouped_mm`` (see :mod:`.baselines`), always present on sm90 with torch >= 2.8.

Quantized peers run the very weights our quantized call runs (``make(x, quantized, top_k, routing)``, listed in
:data:`QUANT_PEERS` with the weight mode they take):

- ``triton_kernels_mxfp4``: triton_kernels' w4a16 path (MXFP4 weights in its Hopper value and scale layouts, bf16
  activations), the one transformers runs gpt-oss through; the same SwiGLU bias as the bf16 adapter.
"""

from __future__ import annotations

import importlib
import importlib.metadata

import torch

#: Peers in the order they are listed.
PEERS = ("vllm", "triton_kernels", "grouped_mm")
#: Peers of a quantized sweep that run our quantized weights: name -> the weight mode they take.
QUANT_PEERS = {"triton_kernels_mxfp4": "mxfp4"}


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def available(name: str) -> tuple[bool, str]:
    """(importable, version label or the reason it is not)."""
    if name == "grouped_mm":
        from .baselines import grouped_mm_available

        return (True, f"torch {torch.__version__}") if grouped_mm_available() else (False, "needs sm90+")
    modules = {
        "vllm": ["vllm.model_executor.layers.fused_moe"],
        "triton_kernels": ["triton_kernels.matmul_ogs"],
        "triton_kernels_mxfp4": ["triton_kernels.matmul_ogs", "triton_kernels.tensor_details.layout"],
    }[name]
    try:
        for module in modules:
            importlib.import_module(module)
    except Exception as exc:  # any failure to import (missing, ABI mismatch) means the peer is absent here
        return False, f"{type(exc).__name__}: {exc}"[:160]
    if name == "vllm":
        return True, f"vllm {_version('vllm')}"
    import triton_kernels

    origin = triton_kernels.__file__ or "?"
    return True, f"triton_kernels (matmul_ogs API) from {origin.rsplit('/', 2)[0]}"


def make_vllm(x, w1, w2, top_k: int, routing: dict):
    """vLLM's Triton experts (``fused_experts``, bf16, SiLU) after :func:`fusedmoe.routing.route`."""
    from vllm.model_executor.layers.fused_moe import fused_experts

    from ...routing import route

    def call(logits):
        w, ids = route(logits, top_k, **routing)
        return fused_experts(x, w1, w2, w, ids)

    return call


def triton_kernels_weights(w1: torch.Tensor, w2: torch.Tensor):
    """Our [E, 2I, H] / [E, H, I] weights in triton_kernels' layout: w1 [E, H, 2I] with gate and up columns
    interleaved (its SwiGLU pairs adjacent columns) and w2 [E, I, H] (both views of K-contiguous copies), and the
    fp32 GEMM1 bias [E, 2I] that turns its ``silu(g) * (u + 1)`` into ``silu(g) * u``."""
    return interleave_rows(w1).transpose(1, 2), w2.transpose(1, 2), up_bias(w1.shape[0], w1.shape[1], w1.device)


def interleave_rows(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, X] with gate rows then up rows -> rows g0, u0, g1, u1, ... (the pairs triton_kernels' SwiGLU takes)."""
    E, two_i, X = t.shape
    return t.view(E, 2, two_i // 2, X).transpose(1, 2).reshape(E, two_i, X)


def up_bias(E: int, two_i: int, device) -> torch.Tensor:
    """The fp32 GEMM1 bias [E, 2I] (interleaved columns) that turns ``silu(g) * (u + 1)`` into ``silu(g) * u``."""
    bias = torch.zeros(E, two_i, device=device, dtype=torch.float32)
    bias[:, 1::2] = -1.0
    return bias


def mxfp4_for_triton_kernels(packed: torch.Tensor, scales: torch.Tensor, interleave: bool):
    """Our MXFP4 weight (:mod:`fusedmoe.mxfp4`: ``packed`` uint8 [E, N, K/2], ``scales`` uint8 [E, N, K/32]) as the
    tensors triton_kernels' MXFP4 layouts take: rows interleaved gate, up when ``interleave`` (GEMM1), then K-major
    views, values [E, K/2, N] and scales [E, K/32 rounded up to a multiple of 4, N] (its Hopper path reads the
    scales of 4 groups at a time; vLLM 0.34.0 pads them the same way; the zero groups lie past K)."""
    if interleave:
        packed, scales = interleave_rows(packed), interleave_rows(scales)
    scales = torch.nn.functional.pad(scales, (0, -scales.shape[-1] % 4))
    return packed.transpose(-2, -1), scales.transpose(-2, -1)


def make_triton_kernels(x, w1, w2, top_k: int, routing: dict):
    """triton_kernels' ``routing`` + two ``matmul_ogs`` calls; None for routing it does not do (grouped top-k,
    softmax before top-k without renormalizing is its ``sm_first``)."""
    sm_first = _triton_kernels_sm_first(routing)
    if sm_first is None:
        return None
    w1t, w2t, bias = triton_kernels_weights(w1, w2)
    return _triton_kernels_layer(x, w1t, w2t, bias, top_k, sm_first)


def _triton_kernels_layer(x, w1, w2, bias, top_k: int, sm_first: bool, precision=(None, None), constraints=None):
    """A function of router logits running triton_kernels' ``routing`` (``sm_first``), GEMM1 on ``w1`` with its
    SwiGLU fused (``bias``: the up-column bias of :func:`up_bias`) and GEMM2 on ``w2`` with the scatter and the
    gate-weighted top-k sum fused; ``precision``: the two GEMMs' ``PrecisionConfig`` (None: unquantized),
    ``constraints``: its opt-flag constraints, held during each call only."""
    from triton_kernels import swiglu
    from triton_kernels.matmul_ogs import FnSpecs, FusedActivation, matmul_ogs
    from triton_kernels.matmul_ogs_details.opt_flags import reset_opt_flags_constraints, update_opt_flags_constraints
    from triton_kernels.routing import routing as tk_routing

    act = FusedActivation(FnSpecs("swiglu", swiglu.swiglu_fn, ("alpha", "limit")), (1.0, None), 2)
    pc1, pc2 = precision

    def call(logits):
        if constraints:
            update_opt_flags_constraints(constraints)
        try:
            rdata, gather, scatter = tk_routing(logits, top_k, sm_first=sm_first)
            h = matmul_ogs(x, w1, bias, rdata, gather_indx=gather, precision_config=pc1, fused_activation=act)
            return matmul_ogs(h, w2, None, rdata, scatter_indx=scatter, precision_config=pc2, gammas=rdata.gate_scal)
        finally:
            if constraints:
                reset_opt_flags_constraints()

    return call


def _triton_kernels_sm_first(routing: dict) -> bool | None:
    """triton_kernels' ``sm_first`` for our routing, or None for routing it does not do (grouped top-k, sigmoid
    scoring, a routed scaling factor). Its default (False) is top-k of the logits, then softmax over those k: our
    "softmax_topk" (gpt-oss), and "softmax" renormalized over the top k; True is softmax over all experts, then
    top-k without renormalizing."""
    if routing.get("num_expert_groups") or routing.get("routed_scaling_factor", 1.0) != 1.0:
        return None
    scoring = routing.get("scoring", "softmax")
    if scoring == "softmax_topk":
        return False
    if scoring == "softmax":
        return not routing.get("renormalize", True)
    return None


def make_triton_kernels_mxfp4(x, quantized: dict, top_k: int, routing: dict):
    """triton_kernels' ``routing`` + two w4a16 ``matmul_ogs`` calls on our MXFP4 weights (the same bits), laid out
    as its Hopper kernels read them; None for other weight modes or routing it does not do. ``split_k`` is held
    at 1 during each call, as vLLM holds it for MXFP4 weights on Hopper."""
    from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig
    from triton_kernels.numerics import InFlexData
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details import layout

    sm_first = _triton_kernels_sm_first(routing)
    if quantized["quant"].mode != "mxfp4" or sm_first is None:
        return None

    def laid_out(packed, scales, interleave):
        values, group_scales = mxfp4_for_triton_kernels(packed, scales, interleave)
        value_layout, value_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout, scale_opts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
        w = convert_layout(wrap_torch_tensor(values, dtype=FP4), value_layout, **value_opts)
        s = convert_layout(wrap_torch_tensor(group_scales), scale_layout, **scale_opts)
        return w, PrecisionConfig(weight_scale=s, flex_ctx=FlexCtx(rhs_data=InFlexData()))

    w1, pc1 = laid_out(quantized["w1"], quantized["w1_scale"], True)
    w2, pc2 = laid_out(quantized["w2"], quantized["w2_scale"], False)
    bias = up_bias(quantized["w1"].shape[0], quantized["w1"].shape[1], x.device)
    return _triton_kernels_layer(x, w1, w2, bias, top_k, sm_first, (pc1, pc2), {"split_k": 1})


def make_grouped_mm(x, w1, w2, top_k: int, routing: dict):
    from ...routing import route
    from .baselines import grouped_mm_moe

    def call(logits):
        w, ids = route(logits, top_k, **routing)
        return grouped_mm_moe(x, w1, w2, w, ids)

    return call


MAKERS = {"vllm": make_vllm, "triton_kernels": make_triton_kernels, "grouped_mm": make_grouped_mm}
QUANT_MAKERS = {"triton_kernels_mxfp4": make_triton_kernels_mxfp4}


def is_peer(backend: str) -> bool:
    """Whether ``backend`` is another library's kernels (bf16 or quantized), not one of ours."""
    return backend in MAKERS or backend in QUANT_MAKERS


def check_close(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of a peer's layer output against ours (max abs difference over ref's max abs)."""
    out = out.reshape(ref.shape).float()
    return float((out - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12))
