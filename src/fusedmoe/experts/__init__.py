"""Experts implementations of the modular kernel."""

from .base import Experts, ExpertsInputs
from .batched_torch_experts import BatchedTorchExperts
from .torch_experts import TorchExperts

__all__ = ["BatchedTorchExperts", "Experts", "ExpertsInputs", "TorchExperts"]
