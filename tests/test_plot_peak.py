"""scripts/plot_peak.py: the fraction-of-peak figure of BENCHMARKS.md, drawn from `fusedmoe bench --json` files."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "plot_peak.py")


def _run_json(name: str, peak: float) -> dict:
    """A bench JSON as `fusedmoe bench --json` writes it, reduced to what the plot reads (an error row included)."""
    rows = [{"backend": b, "M": m, "us": 1.0, "tflops": peak * f} for b, f in (("triton", 0.6), ("grouped_mm", 0.4))
            for m in (1024, 4096, 16384)]  # fmt: skip
    rows.append({"backend": "triton_kernels", "M": 1024, "error": "setup failed"})
    return {"env": {"commit": "abc1234"}, "ceilings": {"bf16_tflops": peak}, "shape": {"name": name}, "dtype": "bf16",
            "results": rows}  # fmt: skip


def test_plot_peak_draws_one_panel_per_run(tmp_path):
    pytest.importorskip("matplotlib")
    paths = []
    for name, peak in (("qwen3-30b-a3b", 790.0), ("mixtral-8x7b", 760.0)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(_run_json(name, peak)))
        paths.append(str(path))
    out = tmp_path / "peak.png"
    run = subprocess.run([sys.executable, SCRIPT, str(out), *paths], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
