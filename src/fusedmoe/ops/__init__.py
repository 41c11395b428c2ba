"""Triton kernels of the Triton experts, each beside a thin torch wrapper.

- :mod:`.align`: counting sort of (token, expert) slots into BLOCK_M blocks per local expert.
- :mod:`.grouped_gemm`: GEMM1 (gate/up + fused activation) and GEMM2 (down x routing weight).
- :mod:`.expert_gemm`: the K loop, epilogue and launch settings every expert GEMM (grouped and batched) is made of.
- :mod:`.batched_gemm`, :mod:`.batched_quantize`: the batched layout's GEMMs and quantization.
- :mod:`.quantize`: fp8 e4m3 activation quantization (per-tensor, per-token, 128-column groups).
- :mod:`.reduce`: sum over the top-k slots of each token.
- :mod:`.configs`: block-size configs (tuned JSON files, heuristic, pinning).

Importing this package does not import Triton; the submodules do.
"""

__all__ = ["align", "configs", "grouped_gemm", "quantize", "reduce"]
