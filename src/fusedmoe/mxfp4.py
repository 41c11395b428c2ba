"""MXFP4 expert weights (OCP Microscaling FP4, as gpt-oss checkpoints store them), in torch (CPU-safe).

Layout, as fusedmoe's kernels read it (``quant_mode="mxfp4"`` of :mod:`fusedmoe.ops.grouped_gemm`):

- ``packed`` uint8 [..., N, K / 2]: two e2m1 codes per byte along K, element ``2j`` in the low nibble of byte ``j``
  and ``2j + 1`` in the high nibble. A code is sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0):
  the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
- ``scales`` uint8 [..., N, K / 32]: one e8m0 exponent per 32 consecutive elements of a row, value ``2^(s - 127)``.

gpt-oss checkpoints store the same bytes as ``*_blocks`` [E, N, K / 32, 16] and ``*_scales`` [E, N, K / 32]
(:func:`from_checkpoint_blocks`), with ``gate_up_proj`` rows interleaved gate, up, gate, up, ...
(:func:`split_interleaved_rows` makes fusedmoe's gate rows then up rows).
"""

from __future__ import annotations

import torch

#: Elements per e8m0 scale.
GROUP = 32
#: The value of each e2m1 code 0..15.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: e8m0 bias: scale byte s means 2^(s - SCALE_BIAS).
SCALE_BIAS = 127
#: The largest e2m1 magnitude, 1.5 * 2^2.
E2M1_MAX = 6.0


def check_mxfp4(name: str, packed: object, scales: object, shape: tuple[int, ...] | None = None) -> int:
    """Validate an MXFP4 weight: ``packed`` uint8 [..., N, K/2] and ``scales`` uint8 [..., N, K/32] on one device,
    K a multiple of 32, and (when given) the logical ``shape`` [..., N, K]. Returns K. Raises TypeError /
    ValueError naming ``name``."""
    for suffix, t in (("", packed), ("_scale", scales)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}{suffix} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise TypeError(f"{name}{suffix} must be uint8 (MXFP4: packed e2m1 pairs / e8m0 exponents), got {t.dtype}")
    if packed.dim() < 2:
        raise ValueError(f"{name} must be [..., N, K/2], got shape {list(packed.shape)}")
    K = 2 * packed.shape[-1]
    want = (*packed.shape[:-1], K // GROUP)
    if K == 0 or K % GROUP or tuple(scales.shape) != want:
        raise ValueError(
            f"{name}_scale must be {list(want)} (one e8m0 byte per {GROUP} elements of {name}'s rows, K = {K}, "
            f"a positive multiple of {GROUP}), got {list(scales.shape)}"
        )
    if scales.device != packed.device:
        raise ValueError(f"{name} and {name}_scale are on different devices ({packed.device}, {scales.device})")
    if shape is not None and (*packed.shape[:-1], K) != tuple(shape):
        raise ValueError(f"{name} holds a {[*packed.shape[:-1], K]} MXFP4 weight, expected {list(shape)}")
    return K


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [..., 2n] (uint8) of packed bytes [..., n]: element 2j from byte j's low nibble, 2j + 1 from its
    high nibble."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_codes`: codes [..., 2n] (integers in [0, 16)) as uint8 bytes [..., n]."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [..., N, K] weight in ``dtype`` (exact in float32 and bfloat16 for scales within their range)."""
    K = check_mxfp4("packed", packed, scales)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    rows_p, rows_s = packed.reshape(-1, K // 2), scales.reshape(-1, K // GROUP)
    out = torch.empty(rows_p.shape[0], K, dtype=dtype, device=packed.device)
    for lo, hi in _row_chunks(rows_p.shape[0], K):
        p = rows_p[lo:hi]
        codes = unpack_codes(p)
        exps = rows_s[lo:hi].to(torch.int32) - SCALE_BIAS
        values = torch.ldexp(lut[codes.long()].unflatten(-1, (K // GROUP, GROUP)), exps.unsqueeze(-1).float())
        out[lo:hi] = values.flatten(-2)
    return out.reshape(*packed.shape[:-1], K)


#: Elements per chunk when (de)quantizing: the temporaries take tens of bytes per element, so whole expert stacks
#: (gpt-oss-120b: 2.1e9 elements in w1) are processed a few million elements at a time.
CHUNK_ELEMENTS = 1 << 23


def _row_chunks(rows: int, row_elements: int):
    """``(lo, hi)`` ranges over ``rows`` rows of ``row_elements`` elements, each about CHUNK_ELEMENTS."""
    step = max(1, CHUNK_ELEMENTS // max(row_elements, 1))
    return [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code of each float32 value in [-6, 6], ties to the even code (IEEE round-half-even)."""
    mids = torch.tensor((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0), device=x.device)  # between codes i and i + 1
    a = x.abs().unsqueeze(-1)
    up_on_tie = torch.arange(7, device=x.device) % 2 == 1  # i + 1 even
    code = (a > mids).sum(-1) + ((a == mids) & up_on_tie).sum(-1)
    return (code | torch.where(torch.signbit(x), 8, 0)).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scales)`` of a float weight [..., N, K] (K a multiple of 32): per group of 32, the scale is the
    power of two that brings the group's largest magnitude into [4, 8) (2^-127 for an all-zero group), values are
    rounded to the nearest e2m1 and saturate at +-6. For tests and tiny checkpoints; not a calibrated quantizer."""
    if w.dim() < 2 or w.shape[-1] % GROUP or w.shape[-1] == 0:
        raise ValueError(f"w must be [..., N, K] with K a positive multiple of {GROUP}, got {list(w.shape)}")
    K = w.shape[-1]
    rows = w.reshape(-1, K)
    packed = torch.empty(rows.shape[0], K // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(rows.shape[0], K // GROUP, dtype=torch.uint8, device=w.device)
    for lo, hi in _row_chunks(rows.shape[0], K):
        g = rows[lo:hi].float().unflatten(-1, (K // GROUP, GROUP))
        amax = g.abs().amax(dim=-1)
        exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - 2, -SCALE_BIAS)
        exp = exp.clamp(-SCALE_BIAS, 255 - SCALE_BIAS)
        q = (g / torch.exp2(exp).unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
        codes = _e2m1_codes(q).flatten(-2)
        packed[lo:hi] = pack_codes(codes)
        scales[lo:hi] = (exp + SCALE_BIAS).to(torch.uint8)
    return packed.reshape(*w.shape[:-1], K // 2), scales.reshape(*w.shape[:-1], K // GROUP)


def from_checkpoint_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's ``*_blocks`` [E, N, K/32, 16] and ``*_scales`` [E, N, K/32] as ``(packed [E, N, K/2], scales)``
    (the same bytes: a view when ``blocks`` is contiguous)."""
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 4 or blocks.shape[-1] != GROUP // 2:
        shape = list(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise ValueError(f"blocks must be [E, N, K/{GROUP}, {GROUP // 2}] uint8, got {shape}")
    packed = blocks.flatten(-2)
    check_mxfp4("blocks", packed, scales)
    return packed, scales


def split_interleaved_rows(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's ``gate_up_proj`` rows alternate gate, up; fusedmoe's w1 holds the gate rows, then the up rows.
    Rows are whole quantization groups, so this is a row permutation of both tensors (new contiguous tensors)."""
    if packed.shape[-2] % 2:
        raise ValueError(f"interleaved gate/up weights need an even number of rows, got {packed.shape[-2]}")

    def split(t):
        return torch.cat((t[..., 0::2, :], t[..., 1::2, :]), dim=-2).contiguous()

    return split(packed), split(scales)


__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "GROUP",
    "SCALE_BIAS",
    "check_mxfp4",
    "dequantize_mxfp4",
    "from_checkpoint_blocks",
    "pack_codes",
    "quantize_mxfp4",
    "split_interleaved_rows",
    "unpack_codes",
]
