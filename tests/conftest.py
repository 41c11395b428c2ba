"""Test setup: run Triton kernels under the CPU interpreter when there is no GPU, and skip ``gpu`` tests there.

TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, i.e. before fusedmoe is imported.
A property checked on both devices is one test parametrized over tests/devices.py's device lists.
"""

import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
