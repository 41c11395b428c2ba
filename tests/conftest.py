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
        # Under pytest-xdist (scripts/gpu-check), the tests that hold many GiB run one at a time in one worker
        # (with --dist loadgroup): side by side they exhaust the GPU's memory.
        if config.pluginmanager.hasplugin("xdist"):
            for item in items:
                if "big_gpu" in item.keywords:
                    item.add_marker(pytest.mark.xdist_group("big_gpu"))
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def router_gemm_to_64(monkeypatch):
    """The routing launch computes the logits up to 64 rows, whatever ROUTER_GEMM_MAX_M's default."""
    from fusedmoe.ops import routing

    monkeypatch.setattr(routing, "ROUTER_GEMM_MAX_M", 64)
    return 64


#: A worker process sharing the GPU with others returns its cached blocks above this (bytes) after a test.
_SHARED_GPU_CACHE = 2 << 30


@pytest.fixture(autouse=True)
def _release_gpu_cache():
    """With several pytest-xdist workers on one GPU, memory one test freed stays reserved by its process's
    caching allocator and can starve the others: hand it back after each test that left much of it."""
    yield
    if _HAS_CUDA and os.environ.get("PYTEST_XDIST_WORKER") and torch.cuda.memory_reserved() > _SHARED_GPU_CACHE:
        import gc

        gc.collect()
        torch.cuda.empty_cache()
