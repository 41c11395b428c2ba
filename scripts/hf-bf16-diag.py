"""Where does the bf16 difference between a patched and an unpatched transformers model come from?

For every tiny architecture of tests/hf_tiny.py, on the GPU: the float32 eager logits are the truth; the bf16
logits of transformers' eager experts, of its own ``grouped_mm`` / ``batched_mm`` experts, of fusedmoe through
``set_experts_implementation`` and of fusedmoe through ``patch_model`` are each compared with that truth and
with bf16 eager (the tests' bound is patched vs unpatched < 2e-2). One experts module is also checked alone,
in bf16, against its float64 computation. Usage: PYTHONPATH=src python3 scripts/hf-bf16-diag.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_tiny import ARCHS, prompt, routed_logits, routes_differ, tiny_model  # noqa: E402

from fusedmoe.integrations import hf  # noqa: E402
from fusedmoe.reference import relative_error  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def experts_alone(arch: str) -> dict[str, float]:
    """One experts module on random hidden states with transformers' own routing: eager bf16 and fusedmoe bf16
    vs the same module in float64."""
    model = tiny_model(arch, dtype=torch.bfloat16, device=DEV)
    experts = hf.experts_modules(model)[0]
    E = experts.num_experts
    g = torch.Generator(device=DEV).manual_seed(3)
    h = torch.randn(24, model.config.hidden_size, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=DEV, generator=g)[:2] for _ in range(24)])
    w = torch.softmax(torch.randn(24, 2, device=DEV, generator=g), -1).to(torch.bfloat16)
    out = {}
    with torch.no_grad():
        model.set_experts_implementation("eager")
        eager = experts(h, ids, w).double()
        model.set_experts_implementation("fusedmoe")
        ours = experts(h, ids, w).double()
        model.double()
        model.set_experts_implementation("eager")
        truth = experts(h.double(), ids, w.double())
    out["eager_bf16_vs_f64"] = relative_error(eager, truth)
    out["fusedmoe_bf16_vs_f64"] = relative_error(ours, truth)
    return out


def main() -> None:
    hf.register()
    ids = prompt(device=DEV)
    print(f"{'arch':12} {'variant':22} {'vs fp32':>9} {'vs bf16 default':>16} {'routing flips vs fp32':>22}")
    for arch in ARCHS:
        truth, truth_routes = routed_logits(tiny_model(arch, device=DEV), ids)
        variants = {}
        for impl in ("default", "eager", "grouped_mm", "batched_mm", "fusedmoe"):
            m = tiny_model(arch, dtype=torch.bfloat16, device=DEV)
            try:
                if impl != "default":
                    m.set_experts_implementation(impl)
                if impl == "fusedmoe":
                    hf.attach_workspace(m)
                logits, routes = routed_logits(m, ids)
                variants[impl] = (logits, routes_differ(routes, truth_routes))
            except Exception as err:  # noqa: BLE001 - a diagnostic: report and go on
                print(f"{arch:12} {impl:22} failed: {type(err).__name__}: {str(err)[:120]}")
        m = tiny_model(arch, dtype=torch.bfloat16, device=DEV)
        hf.patch_model(m)
        variants["fusedmoe patch_model"] = (routed_logits(m, ids)[0], "n/a")
        base = variants["default"][0]
        for name, (v, flips) in variants.items():
            print(f"{arch:12} {name:22} {relative_error(v, truth):9.4f} {relative_error(v, base):16.4f} {flips:>22}")
        try:
            print(f"{arch:12} experts alone: {experts_alone(arch)}")
        except Exception as err:  # noqa: BLE001
            print(f"{arch:12} experts alone failed: {type(err).__name__}: {str(err)[:160]}")


if __name__ == "__main__":
    main()
