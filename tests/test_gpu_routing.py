"""On the GPU, route() takes the one-launch Triton kernel: it must agree with the torch definition (on CPU)."""

import pytest
import torch

from fusedmoe.routing import ROUTING_PRESETS, route

pytestmark = pytest.mark.gpu

SHAPES = {"qwen3-moe": (128, 8), "mixtral": (8, 2), "deepseek-v2-lite": (64, 6), "deepseek-v3": (256, 8),
          "deepseek-v2": (160, 6), "gpt-oss": (32, 4)}


@pytest.mark.parametrize("family", sorted(SHAPES))
@pytest.mark.parametrize("M", [1, 77, 4096])
def test_cuda_route_matches_torch_definition(family, M):
    E, k = SHAPES[family]
    kw = dict(ROUTING_PRESETS[family])
    logits = torch.randn(M, E, device="cuda") * 2
    bias = torch.randn(E, device="cuda") * 0.3 if family == "deepseek-v3" else None
    w, ids = route(logits, k, correction_bias=bias, **kw)
    w_ref, ids_ref = route(logits.cpu(), k, correction_bias=None if bias is None else bias.cpu(), **kw)
    assert w.is_cuda and ids.dtype == torch.int32
    same = (ids.cpu().sort(dim=1).values == ids_ref.sort(dim=1).values).all(dim=1)
    assert same.float().mean() > 0.999  # float32 near-ties may flip one choice in a rare row
    order, order_ref = ids.cpu()[same].argsort(dim=1), ids_ref[same].argsort(dim=1)
    torch.testing.assert_close(w.cpu()[same].gather(1, order), w_ref[same].gather(1, order_ref),
                               rtol=2e-5, atol=1e-6)
