"""Standard layout on one rank: tokens stay where they are, the experts reduce over top-k themselves."""

from __future__ import annotations

from ..problem import Layout
from .base import PrepareFinalize


class LocalPrepareFinalize(PrepareFinalize):
    """No expert parallelism, standard layout: no steps; the experts read the inputs and write the output."""

    layout = Layout.STANDARD
