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
    assert set(peers.MAKERS) == set(peers.PEERS)


def test_check_close_is_relative_to_ours():
    ref = torch.tensor([[2.0, -4.0]])
    assert peers.check_close(ref.clone(), ref) == 0.0
    assert abs(peers.check_close(ref + torch.tensor([[0.4, 0.0]]), ref) - 0.1) < 1e-6


def test_cli_takes_peers():
    args = build_parser().parse_args(["bench", "--peers", "--backends", "triton,triton_heuristic"])
    assert args.peers and args.backends == "triton,triton_heuristic"
