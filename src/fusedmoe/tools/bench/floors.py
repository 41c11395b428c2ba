"""Hardware ceilings measured at the start of every GPU benchmark run, and the floors derived from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ceilings:
    copy_tb_s: float  # device-to-device copy, bytes read + written
    read_tb_s: float  # large read-only reduction
    bf16_tflops: float  # 8192^3 bf16 matmul on random data
    fp8_tflops: float | None = None  # 8192^3 e4m3 torch._scaled_mm (tensor-wise scales); None: not measured
    fp8_error: str | None = None  # why fp8_tflops is None (torch._scaled_mm missing, or failing on this GPU)

    @property
    def fp8_rate_tflops(self) -> float:
        """The fp8 rate the floors of fp8 rows use: the measured one, else twice the bf16 rate (the dense fp8 to
        bf16 ratio of Hopper's tensor cores)."""
        return self.fp8_tflops if self.fp8_tflops is not None else 2 * self.bf16_tflops

    def summary(self) -> str:
        """One line: the bandwidths, the bf16 rate and the fp8 rate with where it comes from."""
        line = (
            f"copy {self.copy_tb_s:.2f} TB/s (read+write), read {self.read_tb_s:.2f} TB/s, "
            f"bf16 matmul {self.bf16_tflops:.0f} TFLOP/s, "
        )
        if self.fp8_tflops is not None:
            return line + f"fp8 matmul {self.fp8_tflops:.0f} TFLOP/s (torch._scaled_mm)"
        why = f" ({self.fp8_error})" if self.fp8_error else ""
        return line + f"fp8 matmul not measured{why}: fp8 floors take 2 x bf16 = {self.fp8_rate_tflops:.0f} TFLOP/s"

    def as_dict(self) -> dict[str, float | str | None]:
        return dict(self.__dict__)


def _median_ms(fn, iters: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def measure_ceilings(device: torch.device | None = None) -> Ceilings:
    """Copy and read bandwidth over 4 GiB buffers (far beyond L2), the bf16 8192^3 matmul rate and the fp8 one
    (None, with the reason, where ``torch._scaled_mm`` is missing or fails here)."""
    device = device or torch.device("cuda")
    copy, read = _bandwidths(device)
    tflops = _matmul_rate(device)
    fp8, fp8_error = fp8_ceiling(device)
    torch.cuda.empty_cache()
    return Ceilings(copy_tb_s=copy, read_tb_s=read, bf16_tflops=tflops, fp8_tflops=fp8, fp8_error=fp8_error)


def layer_floor_us(
    distinct_experts: float,
    tokens: int,
    top_k: int,
    hidden: int,
    inter: int,
    weight_bytes: float,
    ceilings: Ceilings,
    fp8: bool = False,
) -> tuple[float, float, str]:
    """(floor us, bytes moved, which bound) of one MoE layer call.

    Bytes: weights of the distinct experts touched (3*H*I each) plus the activations read and written once
    (x in, output out); FLOPs: 2*M*k*3*H*I at the measured bf16 rate, or for ``fp8`` (w8a8: both GEMMs on e4m3
    operands; not MXFP4, whose weight-only GEMMs run at the bf16 rate) at :attr:`Ceilings.fp8_rate_tflops`."""
    weights = distinct_experts * 3 * hidden * inter * weight_bytes
    acts = 2 * tokens * hidden * 2
    bytes_moved = weights + acts
    mem_us = bytes_moved / (ceilings.read_tb_s * 1e12) * 1e6
    flops = 2 * tokens * top_k * 3 * hidden * inter
    rate = ceilings.fp8_rate_tflops if fp8 else ceilings.bf16_tflops
    compute_us = flops / (rate * 1e12) * 1e6
    if mem_us >= compute_us:
        return mem_us, bytes_moved, "memory"
    return compute_us, bytes_moved, "compute"


def _bandwidths(device: torch.device, n: int = 1 << 31) -> tuple[float, float]:
    """(copy TB/s counting read + write, read-only TB/s) over an n-element bf16 buffer (4 GiB by default)."""
    src = torch.randn(n // 1024, 1024, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src))
    read_ms = _median_ms(lambda: src.sum(dtype=torch.float32))
    nbytes = src.numel() * src.element_size()
    return 2 * nbytes / (copy_ms * 1e-3) / 1e12, nbytes / (read_ms * 1e-3) / 1e12


def _matmul_rate(device: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = _median_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def fp8_ceiling(device: torch.device) -> tuple[float | None, str | None]:
    """(the fp8 8192^3 matmul rate, None), or (None, why) where ``torch._scaled_mm`` is missing or fails here (a GPU
    without fp8 tensor cores)."""
    if not hasattr(torch, "_scaled_mm"):
        return None, f"torch {torch.__version__} has no torch._scaled_mm"
    try:
        return _fp8_matmul_rate(device), None
    except Exception as exc:  # an unsupported GPU or build: the floors fall back to 2x the bf16 rate
        return None, f"{type(exc).__name__}: {exc}"[:200]


def _fp8_matmul_rate(device: torch.device, n: int = 8192) -> float:
    """``torch._scaled_mm`` on e4m3 operands as it takes them (the first row-major, the second column-major),
    tensor-wise float32 scales, bf16 output. Fast accumulation, as Triton's fp8 dots accumulate on sm90 by default
    (our kernels' and vLLM's): the tensor cores' top fp8 rate."""
    fp8 = torch.float8_e4m3fn
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16).to(fp8)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16).to(fp8).t()
    one = torch.ones((), device=device, dtype=torch.float32)
    ms = _median_ms(
        lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
    )
    return 2 * n**3 / (ms * 1e-3) / 1e12
