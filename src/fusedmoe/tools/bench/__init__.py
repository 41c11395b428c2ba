"""Benchmarks behind ``fusedmoe bench``: kernel sweeps (GPU) and workspace-strategy comparisons."""
