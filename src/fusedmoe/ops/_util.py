"""Host-side integer helpers for kernel wrappers.

``triton.cdiv`` and ``triton.next_power_of_2`` are ConstexprFunction objects in Triton 3.6: calling them from
Python costs microseconds each, and the wrappers call them on every launch. These are plain functions.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
