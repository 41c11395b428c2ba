"""The peers of `fusedmoe bench --peers` (tools/bench/peers.py): the weight layout the triton_kernels adapter
hands over computes our layer, absent peers are reported with their reason, and the CLI takes the flag.

vllm_fp8 (vLLM's fp8 Triton MoE kernel run from the wheel's files in .peers): its file lookup and the reasons it
gives when absent, the stand-ins its vLLM imports resolve to, the alignment in vLLM's format, the arguments it
hands over, vLLM's config-table lookup on a fake folder, and (with .peers filled by scripts/fetch-peers) its layer
against the float64 reference under the CPU interpreter and on the GPU.

scaled_grouped_mm (torch._scaled_grouped_mm on our fp8_token weights): its rowwise quantizer, the expert grouping
and padding, the layer on the CPU with a stand-in for the GEMM that first runs torch's own argument checks (its meta
kernel) against the float64 reference, which sweeps it joins and why it is absent; on the GPU, the layer against our
fp8_token call and in a CUDA graph.
"""

import base64
import csv
import hashlib
import importlib.machinery
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from devices import TRITON_DEVICE_DTYPES, TRITON_DEVICES, tolerance

from fusedmoe.tools.bench import peers
from fusedmoe.tools.cli import build_parser

REPO = Path(__file__).resolve().parent.parent


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
    assert peers.QUANT_PEERS["triton_kernels_mxfp4"] == ("mxfp4",)
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
    for peer in ("grouped_mm", "triton_kernels", "triton_kernels_mxfp4", "scaled_grouped_mm"):
        assert kernel._call_or_setup_error(peer, "shape") == (None, "TypeError: no such layout")
    for ours in ("triton", "triton_bf16", "torch"):
        with pytest.raises(TypeError, match="no such layout"):
            kernel._call_or_setup_error(ours, "shape")


# ---- vllm_fp8 ------------------------------------------------------------------------------------------------------


def _vllm_root():
    """The vllm-VERSION folder of this checkout's .peers, or a skip when scripts/fetch-peers has not filled it."""
    try:
        return peers.vllm_peer_folder()
    except FileNotFoundError as exc:
        pytest.skip(f"needs .peers from scripts/fetch-peers: {exc}")


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _fetch_peers_script():
    loader = importlib.machinery.SourceFileLoader("fetch_peers", str(REPO / "scripts" / "fetch-peers"))
    spec = importlib.util.spec_from_loader("fetch_peers", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_quant_peers_of_a_sweep():
    """vllm_fp8 joins every fp8 sweep (static per-tensor scales included), scaled_grouped_mm the per-token one only,
    triton_kernels' MXFP4 path the MXFP4 one, none a bf16 sweep."""
    assert peers.quant_peers("bf16") == []
    assert peers.quant_peers("mxfp4") == ["triton_kernels_mxfp4"]
    for dtype in ("fp8_block", "fp8_tensor", "fp8_tensor_static"):
        assert peers.quant_peers(dtype) == ["vllm_fp8"]
    assert peers.quant_peers("fp8_token") == ["vllm_fp8", "scaled_grouped_mm"]
    assert peers.is_peer("vllm_fp8") and peers.is_peer("scaled_grouped_mm")


def test_fetch_peers_writes_the_files_the_peer_reads():
    """scripts/fetch-peers and the peer agree on the release, the files and how RECORD hashes them (the digest of no
    bytes is the one every RECORD gives an empty file)."""
    script = _fetch_peers_script()
    assert script.VERSION == peers.VLLM_VERSION
    assert set(script.FP8_PEER_FILES) == set(peers.VLLM_PEER_FILES)
    empty = "sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU"
    assert script.sha256_record(b"") == peers._record_digest(b"") == _digest(b"") == empty
    assert script.MAX_MIB < 64


def _fake_vllm(root: Path, files: dict[str, bytes], record_extra: dict[str, str] | None = None) -> Path:
    """A vllm-VERSION folder holding ``files`` and a RECORD listing their digests (``record_extra`` overrides)."""
    folder = root / f"vllm-{peers.VLLM_VERSION}"
    rows = {rel: _digest(data) for rel, data in files.items()}
    rows.update(record_extra or {})
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    info = folder / f"vllm-{peers.VLLM_VERSION}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    with open(info / "RECORD", "w", newline="") as f:
        csv.writer(f).writerows([rel, digest, ""] for rel, digest in rows.items())
    return folder


def test_vllm_fp8_absent_says_why(tmp_path, monkeypatch):
    """Each way the peer's files can be missing or changed is reported as the reason it is absent, and the bench
    then gets no call for it."""
    from fusedmoe.quant import QuantConfig
    from fusedmoe.tools.bench.kernel import Shape, _make_call

    def reason(folder):
        monkeypatch.setenv(peers.PEERS_DIR_ENV, str(folder))
        ok, why = peers.available("vllm_fp8")
        assert not ok
        return why

    assert "no .peers folder" in reason(tmp_path / "nowhere") and "scripts/fetch-peers" in reason(tmp_path / "x")
    (tmp_path / "empty").mkdir()
    assert "has no vllm-VERSION folder" in reason(tmp_path / "empty")
    files = {rel: b"# a file\n" for rel in peers.VLLM_HELPERS}
    _fake_vllm(tmp_path / "no-kernel", files)
    assert f"missing {tmp_path / 'no-kernel'}" in reason(tmp_path / "no-kernel")
    assert peers.VLLM_FUSED_MOE in reason(tmp_path / "no-kernel")
    files[peers.VLLM_FUSED_MOE] = b"# the kernel\n"
    _fake_vllm(tmp_path / "edited", files, {peers.VLLM_FUSED_MOE: _digest(b"# the wheel's kernel\n")})
    assert "is not the file the wheel ships" in reason(tmp_path / "edited")
    folder = _fake_vllm(tmp_path / "extra-table", files)
    (folder / peers.VLLM_CONFIGS).mkdir(parents=True)
    (folder / peers.VLLM_CONFIGS / "E=8,N=64,device_name=NVIDIA_H200,dtype=fp8_w8a8.json").write_text("{}")
    assert "E=8,N=64" in reason(tmp_path / "extra-table")  # a table the wheel does not list is refused too
    shape = Shape("t", 4, 4, 2, 128, 128, {})
    fp8 = {"quant": QuantConfig.parse("fp8_block")}
    assert _make_call("vllm_fp8", shape, torch.zeros(1), None, None, fp8, None, None) is None


def test_stand_ins_resolve_only_the_listed_vllm_modules():
    """Code run with the stand-ins' builtins gets the listed vLLM modules (plain and dotted imports, ``from``
    imports, modules given whole); any other vLLM module, or a name a stand-in lacks, is an ImportError naming it;
    other imports are Python's own."""
    stand_ins = peers._StandIns()
    marker = peers._NotRun("vllm.compiled")
    stand_ins.add({"vllm.a.b": {"x": 1}, "vllm.a": {"y": 2}, "vllm": {"compiled": marker}, "vllm.a.c": marker})
    ns = {"__builtins__": stand_ins.builtins}
    exec(
        "import vllm.a.b as ab\nfrom vllm.a import y\nfrom vllm import compiled\nimport json\nimport vllm.a.c as c", ns
    )
    assert ns["ab"].x == 1 and ns["y"] == 2 and ns["compiled"] is marker and ns["c"] is marker
    assert ns["json"] is json
    with pytest.raises(NotImplementedError, match="vllm.compiled.moe_sum"):
        ns["compiled"].moe_sum(None)
    with pytest.raises(ImportError, match="vllm.distributed"):
        exec("import vllm.distributed", ns)
    with pytest.raises(ImportError, match="has no z"):
        exec("from vllm.a.b import z", ns)


def test_vllm_functions_runs_the_named_functions_of_a_file(tmp_path):
    """A file's named functions run from its source with its non-vLLM imports (a missing one skipped), the
    module-level value of a global they declare, and their decorators; its vLLM imports and other statements are
    not run."""
    src = tmp_path / "helpers.py"
    src.write_text(
        "import functools\nimport not_installed_anywhere\nfrom vllm.platforms import current_platform\n"
        "raise RuntimeError('module body')\n_calls = 0\n\n@functools.lru_cache\ndef twice(n):\n"
        "    global _calls\n    _calls += 1\n    return 2 * n + current_platform\n\ndef unused():\n    pass\n"
    )
    ns = peers.vllm_functions(src, ("twice",), {"current_platform": 100})
    assert ns["twice"](3) == 106 and ns["twice"](3) == 106 and ns["_calls"] == 1  # cached by its decorator
    assert "unused" not in ns and "functools" in ns
    with pytest.raises(ImportError, match="missing_one"):
        peers.vllm_functions(src, ("twice", "missing_one"), {})


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_vllm_align_block_size_gives_vllms_format(device):
    """vLLM's documented example of moe_align_block_size (its docstring: 12 slots, block 4, experts 1-4) comes out
    as vLLM lists it, in buffers of vLLM's sizes; with fewer slots than experts the buffers shrink to
    slots * block as vLLM's do."""
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32, device=device)
    sorted_ids, expert_ids, num_padded = peers.vllm_align_block_size(ids, 4, 5)
    assert sorted_ids.shape == (12 + 5 * 3,) and expert_ids.shape == (7,) and num_padded.tolist() == [16]
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert expert_ids[:4].tolist() == [1, 2, 3, 4]
    ids = torch.tensor([[0, 5]], dtype=torch.int32, device=device)
    sorted_ids, expert_ids, num_padded = peers.vllm_align_block_size(ids, 16, 16)
    assert sorted_ids.shape == (32,) and expert_ids.shape == (2,) and num_padded.tolist() == [32]
    assert sorted_ids.tolist() == [0] + [2] * 15 + [1] + [2] * 15 and expert_ids.tolist() == [0, 5]
    with pytest.raises(NotImplementedError):
        peers.vllm_align_block_size(ids, 16, 16, expert_map=torch.arange(16))


def test_vllm_fp8_arguments_hand_over_our_bytes():
    """The peer runs the very tensors of our quantized call: the same e4m3 weights and float32 scales (channel
    scales as [E, N, 1] views of ours), with vLLM's per-channel and block flags set by the mode."""
    from fusedmoe.quant import QuantConfig, quantize_weights

    E, H, I = 2, 256, 128
    w1, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    for mode, s1_shape, channel, block in (
        ("fp8_tensor", (E,), False, None),
        ("fp8_token", (E, 2 * I, 1), True, None),
        ("fp8_block", (E, 2, 2), False, [128, 128]),
    ):
        quant = QuantConfig.parse(mode)
        w1q, w2q, s1, s2 = quantize_weights(w1, w2, quant)
        quantized = dict(w1=w1q, w2=w2q, quant=quant, w1_scale=s1, w2_scale=s2)
        args = peers.vllm_fp8_arguments(quantized)
        assert args["w1"] is w1q and args["w2"] is w2q and args["w1"].dtype == torch.float8_e4m3fn
        assert args["w1_scale"].shape == s1_shape and args["w1_scale"].data_ptr() == s1.data_ptr()
        assert args["w2_scale"].data_ptr() == s2.data_ptr() and args["w2_scale"].numel() == s2.numel()
        assert args["per_channel_quant"] is channel and args["block_shape"] == block
        assert args["a1_scale"] is None and args["a2_scale"] is None
    quant = QuantConfig.parse("fp8_tensor_static")
    static = torch.full((1,), 0.01)
    quantized = dict(w1=w1q, w2=w2q, quant=quant, w1_scale=s1, w2_scale=s2, a1_scale=static, a2_scale=static)
    assert peers.vllm_fp8_arguments(quantized)["a1_scale"] is static


def test_vllm_files_from_fetch_peers_are_the_wheels():
    """The files scripts/fetch-peers wrote pass the RECORD check, and the module loads with vLLM's kernel and the
    fp8 switches the peer sets."""
    root = _vllm_root()
    peers.check_vllm_files(root)
    vllm = peers.load_vllm_fused_moe(str(root))
    params = vllm.fused_moe_kernel.arg_names
    for flag in ("use_fp8_w8a8", "per_channel_quant", "group_n", "group_k", "SWAP_AB", "USE_TMA_B"):
        assert flag in params
    assert vllm.__file__ == str(root / peers.VLLM_FUSED_MOE)
    assert peers.available("vllm_fp8")[0]


@pytest.fixture
def platform(monkeypatch):
    """VLLM_PLATFORM with its overrides restored after the test."""
    monkeypatch.setattr(peers.VLLM_PLATFORM, "capability", peers.VLLM_PLATFORM.capability)
    monkeypatch.setattr(peers.VLLM_PLATFORM, "device_name", peers.VLLM_PLATFORM.device_name)
    return peers.VLLM_PLATFORM


def test_vllm_config_lookup_on_a_fake_folder(tmp_path, platform):
    """vLLM's own lookup, run on a copy of the wheel's files whose configs folder holds one made-up table: it
    reads the table of (E, N = I, fp8_w8a8, block shape) of an H200-family device (an "H200 NVL" reads
    NVIDIA_H200's), the entry of the nearest M, and falls back to its default config where there is no table (per
    channel, another GPU); the RECORD check refuses the made-up table."""
    root = _vllm_root()
    fake = tmp_path / root.name
    shutil.copytree(root, fake, ignore=shutil.ignore_patterns("*.json"))
    small, big = ({"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1} for m in (16, 64))
    table = fake / peers.VLLM_CONFIGS / "E=4,N=128,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
    table.write_text(json.dumps({"1": small, "64": big, "triton_version": "3.6.0"}))
    with pytest.raises(ValueError, match="not the file the wheel ships"):
        peers.check_vllm_files(fake)
    platform.device_name = "NVIDIA H200 NVL"
    vllm = peers.load_vllm_fused_moe(str(fake), verify=False)
    w1, w2 = (4, 256, 512), (4, 512, 128)

    def config(M, block=(128, 128)):
        return vllm.try_get_optimal_moe_config(w1, w2, 2, "fp8_w8a8", M, block_shape=block and list(block))

    assert config(1) == small and config(20) == small and config(40) == big and config(4096) == big
    default = config(1, None)
    assert default != small and default["BLOCK_SIZE_M"] == 16  # vLLM's default config for 1 token
    platform.device_name = "NVIDIA H100 80GB HBM3"  # a module loaded for another GPU finds no table
    shutil.copytree(fake, tmp_path / "h100" / root.name)
    h100 = peers.load_vllm_fused_moe(str(tmp_path / "h100" / root.name), verify=False)
    assert h100.try_get_optimal_moe_config(w1, w2, 2, "fp8_w8a8", 1, block_shape=[128, 128]) != small


@pytest.mark.parametrize("device,dtype", TRITON_DEVICE_DTYPES)
@pytest.mark.parametrize("mode", ["fp8_block", "fp8_token", "fp8_tensor", "fp8_tensor_static"])
@pytest.mark.parametrize("M", [1, 6])
@pytest.mark.parametrize("hopper", [False, True], ids=["plain", "swap_ab"])
def test_vllm_fp8_layer_matches_the_reference(device, dtype, mode, M, hopper, platform):
    """vLLM's kernel, launched by its own host code on our quantized weights, computes our layer: against the
    float64 reference fed the same e4m3 weights and activations quantized by our rule. M = 1 takes vLLM's
    one-block-per-slot path (slots * 4 <= E), M = 6 the aligned one; "swap_ab" gives the CPU a Hopper capability
    so vLLM's launch picks its swapped-operand variant (on a GPU the device's own capability decides)."""
    from fusedmoe.quant import QuantConfig, quantize_weights
    from fusedmoe.reference import fused_moe_reference
    from fusedmoe.routing import route

    root = _vllm_root()
    if device == "cpu":
        platform.capability = (9, 0) if hopper else None
    elif hopper != (torch.cuda.get_device_capability()[0] == 9):
        pytest.skip("the device's capability decides SWAP_AB")
    vllm = peers.load_vllm_fused_moe(str(root))
    vllm.enable_swap_ab.cache_clear()  # vLLM caches its answer (the capability is fixed in a real process)
    g = torch.Generator().manual_seed(M)
    E, H, I, k = 8, 256, 128, 2
    w1, w2 = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    x, logits = torch.randn(M, H, generator=g).to(device, dtype), torch.randn(M, E, generator=g).to(device)
    quant = QuantConfig.parse(mode)
    w1q, w2q, s1, s2 = (t.to(device) for t in quantize_weights(w1, w2, quant))
    quantized = dict(w1=w1q, w2=w2q, quant=quant, w1_scale=s1, w2_scale=s2)
    if quant.static_activation_scale:
        quantized.update(
            a1_scale=torch.full((1,), 4 / 448, device=device), a2_scale=torch.full((1,), 0.5 / 448, device=device)
        )
    out = peers.make_vllm_fp8(x, quantized, k, {})(logits)
    w, ids = route(logits, k)
    extra = {key: v for key, v in quantized.items() if key not in ("w1", "w2")}
    ref = fused_moe_reference(x.double(), w1q, w2q, w, ids, **extra)
    assert out.dtype == dtype and out.shape == (M, H)
    # the interpreter computes in float32 exactly as the reference rounds; on the GPU the activations of GEMM2 are
    # quantized from GEMM1's rounded (bf16) or fast-accumulated (Hopper's swapped fp8 dot) output, so some e4m3
    # values land one step from the reference's: the repo's quantized tolerance
    assert peers.check_close(out, ref) < (1e-4 if device == "cpu" else tolerance(dtype, quantized=True))
    config = vllm.try_get_optimal_moe_config(w1q.size(), w2q.size(), k, "fp8_w8a8", M, block_shape=None)
    assert (vllm._prepare_expert_assignment(ids, config, M, k, E, None)[0] is None) == (M * k * 4 <= E)
    assert vllm.enable_swap_ab(16, 64) == hopper


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp8_block", "fp8_token", "fp8_tensor"])
def test_vllm_fp8_on_a_preset_shape_matches_ours_and_graphs(mode):
    """On the GPU, qwen3-30b-a3b's shape in bf16: vLLM's layer (its tuned H200 table where the wheel has one: fp8
    blocks of E=128, N=768) agrees with our fp8 call on the same weights and routing, and replays in a CUDA graph
    to the same output (the bench times it that way)."""
    from fusedmoe import fused_moe
    from fusedmoe.quant import QuantConfig, quantize_weights
    from fusedmoe.routing import route

    root = _vllm_root()
    vllm = peers.load_vllm_fused_moe(str(root))
    if mode == "fp8_block" and "H200" in torch.cuda.get_device_name():
        assert vllm.get_moe_configs(128, 768, "fp8_w8a8", 128, 128) is not None
    g = torch.Generator(device="cuda").manual_seed(0)
    E, H, I, k = 128, 2048, 768, 8
    w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) / I**0.5
    quant = QuantConfig.parse(mode)
    w1q, w2q, s1, s2 = quantize_weights(w1, w2, quant)
    quantized = dict(w1=w1q, w2=w2q, quant=quant, w1_scale=s1, w2_scale=s2)
    for M in (1, 256, 4096):
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=g)
        logits = torch.randn(M, E, device="cuda", generator=g)
        call = peers.make_vllm_fp8(x, quantized, k, {})
        out = call(logits)
        w, ids = route(logits, k)
        ours = fused_moe(x, w1q, w2q, w, ids, quant=quant, w1_scale=s1, w2_scale=s2)
        assert peers.check_close(out, ours) < tolerance(torch.bfloat16, quantized=True), (mode, M)
        assert torch.equal(_replayed_in_a_graph(call, logits), out), (mode, M)


def _replayed_in_a_graph(call, logits):
    """``call(logits)`` captured in a CUDA graph and replayed once: the output of the replay."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        replayed = call(logits)
    graph.replay()
    torch.cuda.synchronize()
    return replayed


# ---- scaled_grouped_mm ---------------------------------------------------------------------------------------------


def test_rowwise_quantizer_is_our_fp8_token_rule():
    """One float32 scale per row, max(amax, MIN_AMAX) / 448 (an all-zero row gets a finite one), and the e4m3 values
    of our fp8_token activation quantization, for float32 and bf16 rows."""
    from fusedmoe.quant import activation_scales, fake_quantize_activation

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 48, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    x[2] = 0
    for rows in (x, x.bfloat16()):
        q, scale = peers.quantize_rowwise(rows)
        assert q.dtype == torch.float8_e4m3fn and q.shape == rows.shape and scale.shape == (6,)
        assert scale.dtype == torch.float32 and bool(torch.isfinite(scale).all()) and scale[2] > 0
        torch.testing.assert_close(scale, activation_scales(rows, "fp8_token")[:, 0], rtol=0, atol=0)
        dequantized = (q.float() * scale[:, None]).to(rows.dtype)
        torch.testing.assert_close(dequantized, fake_quantize_activation(rows, "fp8_token"), rtol=0, atol=0)


def test_expert_groups_sort_slots_and_pad_groups():
    """Slots sorted by expert (stably), offsets the cumulative counts; with padding each group starts at a multiple
    of ``align``, holds its slots first, and the operand's row count bounds every routing of the shape."""
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32)  # expert 3 gets nothing
    order, rows, offs, total = peers.expert_groups(ids, 4)
    assert order.tolist() == [1, 4, 3, 0, 2, 5] and rows.tolist() == list(range(6))
    assert offs.dtype == torch.int32 and offs.tolist() == [2, 3, 6, 6] and total == 6
    order, rows, offs, total = peers.expert_groups(ids, 4, align=4)
    assert order.tolist() == [1, 4, 3, 0, 2, 5] and rows.tolist() == [0, 1, 4, 8, 9, 10]
    assert offs.tolist() == [4, 8, 12, 12] and total == 6 + 4 * 3
    g = torch.Generator().manual_seed(0)
    for M, E, k, align in ((1, 8, 2, 16), (37, 8, 2, 16), (64, 128, 8, 16), (5, 16, 4, 1)):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).int()
        order, rows, offs, total = peers.expert_groups(ids, E, align)
        flat = ids.flatten().long()
        assert sorted(order.tolist()) == list(range(M * k)) and sorted(set(rows.tolist())) == sorted(rows.tolist())
        assert offs[-1] <= total and int(rows.max()) < offs[-1]
        starts = torch.cat([offs.new_zeros(1), offs[:-1]]).long()
        sizes = (offs.long() - starts).tolist()
        assert all(size % align == 0 for size in sizes)
        counts = torch.bincount(flat, minlength=E)
        for e in range(E):  # expert e's slots, in slot order, fill the first rows of its group
            mine = [i for i, slot in enumerate(order.tolist()) if flat[slot] == e]
            assert [order[i].item() for i in mine] == sorted(order[i].item() for i in mine)
            assert rows[mine].tolist() == list(range(starts[e], starts[e] + counts[e]))
            assert sizes[e] == -(-int(counts[e]) // align) * align


def _scaled_grouped_mm_on_cpu(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False, sizes=None):
    """torch._scaled_grouped_mm for a 2-D ``a`` grouped along its rows by ``offs`` and a 3-D ``b``, on the CPU:
    torch's own argument checks first (its meta kernel, on meta copies of the arguments: dtypes, row-major a,
    column-major b, scale shapes, int32 offsets), then those its CUDA kernel adds (K and N multiples of 16, fewer
    than 1024 groups, non-decreasing offsets), then per group (a * scale_a) @ (b * scale_b) in float64, returned
    in float64 so the comparison sees the layer's data path rather than bf16 rounding (rows past ``offs[-1]``,
    which the real kernel leaves unwritten, hold NaN). ``sizes`` collects each call's group sizes."""
    meta = [t.to("meta") for t in (a, b, scale_a, scale_b)]
    check = torch.ops.aten._scaled_grouped_mm  # the op itself (a test may stand this function in for torch's)
    shape = check(*meta, offs=offs.to("meta"), out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    assert out_dtype == torch.bfloat16 and shape.shape == (a.shape[0], b.shape[2])
    assert a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0 and b.shape[2] % 16 == 0 and b.shape[0] < 1024
    ends = offs.tolist()
    out = torch.full(shape.shape, float("nan"), dtype=torch.float64)
    start = 0
    for group, end in enumerate(ends):
        assert start <= end <= a.shape[0]
        lhs = a[start:end].double() * scale_a[start:end, None].double()
        out[start:end] = lhs @ (b[group].double() * scale_b[group][None, :].double())
        start = end
    if sizes is not None:
        sizes.append([e - s for s, e in zip([0, *ends[:-1]], ends)])
    return out


def _fp8_token_weights(E, H, I, seed=0, device="cpu"):
    from fusedmoe.quant import QuantConfig, quantize_weights

    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    quant = QuantConfig.parse("fp8_token")
    w1q, w2q, s1, s2 = (t.to(device) for t in quantize_weights(w1, w2, quant))
    return dict(w1=w1q, w2=w2q, quant=quant, w1_scale=s1, w2_scale=s2)


@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("M", [1, 5, 40])
def test_scaled_grouped_mm_layer_matches_the_reference(M, align):
    """The peer's layer, its two GEMMs replaced by the CPU stand-in, computes our fp8_token layer: against the
    float64 reference fed the same e4m3 weights and activations quantized by our rule, within float32 rounding;
    with padding every group it hands over is a multiple of 16 rows."""
    from fusedmoe.reference import fused_moe_reference
    from fusedmoe.routing import route

    E, H, I, k = 8, 64, 32, 2
    quantized = _fp8_token_weights(E, H, I, seed=M)
    g = torch.Generator().manual_seed(M)
    x, logits = torch.randn(M, H, generator=g), torch.randn(M, E, generator=g)
    w, ids = route(logits, k)
    sizes = []

    def stand_in(*args, **kwargs):
        return _scaled_grouped_mm_on_cpu(*args, **kwargs, sizes=sizes)

    args = [quantized[key] for key in ("w1", "w2", "w1_scale", "w2_scale")]
    out = peers.scaled_grouped_mm_experts(x, w, ids, *args, align=align, grouped_mm=stand_in)
    extra = {key: v for key, v in quantized.items() if key not in ("w1", "w2")}
    ref = fused_moe_reference(x.double(), quantized["w1"], quantized["w2"], w, ids, **extra)
    assert out.dtype == x.dtype and out.shape == (M, H)
    assert peers.check_close(out, ref) < 1e-5
    assert len(sizes) == 2 and sizes[0] == sizes[1] and len(sizes[0]) == E
    assert all(size % align == 0 for size in sizes[0]) and sum(sizes[0]) >= M * k


def test_scaled_grouped_mm_peer_runs_fp8_token_sweeps_only(monkeypatch):
    """The bench gets a call for an fp8_token sweep (through ``_make_call``, routing included, with torch's GEMM
    stood in for here) that computes our layer; none for other weight modes, an expert-parallel slice, or H or I
    not a multiple of 16; and where the peer cannot run it says why."""
    from fusedmoe.quant import QuantConfig
    from fusedmoe.reference import fused_moe_reference
    from fusedmoe.routing import route
    from fusedmoe.tools.bench.kernel import Shape, _make_call

    assert peers.QUANT_PEERS["scaled_grouped_mm"] == ("fp8_token",)
    ok, why = peers.available("scaled_grouped_mm")
    if not torch.cuda.is_available():
        assert not ok and "compute capability 9.0" in why
    monkeypatch.setattr(peers, "scaled_grouped_mm_absent", lambda: None)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _scaled_grouped_mm_on_cpu)
    E, H, I, k = 8, 64, 32, 2
    shape = Shape("t", E, E, k, H, I, {})
    quantized = _fp8_token_weights(E, H, I)
    x, logits = torch.randn(6, H), torch.randn(6, E)
    call = _make_call("scaled_grouped_mm", shape, x, None, None, quantized, None, None)
    w, ids = route(logits, k)
    extra = {key: v for key, v in quantized.items() if key not in ("w1", "w2")}
    ref = fused_moe_reference(x.double(), quantized["w1"], quantized["w2"], w, ids, **extra)
    assert peers.check_close(call(logits), ref) < 1e-5
    for mode in ("fp8_tensor", "fp8_block", "mxfp4"):
        other = {"quant": QuantConfig.parse(mode)}
        assert _make_call("scaled_grouped_mm", shape, x, None, None, other, None, None) is None
        assert peers.make_scaled_grouped_mm(x, other, k, {}) is None
    assert _make_call("scaled_grouped_mm", shape, x, None, None, quantized, torch.arange(E), None) is None
    for H, I in ((40, 32), (64, 24)):
        assert peers.make_scaled_grouped_mm(torch.randn(2, H), _fp8_token_weights(E, H, I), k, {}) is None


def test_scaled_grouped_mm_absent_says_why(monkeypatch):
    """A torch without the op is named; the padding is 16 rows for a torch older than 2.9 only."""
    monkeypatch.delattr(torch, "_scaled_grouped_mm")
    ok, why = peers.available("scaled_grouped_mm")
    assert not ok and "has no torch._scaled_grouped_mm" in why and torch.__version__ in why
    for version, align in (("2.7.1+cu126", 16), ("2.8.0", 16), ("2.9.0", 1), ("2.11.0+cu128", 1)):
        monkeypatch.setattr(torch, "__version__", version)
        assert peers.scaled_grouped_mm_row_align() == align


@pytest.mark.gpu
@pytest.mark.parametrize("align", [1, 16])
def test_scaled_grouped_mm_on_the_gpu_matches_ours_and_graphs(align):
    """On the GPU, a small shape and qwen3-30b-a3b's: the bench's call of torch._scaled_grouped_mm's layer (routing
    included; unpadded as it runs on torch 2.9+, and with 16-row groups as on an older torch) agrees with our
    fp8_token call on the same weights and routing and with the float64 reference, and replays in a CUDA graph to
    the same output (the bench times it that way)."""
    from fusedmoe import fused_moe
    from fusedmoe.reference import fused_moe_reference
    from fusedmoe.routing import route

    why = peers.scaled_grouped_mm_absent()
    if why:
        pytest.skip(why)
    for E, H, I, k in ((16, 256, 128, 4), (128, 2048, 768, 8)):
        quantized = _fp8_token_weights(E, H, I, device="cuda")
        extra = {key: v for key, v in quantized.items() if key not in ("w1", "w2")}
        g = torch.Generator(device="cuda").manual_seed(0)
        for M in (1, 33, 512):
            x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=g)
            logits = torch.randn(M, E, device="cuda", generator=g)
            call = peers.make_scaled_grouped_mm(x, quantized, k, {}, align=align)
            out = call(logits)
            w, ids = route(logits, k)
            ours = fused_moe(x, quantized["w1"], quantized["w2"], w, ids, **extra)
            ref = fused_moe_reference(x.double(), quantized["w1"], quantized["w2"], w, ids, **extra)
            assert out.dtype == torch.bfloat16 and out.shape == (M, H)
            assert peers.check_close(out, ours) < tolerance(torch.bfloat16, quantized=True), (E, M)
            assert peers.check_close(out, ref) < tolerance(torch.bfloat16, quantized=True), (E, M)
            assert torch.equal(_replayed_in_a_graph(call, logits), out), (E, M)
