"""MXFP4 weights re-laid for the tensor cores: the ``"mma"`` layout (``QuantConfig("mxfp4", layout="mma")``).

The checkpoint layout (:mod:`fusedmoe.mxfp4`: bytes [..., N, K/2], scales [..., N, K/32]) makes a GPU kernel
shuffle every byte before a tensor-core dot can use it. This layout stores the same codes so that a thread's
plain 16-byte load holds exactly the weights its share of a 16-row tensor-core operand needs (the A operand of
``mma.m16n8k16`` / ``wgmma``, bf16), each 32-bit word decodable into four bf16 pairs by shifts and masks.

Values, uint8 ``[..., R, 8 * Kp]`` with ``R = N / 16`` row blocks and ``Kp`` = K rounded up to 64:

- Row block ``rb`` and 64-column chunk ``kc`` own 512 contiguous bytes: 32 lanes ``L = 4 g + q`` (g < 8, q < 4)
  of 16 bytes, each 4 words ``kt < 4`` (one per 16 columns).
- Word ``(rb, kc, g, q, kt)`` holds the 8 codes of rows ``16 rb + 8 h + g`` (h < 2) and columns
  ``64 kc + 16 kt + 8 j + 2 q + t`` (j, t < 2): the code of (h, j) sits in *slot* ``s = 2 j + h`` of the word's
  16-bit half ``t`` (so every decoded register holds the pair of columns 2q, 2q + 1, as the operand wants).
- Slot bit positions (sign, exponent 1, exponent 0, mantissa of the e2m1 code) inside a half: slot 0 at
  (15, 8, 7, 6), slot 1 at (12, 5, 4, 3), slot 2 at (9, 2, 1, 0), slot 3 at (14, 11, 10, 13). Masking the word
  with ``0x81C081C0`` after shifting it left by 0, 3 or 6 puts slots 0, 1, 2 under bf16's sign, lowest exponent
  bits and top mantissa bit; slot 3 takes three shifts and masks. The bf16 read is the e2m1 value times 2^-126.

Scales, uint8 ``[..., R, Kp / 2]``: for row block ``rb`` and chunk ``kc``, 32 bytes ordered (g, group of 32
columns ``u < 2``, h): the e8m0 byte of row ``16 rb + 8 h + g`` and columns ``64 kc + 32 u ...``, **plus 126**.
A byte shifted under bf16's exponent field then reads 2^(s - 1) = 2^(s - 127) * 2^126, which cancels the decode's
2^-126: one multiply per weight pair applies scale and bias together. That needs s <= 128 (scales up to 2^1,
weights below 12 in magnitude); :func:`to_mma_layout` refuses larger ones.

Gated weights (GEMM1's ``w1`` [E, 2I, H]: gate rows, then up rows) are re-laid with each row block holding the
gate rows of 8 output columns (h = 0) and the up rows of the same columns (h = 1), so one dot computes both and
a thread holds each gate value beside its up value.

Padding (rows to a multiple of 16, columns to a multiple of 64) holds code 0 (+0.0) under scale 1.
"""

from __future__ import annotations

import torch

from .mxfp4 import GROUP, check_mxfp4, pack_codes, unpack_codes

#: Rows per block (the tensor-core operand's M) and columns per chunk of the layout.
ROWS = 16
CHUNK = 64
#: Added to every e8m0 byte: the decode's 2^-126 folded into the scale.
SCALE_OFFSET = 126
#: The largest e8m0 byte the layout holds (SCALE_OFFSET + 128 = 254, bf16's largest finite exponent field).
MAX_SCALE_BYTE = 128
#: Bit positions (sign, exponent bit 1, exponent bit 0, mantissa) of each slot inside a 16-bit half.
SLOT_BITS = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (14, 11, 10, 13))


def padded_k(K: int) -> int:
    """K rounded up to a whole number of 64-column chunks."""
    return -(-K // CHUNK) * CHUNK


def mma_shapes(N: int, K: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(values, scales) shapes, without the leading dims, of an [N, K] weight in the mma layout (N a multiple
    of 16, K of 32)."""
    if N % ROWS or K % GROUP or K <= 0:
        raise ValueError(
            f"the mma layout needs N a multiple of {ROWS} and K a positive multiple of {GROUP}, got {N}, {K}"
        )
    return (N // ROWS, 8 * padded_k(K)), (N // ROWS, padded_k(K) // 2)


def holds_scales(scales: torch.Tensor) -> bool:
    """Whether the layout can hold these e8m0 scale bytes: all at most MAX_SCALE_BYTE (reads the data)."""
    return scales.numel() == 0 or int(scales.max()) <= MAX_SCALE_BYTE


def _gate_up_rows(N: int, device) -> torch.Tensor:
    """Row order of a gated weight [2I, K] in the layout: per 8 output columns, their 8 gate rows then 8 up rows."""
    I = N // 2
    cols = torch.arange(I, device=device).view(-1, 8)
    return torch.stack((cols, cols + I), dim=1).reshape(-1)


def to_mma_layout(packed: torch.Tensor, scales: torch.Tensor, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint-layout MXFP4 weight ``packed`` uint8 [..., N, K/2] / ``scales`` uint8 [..., N, K/32] in the
    mma layout (module docstring): ``(values [..., N/16, 8 Kp], scales [..., N/16, Kp/2])``, new tensors on the
    same device. ``gated``: ``packed`` is GEMM1's gate-then-up weight (N = 2I). Works one leading index (expert)
    at a time, so the temporaries stay a few times one expert's codes.

    Raises ValueError (naming what is wrong) unless N is a multiple of 16 and every scale byte is at most 128."""
    K = check_mxfp4("packed", packed, scales)
    N = packed.shape[-2]
    if N % ROWS:
        raise ValueError(f"the mma layout needs a multiple of {ROWS} rows, got {N}")
    if not holds_scales(scales):
        raise ValueError(
            f"the mma layout holds e8m0 scale bytes up to {MAX_SCALE_BYTE} (2^1), got {int(scales.max())}; "
            "keep such weights in the checkpoint layout (quant='mxfp4')"
        )
    lead = packed.shape[:-2]
    (R, VB), (_, SB) = mma_shapes(N, K)
    Kp = padded_k(K)
    flat_p, flat_s = packed.reshape(-1, N, K // 2), scales.reshape(-1, N, K // GROUP)
    values = torch.empty(flat_p.shape[0], R, VB, dtype=torch.uint8, device=packed.device)
    out_s = torch.empty(flat_p.shape[0], R, SB, dtype=torch.uint8, device=packed.device)
    order = _gate_up_rows(N, packed.device) if gated else None
    for e in range(flat_p.shape[0]):
        codes = torch.zeros(N, Kp, dtype=torch.int32, device=packed.device)
        codes[:, :K] = unpack_codes(flat_p[e]).to(torch.int32)
        s = torch.full((N, Kp // GROUP), 127, dtype=torch.int32, device=packed.device)
        s[:, : K // GROUP] = flat_s[e].to(torch.int32)
        if order is not None:
            codes, s = codes[order], s[order]
        values[e] = _encode_words(codes).view(R, VB)
        # [R, h, g, kc, u] -> [R, kc, g, u, h]
        out_s[e] = (
            (s.view(R, 2, 8, Kp // CHUNK, 2).permute(0, 3, 2, 4, 1) + SCALE_OFFSET).to(torch.uint8).reshape(R, SB)
        )
    return values.reshape(*lead, R, VB), out_s.reshape(*lead, R, SB)


def _encode_words(codes: torch.Tensor) -> torch.Tensor:
    """uint8 bytes [R, Kp * 8] of the words of codes [N, Kp] (int32, N = 16 R)."""
    N, Kp = codes.shape
    R, C = N // ROWS, Kp // CHUNK
    # rows 16 rb + 8 h + g, columns 64 kc + 16 kt + 8 j + 2 q + t -> [R, kc, g, q, kt, j, h, t]
    c = codes.view(R, 2, 8, C, 4, 2, 4, 2).permute(0, 3, 2, 6, 4, 5, 1, 7)
    words = torch.zeros(R, C, 8, 4, 4, dtype=torch.int64, device=codes.device)
    for j in range(2):
        for h in range(2):
            bits = SLOT_BITS[2 * j + h]
            for t in range(2):
                code = c[..., j, h, t].to(torch.int64)
                for b, pos in enumerate(bits):  # code bit 3 - b (sign, e1, e0, mantissa) -> pos in half t
                    words |= ((code >> (3 - b)) & 1) << (pos + 16 * t)
    return _words_to_bytes(words)


def _words_to_bytes(words: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes of 32-bit words held in int64: [..., n] -> uint8 [..., 4 n] flattened at the end."""
    shifts = torch.tensor((0, 8, 16, 24), device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 255).to(torch.uint8).flatten()


def from_mma_layout(
    values: torch.Tensor, scales: torch.Tensor, K: int, gated: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`to_mma_layout`: the checkpoint layout ``(packed [..., N, K/2], scales [..., N, K/32])`` of a
    weight of K columns (the layout pads K to 64, so it is needed). One leading index at a time."""
    R, Kp = values.shape[-2], values.shape[-1] // 8
    if values.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(scales.shape[-2:]) != (R, Kp // 2):
        raise ValueError(
            f"mma-layout MXFP4 must be uint8 values [..., R, 8 Kp] and scales [..., R, Kp/2], got "
            f"{values.dtype} {list(values.shape)} and {scales.dtype} {list(scales.shape)}"
        )
    if K % GROUP or padded_k(K) != Kp:
        raise ValueError(f"K = {K} does not match the layout's {Kp} padded columns")
    N, lead = R * ROWS, values.shape[:-2]
    flat_v, flat_s = values.reshape(-1, R, 8 * Kp), scales.reshape(-1, R, Kp // 2)
    packed = torch.empty(flat_v.shape[0], N, K // 2, dtype=torch.uint8, device=values.device)
    out_s = torch.empty(flat_v.shape[0], N, K // GROUP, dtype=torch.uint8, device=values.device)
    inverse = torch.argsort(_gate_up_rows(N, values.device)) if gated else None
    for e in range(flat_v.shape[0]):
        codes = _decode_words(flat_v[e], Kp)
        s = flat_s[e].view(R, Kp // CHUNK, 8, 2, 2).permute(0, 4, 2, 1, 3).reshape(N, Kp // GROUP).to(torch.int32)
        s = s - SCALE_OFFSET
        if inverse is not None:
            codes, s = codes[inverse], s[inverse]
        packed[e] = pack_codes(codes[:, :K])
        out_s[e] = s[:, : K // GROUP].to(torch.uint8)
    return packed.reshape(*lead, N, K // 2), out_s.reshape(*lead, N, K // GROUP)


def _decode_words(values: torch.Tensor, Kp: int) -> torch.Tensor:
    """Codes [N, Kp] (int32) of one expert's layout bytes [R, 8 Kp]."""
    R, C = values.shape[0], Kp // CHUNK
    b = values.view(R, C, 8, 4, 4, 4).to(torch.int64)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)  # [R, kc, g, q, kt]
    codes = torch.zeros(R, C, 8, 4, 4, 2, 2, 2, dtype=torch.int64, device=values.device)  # [..., j, h, t]
    for j in range(2):
        for h in range(2):
            for t in range(2):
                code = torch.zeros_like(words)
                for b_, pos in enumerate(SLOT_BITS[2 * j + h]):
                    code |= ((words >> (pos + 16 * t)) & 1) << (3 - b_)
                codes[..., j, h, t] = code
    # [R, kc, g, q, kt, j, h, t] -> rows (R, h, g), columns (kc, kt, j, q, t)
    return codes.permute(0, 6, 2, 1, 4, 5, 3, 7).reshape(R * ROWS, Kp).to(torch.int32)


__all__ = [
    "CHUNK",
    "MAX_SCALE_BYTE",
    "ROWS",
    "SCALE_OFFSET",
    "from_mma_layout",
    "mma_shapes",
    "padded_k",
    "to_mma_layout",
]
