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
"""

from __future__ import annotations

import importlib
import importlib.metadata

import torch

#: Peers in the order they are listed.
PEERS = ("vllm", "triton_kernels", "grouped_mm")


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
    module = {"vllm": "vllm.model_executor.layers.fused_moe", "triton_kernels": "triton_kernels.matmul_ogs"}[name]
    try:
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
    E, two_i, H = w1.shape
    inter = two_i // 2
    w1i = w1.view(E, 2, inter, H).transpose(1, 2).reshape(E, two_i, H)  # rows g0, u0, g1, u1, ...
    bias = torch.zeros(E, two_i, device=w1.device, dtype=torch.float32)
    bias[:, 1::2] = -1.0
    return w1i.transpose(1, 2), w2.transpose(1, 2), bias


def make_triton_kernels(x, w1, w2, top_k: int, routing: dict):
    """triton_kernels' ``routing`` + two ``matmul_ogs`` calls; None for routing it does not do (grouped top-k,
    softmax before top-k without renormalizing is its ``sm_first``)."""
    from triton_kernels import swiglu
    from triton_kernels.matmul_ogs import FnSpecs, FusedActivation, matmul_ogs
    from triton_kernels.routing import routing as tk_routing

    if routing.get("num_expert_groups") or routing.get("scoring", "softmax") != "softmax":
        return None
    sm_first = not routing.get("renormalize", True)
    w1t, w2t, bias = triton_kernels_weights(w1, w2)
    act = FusedActivation(FnSpecs("swiglu", swiglu.swiglu_fn, ("alpha", "limit")), (1.0, None), 2)

    def call(logits):
        rdata, gather, scatter = tk_routing(logits, top_k, sm_first=sm_first)
        h = matmul_ogs(x, w1t, bias, rdata, gather_indx=gather, fused_activation=act)
        return matmul_ogs(h, w2t, None, rdata, scatter_indx=scatter, gammas=rdata.gate_scal)

    return call


def make_grouped_mm(x, w1, w2, top_k: int, routing: dict):
    from ...routing import route
    from .baselines import grouped_mm_moe

    def call(logits):
        w, ids = route(logits, top_k, **routing)
        return grouped_mm_moe(x, w1, w2, w, ids)

    return call


MAKERS = {"vllm": make_vllm, "triton_kernels": make_triton_kernels, "grouped_mm": make_grouped_mm}


def check_close(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of a peer's layer output against ours (max abs difference over ref's max abs)."""
    out = out.reshape(ref.shape).float()
    return float((out - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12))
