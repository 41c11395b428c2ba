"""Printing and saving benchmark results: a rich table when rich is installed, plain text otherwise, JSON."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import torch


def environment() -> dict[str, object]:
    """Machine, versions and commit, stamped on every result file."""
    info: dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.node(),
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    # $FUSEDMOE_COMMIT first: a copied working tree (the GPU machine's) may carry a stale .git
    info["commit"] = os.environ.get("FUSEDMOE_COMMIT")
    if not info["commit"]:
        try:
            root = Path(__file__).resolve().parents[4]
            info["commit"] = (
                subprocess.run(
                    ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
                ).stdout.strip()
                or None
            )
        except Exception:
            info["commit"] = None
    return info


def print_table(title: str, columns: list[str], rows: list[list[object]]) -> None:
    cells = [[_fmt(v) for v in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for c in columns:
            table.add_column(c, justify="right" if c not in ("strategy", "backend", "shape") else "left")
        for row in cells:
            table.add_row(*row)
        Console(width=200).print(table)
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
        print(title)
        print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
        for row in cells:
            print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.2f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def pyplot():
    """``matplotlib.pyplot`` drawing to files only (the Agg backend), or None, said on stdout, without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt


def save_json(path: str | os.PathLike, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (a run killed mid-write leaves the previous file whole)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    os.replace(tmp, path)
