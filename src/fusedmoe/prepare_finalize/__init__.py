"""Prepare (quantize, dispatch, lay out tokens) and finalize (reduce, combine) halves of the modular kernel."""

from .all_to_all import AllToAllPrepareFinalize
from .base import PrepareFinalize
from .batched import BatchedCapacityError, BatchedPrepareFinalize
from .local import LocalPrepareFinalize

__all__ = [
    "AllToAllPrepareFinalize",
    "BatchedCapacityError",
    "BatchedPrepareFinalize",
    "LocalPrepareFinalize",
    "PrepareFinalize",
]
