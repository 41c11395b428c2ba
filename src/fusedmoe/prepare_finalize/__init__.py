"""Prepare (quantize, dispatch, lay out tokens) and finalize (reduce, combine) halves of the modular kernel."""

from .base import PrepareFinalize
from .local import LocalPrepareFinalize

__all__ = ["LocalPrepareFinalize", "PrepareFinalize"]
