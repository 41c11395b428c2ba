"""Hardware ceilings measured at the start of every GPU benchmark run, and the floors derived from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ceilings:
    copy_tb_s: float  # device-to-device copy, bytes read + written
    read_tb_s: float  # large read-only reduction
    bf16_tflops: float  # 8192^3 bf16 matmul on random data

    def as_dict(self) -> dict[str, float]:
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
    """Copy and read bandwidth over 4 GiB buffers (far beyond L2) and the bf16 8192^3 matmul rate."""
    device = device or torch.device("cuda")
    copy, read = _bandwidths(device)
    tflops = _matmul_rate(device)
    torch.cuda.empty_cache()
    return Ceilings(copy_tb_s=copy, read_tb_s=read, bf16_tflops=tflops)


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
    (x in, output out); FLOPs: 2*M*k*3*H*I at the measured bf16 rate (x2 for fp8)."""
    weights = distinct_experts * 3 * hidden * inter * weight_bytes
    acts = 2 * tokens * hidden * 2
    bytes_moved = weights + acts
    mem_us = bytes_moved / (ceilings.read_tb_s * 1e12) * 1e6
    flops = 2 * tokens * top_k * 3 * hidden * inter
    rate = ceilings.bf16_tflops * (2 if fp8 else 1)
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
