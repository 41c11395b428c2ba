"""Input signatures: the part of a call's tensors that validation and kernel launches depend on.

A call's validation verdict (the :class:`~fusedmoe.problem.MoEProblem` it describes, or the error it raises)
and every launch argument besides the data pointers are functions of each tensor's shape, strides, dtype and
device, and of its address's alignment: 16 bytes (Triton specializes pointer arguments on that) or 4 (MXFP4's
one-row loop reads packed weights as 32-bit words, and validation refuses them otherwise). Two
calls with equal signatures therefore validate alike and launch alike, so the entry points cache both per
signature and only recompute them when it changes.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["input_signature"]

_PLAIN = (torch.Tensor, nn.Parameter)


def input_signature(*tensors: object) -> tuple | None:
    """``(shape, strides, dtype, device index, 16-byte aligned, 4-byte aligned)`` per tensor (None for None), or
    None when an argument is neither a plain tensor nor None (a subclass, a wrong type: the full validation handles
    it)."""
    sig = []
    for t in tensors:
        if t is None:
            sig.append(None)
        elif type(t) in _PLAIN:
            ptr = t.data_ptr()
            sig.append((t.shape, t.stride(), t.dtype, t.get_device(), not ptr & 15, not ptr & 3))
        else:
            return None
    return tuple(sig)
