"""Experts implementations of the modular kernel."""

from .base import Experts, ExpertsInputs
from .torch_experts import TorchExperts

__all__ = ["Experts", "ExpertsInputs", "TorchExperts"]
