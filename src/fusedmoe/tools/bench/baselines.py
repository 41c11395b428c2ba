"""Baselines the fused kernels are measured against, written from public torch APIs.

``grouped_mm_moe``: sort slots by expert, two ``torch._grouped_mm`` calls (CUTLASS grouped GEMM on SM90) with
a torch activation between them, weight, un-permute and sum over top-k. No host sync (offsets stay on the
device; counts via ``histc`` as transformers does, because ``bincount`` syncs), so it can be captured in a
CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm") and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def grouped_mm_moe(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """[M, H] bf16 -> [M, H] bf16 with w1 [E, 2I, H], w2 [E, H, I]; every id must be a valid expert."""
    M, H = x.shape
    k = topk_ids.shape[1]
    E, two_i, _ = w1.shape
    inter = two_i // 2
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.histc(flat.float(), bins=E, min=0, max=E - 1)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x.index_select(0, order // k)
    h = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs)
    if activation == "silu":
        a = F.silu(h[:, :inter]) * h[:, inter:]
    else:
        a = F.gelu(h[:, :inter], approximate="tanh") * h[:, inter:]
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    y = y * topk_weights.reshape(-1).index_select(0, order).to(y.dtype)[:, None]
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return y.index_select(0, inv).view(M, k, H).sum(dim=1)


def hf_experts(w1: torch.Tensor, w2: torch.Tensor, implementation: str):
    """transformers' own experts module (Qwen3-MoE's, the standard [E,2I,H]/[E,H,I] layout, SwiGLU) running
    ``implementation`` ("grouped_mm" or "batched_mm") on our weights; None when transformers is missing.

    Call it as ``module(hidden [M, H], top_k_index int64 [M, k], top_k_weights [M, k] in the model dtype)``.
    """
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except Exception:
        return None
    E, two_i, H = w1.shape
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=two_i // 2, num_experts=E, hidden_act="silu")
    cfg._experts_implementation = implementation
    with torch.device("meta"):
        module = Qwen3MoeExperts(cfg)
    module.gate_up_proj = torch.nn.Parameter(w1, requires_grad=False)
    module.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return module.eval()
