"""Quantization settings and helpers: fp8 (e4m3) w8a8 and MXFP4 weight-only (w4a16).

Four schemes, named as the CLI and ``QuantConfig.parse`` accept them:

- ``fp8_tensor``: one scale per expert weight matrix (``w1_scale``/``w2_scale`` float32 [E]); activation scale
  per tensor, static (``a1_scale``/``a2_scale`` float32 [1] given by the caller) or dynamic (computed per call).
- ``fp8_token``: per-token activation scales x per-output-channel weight scales
  (``w1_scale`` [E, 2I], ``w2_scale`` [E, H]; activation scales [rows, 1], always dynamic).
- ``fp8_block``: 128x128 weight blocks (``w1_scale`` [E, ceil(2I/128), ceil(H/128)],
  ``w2_scale`` [E, ceil(H/128), ceil(I/128)]) and per-token, per-128-column activation groups (DeepSeek-V3).
- ``mxfp4``: weights only (gpt-oss): ``w1`` uint8 [E, 2I, H/2] and ``w2`` uint8 [E, H, I/2] hold two e2m1 codes
  per byte, ``w1_scale`` uint8 [E, 2I, H/32] and ``w2_scale`` uint8 [E, H, I/32] one e8m0 exponent per 32
  elements (:mod:`fusedmoe.mxfp4`); activations stay bf16/fp16/fp32 and take no scales.
- ``mxfp4_mma`` (``QuantConfig("mxfp4", layout="mma")``): the same weights re-laid for the tensor cores
  (:mod:`fusedmoe.mxfp4_layout`): ``w1`` [E, 2I/16, 8 Kp(H)] with gate and up rows interleaved per 8 columns,
  ``w2`` [E, H/16, 8 Kp(I)], scales [E, 2I/16, Kp(H)/2] and [E, H/16, Kp(I)/2] (Kp: K rounded up to 64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
QUANT_MODES = ("fp8_tensor", "fp8_token", "fp8_block", "mxfp4")
#: The modes that quantize activations to fp8 (w8a8); the others leave them in the input dtype.
FP8_MODES = ("fp8_tensor", "fp8_token", "fp8_block")


@dataclass(frozen=True)
class QuantConfig:
    """How weights and activations are quantized.

    Attributes:
        mode: one of ``QUANT_MODES``.
        static_activation_scale: ``fp8_tensor`` only: the caller passes ``a1_scale`` and ``a2_scale``.
        block_shape: ``fp8_block`` only: (block_n, block_k) of the weight scales (default 128x128).
        layout: ``mxfp4`` only: ``"checkpoint"`` (default; the bytes as checkpoints store them) or ``"mma"``
            (re-laid for the tensor cores by :func:`fusedmoe.mxfp4_layout.to_mma_layout`; named ``"mxfp4_mma"``).
    """

    mode: str
    static_activation_scale: bool = False
    block_shape: tuple[int, int] = (128, 128)
    layout: str = "checkpoint"

    def __post_init__(self) -> None:
        if self.mode not in QUANT_MODES:
            raise ValueError(f"quant mode must be one of {QUANT_MODES}, got {self.mode!r}")
        if self.static_activation_scale and self.mode != "fp8_tensor":
            raise ValueError("static_activation_scale is only defined for quant mode 'fp8_tensor'")
        if self.layout not in ("checkpoint", "mma") or (self.layout == "mma" and self.mode != "mxfp4"):
            raise ValueError(f"layout must be 'checkpoint', or 'mma' for mode 'mxfp4', got {self.layout!r}")
        object.__setattr__(self, "block_shape", tuple(int(b) for b in self.block_shape))

    @classmethod
    def parse(cls, spec: QuantConfig | str | None) -> QuantConfig | None:
        """Accept a QuantConfig, a mode name (``"fp8_tensor_static"`` for static scales) or None."""
        if spec is None or isinstance(spec, QuantConfig):
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"quant must be a QuantConfig, a mode name or None, got {type(spec).__name__}")
        if spec == "fp8_tensor_static":
            return cls("fp8_tensor", static_activation_scale=True)
        if spec == "mxfp4_mma":
            return cls("mxfp4", layout="mma")
        return cls(spec)

    @property
    def name(self) -> str:
        """The mode's name as :meth:`parse` takes it."""
        if self.layout == "mma":
            return "mxfp4_mma"
        return "fp8_tensor_static" if self.static_activation_scale else self.mode

    @property
    def kernel_mode(self) -> str:
        """What the Triton kernels read: the mode, or ``"mxfp4_mma"`` for MXFP4 in the mma layout."""
        return "mxfp4_mma" if self.layout == "mma" else self.mode

    @property
    def fp8(self) -> bool:
        """Whether activations are quantized to fp8 too (w8a8); False for weight-only MXFP4."""
        return self.mode in FP8_MODES


def quantized_layout(quant: QuantConfig, E: int, H: int, I: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{"w1", "w2", "w1_scale", "w2_scale": (shape, dtype)}`` of ``quant``'s expert weights for E experts of
    hidden size H and intermediate size I, as ``fused_moe`` takes them (the checkpoints' layouts; MXFP4 packs
    two elements per byte along the last axis, so H and I must be multiples of 32)."""
    if quant.mode == "mxfp4":
        from .mxfp4 import GROUP

        if H % GROUP or I % GROUP:
            raise ValueError(f"quant='mxfp4' needs hidden and intermediate sizes divisible by {GROUP}, got {H}, {I}")
        u8 = torch.uint8
        if quant.layout == "mma":
            from .mxfp4_layout import mma_shapes

            (v1, s1), (v2, s2) = mma_shapes(2 * I, H), mma_shapes(H, I)
            return {"w1": ((E, *v1), u8), "w2": ((E, *v2), u8), "w1_scale": ((E, *s1), u8), "w2_scale": ((E, *s2), u8)}
        return {
            "w1": ((E, 2 * I, H // 2), u8),
            "w2": ((E, H, I // 2), u8),
            "w1_scale": ((E, 2 * I, H // GROUP), u8),
            "w2_scale": ((E, H, I // GROUP), u8),
        }
    if quant.mode == "fp8_tensor":
        s1, s2 = (E,), (E,)
    elif quant.mode == "fp8_token":
        s1, s2 = (E, 2 * I), (E, H)
    else:
        bn, bk = quant.block_shape
        s1, s2 = (E, -(-2 * I // bn), -(-H // bk)), (E, -(-H // bn), -(-I // bk))
    f32 = torch.float32
    return {
        "w1": ((E, 2 * I, H), FP8_DTYPE),
        "w2": ((E, H, I), FP8_DTYPE),
        "w1_scale": (s1, f32),
        "w2_scale": (s2, f32),
    }


# ---- torch helpers (CPU-safe) ---------------------------------------------------------------------------------
#: Floor of an amax before it becomes a scale, so an all-zero group gets a finite, non-zero scale.
#: The Triton quantization kernels use the same constant and the same rule: scale = max(amax, MIN_AMAX) / FP8_MAX,
#: q = clamp(x / scale, -FP8_MAX, FP8_MAX) rounded to nearest e4m3.
MIN_AMAX = 1e-10


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale (broadcast), saturated to +-FP8_MAX, rounded to e4m3. Math in float32."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp(min=MIN_AMAX) / FP8_MAX


def _block_amax(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """amax of |w| over (bn x bk) tiles of the last two dims (edge tiles partial): [..., cdiv(N,bn), cdiv(K,bk)]."""
    *lead, n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros((*lead, nb * bn, kb * bk), dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w.float().abs()
    return padded.view(*lead, nb, bn, kb, bk).amax(dim=(-3, -1))


def _expand_blocks(scale: torch.Tensor, n: int, k: int, bn: int, bk: int) -> torch.Tensor:
    """Broadcast per-tile scales [..., nb, kb] back to [..., n, k]."""
    return scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


#: Elements of expert weights quantized to fp8 at once (1 GiB of float32 temporaries).
_CHUNK_ELEMENTS = 1 << 28


def _fp8_experts(w: torch.Tensor, quant: QuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weights, float32 scales) of the experts ``w`` [e, N, K] in ``quant``'s fp8 mode."""
    if quant.mode == "fp8_tensor":
        scale = _scale_of(w.float().abs().amax(dim=(1, 2)))
        return _to_fp8(w, scale[:, None, None]), scale
    if quant.mode == "fp8_token":
        scale = _scale_of(w.float().abs().amax(dim=2))
        return _to_fp8(w, scale[:, :, None]), scale
    bn, bk = quant.block_shape
    scale = _scale_of(_block_amax(w, bn, bk))
    return _to_fp8(w, _expand_blocks(scale, w.shape[1], w.shape[2], bn, bk)), scale


def quantize_weights(
    w1: torch.Tensor, w2: torch.Tensor, quant: QuantConfig | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize expert weights to e4m3 with float32 scales for ``quant``'s mode (mxfp4: packed e2m1 codes and e8m0
    scales, :func:`fusedmoe.mxfp4.quantize_mxfp4`).

    Args:
        w1: [E, 2I, H] float (bf16/fp16/fp32). w2: [E, H, I] float.
        quant: a QuantConfig or mode name.

    Returns:
        (w1q, w2q, w1_scale, w2_scale): w1q/w2q e4m3 of the same shapes; scales float32 shaped per mode
        (see the module docstring): fp8_tensor [E]; fp8_token [E, 2I] / [E, H]; fp8_block
        [E, cdiv(2I,bn), cdiv(H,bk)] / [E, cdiv(H,bn), cdiv(I,bk)]. ``w ~= dequantize_weight(wq, scale)``.
    """
    quant = QuantConfig.parse(quant)
    out = []
    for w, gated in ((w1, True), (w2, False)):
        if w.dim() != 3:
            raise ValueError(f"expert weights must be 3-D [E, N, K], got shape {tuple(w.shape)}")
        if quant.mode == "mxfp4":
            from .mxfp4 import quantize_mxfp4

            packed = quantize_mxfp4(w)
            if quant.layout == "mma":
                from .mxfp4_layout import to_mma_layout

                packed = to_mma_layout(*packed, gated=gated)
            out.append(packed)
            continue
        # a few experts at a time, so the float32 temporaries stay near _CHUNK_ELEMENTS (the whole DeepSeek-V3
        # GEMM1 in float32 would take 30 GB)
        step = max(1, _CHUNK_ELEMENTS // max(1, w.shape[1] * w.shape[2]))
        parts = [_fp8_experts(w[e : e + step], quant) for e in range(0, max(w.shape[0], 1), step)]
        out.append(tuple(torch.cat(t) if len(parts) > 1 else t[0] for t in zip(*parts)))
    (w1q, s1), (w2q, s2) = out
    return w1q, w2q, s1, s2


def dequantize_weight(
    wq: torch.Tensor,
    scale: torch.Tensor,
    quant: QuantConfig | str,
    dtype: torch.dtype = torch.float32,
    *,
    K: int | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """Inverse of :func:`quantize_weights` for one weight: [E, N, K] in ``dtype`` (``wq``'s shape; MXFP4: K is
    twice its last dimension, decoded straight into ``dtype``). The mma layout pads K and may interleave rows: it
    needs the weight's ``K`` and whether it is GEMM1's ``gated`` weight (gate rows, then up rows, come back)."""
    quant = QuantConfig.parse(quant)
    if quant.mode == "mxfp4":
        from .mxfp4 import dequantize_mxfp4

        if quant.layout == "mma":
            from .mxfp4_layout import from_mma_layout

            if K is None:
                raise ValueError("dequantizing an mma-layout MXFP4 weight needs its K")
            wq, scale = from_mma_layout(wq, scale, K, gated)
        return dequantize_mxfp4(wq, scale, dtype)
    w = wq.float()
    scale = scale.float()
    if quant.mode == "fp8_tensor":
        w = w * scale.reshape(-1, 1, 1)
    elif quant.mode == "fp8_token":
        w = w * scale[:, :, None]
    else:
        bn, bk = quant.block_shape
        w = w * _expand_blocks(scale, w.shape[1], w.shape[2], bn, bk)
    return w.to(dtype)


def activation_scales(x: torch.Tensor, quant: QuantConfig | str, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 activation scales our kernels use for x [rows, K].

    fp8_tensor: [1] (``scale`` if given, else max(amax over all of x, MIN_AMAX) / 448); fp8_token: [rows, 1];
    fp8_block: [rows, cdiv(K, block_k)] (one scale per row and group of block_k columns).
    """
    quant = QuantConfig.parse(quant)
    xf = x.float()
    if quant.mode == "fp8_tensor":
        if scale is not None:
            return scale.float().reshape(1)
        amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
        return _scale_of(amax).reshape(1)
    if scale is not None:
        raise ValueError(f"a static activation scale is only defined for fp8_tensor, not {quant.mode}")
    if quant.mode == "fp8_token":
        if xf.shape[1] == 0:
            return _scale_of(torch.zeros(xf.shape[0], 1, device=x.device))
        return _scale_of(xf.abs().amax(dim=1, keepdim=True))
    bk = quant.block_shape[1]
    return _scale_of(_block_amax(xf[:, None, :], 1, bk)[:, 0, :])


def fake_quantize_activation(
    x: torch.Tensor, quant: QuantConfig | str, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantize x [rows, K] to e4m3 exactly as our kernels do, then dequantize.

    Scales from :func:`activation_scales` (per-tensor dynamic: over all the rows given; pass only the valid
    rows). Returns a tensor of x's shape and dtype.
    """
    quant = QuantConfig.parse(quant)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, K], got shape {tuple(x.shape)}")
    s = per_element_scales(activation_scales(x, quant, scale), quant, x.shape[1])
    q = _to_fp8(x, s)
    return (q.float() * s).to(x.dtype)


def per_element_scales(scale: torch.Tensor, quant: QuantConfig, K: int) -> torch.Tensor:
    """Activation scales as :func:`activation_scales` gives them ([1], [rows, 1], [rows, cdiv(K, bk)]) in a shape
    that broadcasts over the activations [rows, K]: fp8_block's group scales repeated over their columns."""
    if quant.mode == "fp8_block":
        return scale.repeat_interleave(quant.block_shape[1], dim=1)[:, :K]
    return scale
