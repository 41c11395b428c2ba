"""The gated activations' backward in torch: d(act) -> d(gate, up), any float dtype.

The forward is :func:`fusedmoe.reference.activation_reference`; the Triton backward kernels implement the same
formulas in their epilogues. Where the forward clamps (gpt-oss's ``swigluoai``), the gradient passes where the
clamp leaves its input unchanged, bounds included, as torch's ``clamp`` backward does.
"""

from __future__ import annotations

import math

import torch

from ..problem import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def gated_activation_backward(gate_up: torch.Tensor, grad_act: torch.Tensor, activation: str) -> torch.Tensor:
    """Gradient of ``act(gate) * up`` (``gate_up`` [..., 2I], gate half first) for ``grad_act`` [..., I].

    Returns [..., 2I] (d gate, d up) in the promoted dtype of the two inputs.
    """
    inter = gate_up.shape[-1] // 2
    g, u = gate_up[..., :inter], gate_up[..., inter:]
    if activation == "silu":
        s = torch.sigmoid(g)
        act_g, d_act_g = g * s, s * (1.0 + g * (1.0 - s))
    elif activation == "gelu":
        t = torch.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g**3))
        act_g = 0.5 * g * (1.0 + t)
        d_act_g = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * g * g)
    elif activation == "gelu_exact":
        cdf = 0.5 * (1.0 + torch.erf(g / math.sqrt(2.0)))
        act_g, d_act_g = g * cdf, cdf + g * _INV_SQRT_2PI * torch.exp(-0.5 * g * g)
    elif activation == "swigluoai":
        gc = g.clamp(max=SWIGLUOAI_LIMIT)
        s = torch.sigmoid(SWIGLUOAI_ALPHA * gc)
        act_g = gc * s
        d_act_g = (s * (1.0 + SWIGLUOAI_ALPHA * gc * (1.0 - s))) * (g <= SWIGLUOAI_LIMIT)
        u_in = (u >= -SWIGLUOAI_LIMIT) & (u <= SWIGLUOAI_LIMIT)
        return torch.cat(
            [grad_act * d_act_g * (u.clamp(-SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT) + 1.0), grad_act * act_g * u_in], -1
        )
    else:
        raise ValueError(f"activation must be 'silu', 'gelu', 'swigluoai' or 'gelu_exact', got {activation!r}")
    return torch.cat([grad_act * d_act_g * u, grad_act * act_g], -1)
