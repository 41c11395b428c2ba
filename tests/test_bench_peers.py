"""The peers of `fusedmoe bench --peers` (tools/bench/peers.py): the weight layout the triton_kernels adapter
hands over computes our layer, absent peers are reported with their reason, and the CLI takes the flag."""

import torch
import torch.nn.functional as F

from fusedmoe.tools.bench import peers
from fusedmoe.tools.cli import build_parser


def test_triton_kernels_layout_computes_our_swiglu():
    """Its GEMM1 over the adapted weights, then its SwiGLU on adjacent column pairs ``silu(g) * (u + 1)`` with
    the -1 bias, equals ``silu(x @ gate.T) * (x @ up.T)``; its GEMM2 over the w2 view equals ours."""
    g = torch.Generator().manual_seed(0)
    E, H, I = 3, 8, 5
    w1, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    x = torch.randn(4, H, generator=g)
    w1t, w2t, bias = peers.triton_kernels_weights(w1, w2)
    assert w1t.shape == (E, H, 2 * I) and w2t.shape == (E, I, H) and bias.dtype == torch.float32
    for e in range(E):
        h = x @ w1t[e] + bias[e]
        gate, up = h[:, 0::2], h[:, 1::2]
        theirs = F.silu(gate) * (up + 1)
        ours = F.silu(x @ w1[e, :I].T) * (x @ w1[e, I:].T)
        torch.testing.assert_close(theirs, ours)
        torch.testing.assert_close(ours @ w2t[e], ours @ w2[e].T)


def test_absent_peer_is_reported_with_its_reason():
    ok, why = peers.available("vllm")
    if not ok:
        assert "Error" in why
    assert set(peers.MAKERS) == set(peers.PEERS) and set(peers.QUANT_MAKERS) == set(peers.QUANT_PEERS)


def test_check_close_is_relative_to_ours():
    ref = torch.tensor([[2.0, -4.0]])
    assert peers.check_close(ref.clone(), ref) == 0.0
    assert abs(peers.check_close(ref + torch.tensor([[0.4, 0.0]]), ref) - 0.1) < 1e-6


def test_cli_takes_peers():
    args = build_parser().parse_args(["bench", "--peers", "--backends", "triton,triton_heuristic"])
    assert args.peers and args.backends == "triton,triton_heuristic"


def test_mxfp4_layout_for_triton_kernels_holds_our_weights_interleaved_k_major():
    """The tensors handed to triton_kernels' MXFP4 layouts decode to our weight, GEMM1's rows interleaved gate, up
    (its SwiGLU pairs), K-major; the scale groups are padded to a multiple of 4 with zeros past K/32."""
    from fusedmoe.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    g = torch.Generator().manual_seed(0)
    E, I, K = 2, 3, 64  # 2 scale groups per row, padded to 4
    packed, scales = quantize_mxfp4(torch.randn(E, 2 * I, K, generator=g))
    for interleave in (True, False):
        values, group_scales = peers.mxfp4_for_triton_kernels(packed, scales, interleave)
        assert values.shape == (E, K // 2, 2 * I) and group_scales.shape == (E, 4, 2 * I)
        assert (group_scales[:, K // 32 :] == 0).all()
        theirs = dequantize_mxfp4(values.transpose(-2, -1).contiguous(), group_scales[:, : K // 32].mT.contiguous())
        ours = dequantize_mxfp4(packed, scales)
        want = peers.interleave_rows(ours) if interleave else ours
        torch.testing.assert_close(theirs, want, rtol=0, atol=0)
    # interleaving: row 2j is gate row j, row 2j + 1 is up row j
    rows = torch.arange(2 * I).view(1, 2 * I, 1).float()
    assert peers.interleave_rows(rows).flatten().tolist() == [0, 3, 1, 4, 2, 5]


def test_mxfp4_peer_runs_only_an_mxfp4_sweep():
    """The quantized peer takes our quantized weights of its own mode only: a bf16 or fp8 sweep, or an EP slice,
    gets no call (before anything of triton_kernels is imported)."""
    from fusedmoe.quant import QuantConfig
    from fusedmoe.tools.bench.kernel import Shape, _make_call

    shape = Shape("t", 4, 4, 2, 64, 32, {})
    x = w1 = w2 = torch.zeros(1)
    fp8 = {"quant": QuantConfig.parse("fp8_block")}
    mxfp4 = {"quant": QuantConfig.parse("mxfp4")}
    assert _make_call("triton_kernels_mxfp4", shape, x, w1, w2, None, None, None) is None
    assert _make_call("triton_kernels_mxfp4", shape, x, w1, w2, fp8, None, None) is None
    assert _make_call("triton_kernels_mxfp4", shape, x, w1, w2, mxfp4, torch.arange(4), None) is None
    assert peers.QUANT_PEERS == {"triton_kernels_mxfp4": "mxfp4"}
    ok, why = peers.available("triton_kernels_mxfp4")
    if not ok:  # CPU CI: triton_kernels is not installed, and the reason says so
        assert "Error" in why


def test_triton_kernels_routing_covers_the_presets_it_can_compute():
    """gpt-oss's top-k-then-softmax and renormalized softmax are its default (sm_first False), softmax without
    renormalizing its sm_first; grouped, sigmoid or scaled routing get no peer call (None), as do presets using
    them. A random check: its two orders give our routing's weights."""
    from fusedmoe.routing import route
    from fusedmoe.tools.presets import PRESETS

    sm_first = peers._triton_kernels_sm_first
    assert sm_first(PRESETS["gpt-oss-20b"].routing) is False and sm_first(PRESETS["gpt-oss-120b"].routing) is False
    assert sm_first(PRESETS["qwen3-30b-a3b"].routing) is False and sm_first(PRESETS["mixtral-8x7b"].routing) is False
    assert sm_first({"scoring": "softmax", "renormalize": False}) is True
    assert sm_first(PRESETS["deepseek-v3"].routing) is None
    assert sm_first({"scoring": "softmax", "routed_scaling_factor": 2.5}) is None
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    for routing, first in (({"scoring": "softmax_topk"}, False), ({"scoring": "softmax", "renormalize": False}, True)):
        w, ids = route(logits, 4, **routing)
        if first:  # softmax over all experts, then the top 4
            want = torch.softmax(logits, -1).gather(1, ids.long())
        else:  # the top 4 logits, then softmax over them
            want = torch.softmax(logits.gather(1, ids.long()), -1)
        torch.testing.assert_close(w, want)
        assert torch.equal(ids.long().sort(1).values, logits.topk(4).indices.sort(1).values)


def test_peer_that_fails_to_set_up_is_an_error_row_and_ours_still_raise(monkeypatch):
    """A backend whose setup raises (for a peer, say, an API its installed version lacks): a peer's gives its error
    text, so the sweep records it and goes on; our own backends' failures are raised."""
    import pytest

    from fusedmoe.tools.bench import kernel

    def broken(*args):
        raise TypeError("no such layout")

    monkeypatch.setattr(kernel, "_make_call", broken)
    for peer in ("grouped_mm", "triton_kernels", "triton_kernels_mxfp4"):
        assert kernel._call_or_setup_error(peer, "shape") == (None, "TypeError: no such layout")
    for ours in ("triton", "triton_bf16", "torch"):
        with pytest.raises(TypeError, match="no such layout"):
            kernel._call_or_setup_error(ours, "shape")
