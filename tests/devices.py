"""Device parameters for tests that check one property on the CPU and on CUDA.

``"cuda"`` is marked ``gpu``: ``pytest -m gpu`` selects it and conftest skips it on a machine without a GPU.
Triton kernels run on CPU tensors only under the interpreter (conftest sets ``TRITON_INTERPRET=1`` when there is no
GPU), so their ``"cpu"`` case is skipped elsewhere.
"""

import os

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

#: skips a test that runs Triton kernels on CPU tensors unless the interpreter is on
interpreter = pytest.mark.skipif(not INTERPRETING, reason="Triton on CPU tensors needs TRITON_INTERPRET=1")

CUDA = pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")
#: a torch path: the CPU case runs anywhere
DEVICES = [pytest.param("cpu", id="cpu"), CUDA]
#: a Triton kernel: the CPU case runs under the interpreter
TRITON_DEVICES = [pytest.param("cpu", marks=interpreter, id="cpu"), CUDA]
#: (device, activation dtype) for Triton kernels: float32 on both, bf16 on CUDA only (the interpreter has none)
TRITON_DEVICE_DTYPES = [
    pytest.param("cpu", torch.float32, marks=interpreter, id="cpu-fp32"),
    pytest.param("cuda", torch.float32, marks=pytest.mark.gpu, id="cuda-fp32"),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu, id="cuda-bf16"),
]


def tolerance(dtype: torch.dtype, quantized: bool = False) -> float:
    """Relative error allowed against the float64 reference."""
    if quantized:
        return 6e-2
    return {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
