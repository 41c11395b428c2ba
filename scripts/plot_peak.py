"""Fraction of the bf16 matmul peak against M, one panel per preset, one line per backend, from the JSON files of
`fusedmoe bench --json` (the peak is the ceiling measured at the start of each run).

Usage: python scripts/plot_peak.py OUT.png RUN.json [RUN.json ...]
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, paths = argv[0], argv[1:]
    runs = [json.load(open(p)) for p in paths]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4.2), squeeze=False)
    for ax, run in zip(axes[0], runs):
        peak = run["ceilings"]["bf16_tflops"]
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in run["results"]:
            if "us" in r:
                lines.setdefault(r["backend"], []).append((r["M"], 100.0 * r["tflops"] / peak))
        for backend, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([m for m, _ in pts], [f for _, f in pts], marker="o", label=backend)
        ax.axhline(80, color="k", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 100)
        ax.set_xlabel("tokens (M)")
        ax.set_ylabel(f"% of bf16 matmul peak ({peak:.0f} TFLOP/s, measured)")
        ax.set_title(f"{run['shape']['name']} {run['dtype']} (commit {run['env'].get('commit')})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
