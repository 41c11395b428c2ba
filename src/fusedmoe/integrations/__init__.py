"""Integrations with model libraries: :mod:`fusedmoe.integrations.hf` (transformers >= 5)."""
