"""Helpers shared by the tests/test_hardening_*.py files: switching the decode path, intercepting a launch."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def decode_path(on: bool):
    """Switch the Triton decode path on or off for the duration (restoring the process setting)."""
    from fusedmoe.api import set_decode_path
    from fusedmoe.ops import decode

    old = decode.ENABLED
    set_decode_path(on)
    try:
        yield
    finally:
        set_decode_path(old)


class Launch:
    """Stands in for a @triton.jit kernel in its module: ``kernel[grid](...)`` runs inside ``around()``."""

    def __init__(self, real, around):
        self.real, self.around = real, around

    def __getitem__(self, grid):
        def launch(*a, **k):
            with self.around():
                return self.real[grid](*a, **k)

        return launch
