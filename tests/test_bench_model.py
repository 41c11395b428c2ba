"""``fusedmoe bench model``'s runner on stand-ins for the model and ``generate`` (no transformers model is built)."""

import types

import torch

from fusedmoe.tools.bench import model as model_bench


def test_a_cell_out_of_memory_is_recorded_and_the_run_goes_on(monkeypatch):
    current = {}

    def use(model, impl):
        current["impl"] = impl
        return lambda: current.pop("impl")

    def generate(model, ids, mask, new, compiled):
        if current["impl"] == "batched_mm":  # transformers' batched_mm gathers a weight copy per slot
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 126.56 GiB.\nmore")
        return torch.cat([ids, torch.ones(ids.shape[0], new, dtype=ids.dtype)], dim=1)

    monkeypatch.setattr(model_bench, "_use", use)
    monkeypatch.setattr(model_bench, "_generate", generate)
    model = types.SimpleNamespace(
        config=types.SimpleNamespace(vocab_size=50), parameters=lambda: iter([torch.zeros(1)])
    )
    said = []
    impls = ["grouped_mm", "batched_mm", "fusedmoe"]
    rows = model_bench.run(model, impls, [1, 2], ["eager"], prompt=4, new=3, repeats=1, progress=said.append)
    assert [(r["impl"], r["batch"]) for r in rows] == [(i, b) for b in (1, 2) for i in impls]
    failed = [r for r in rows if r["impl"] == "batched_mm"]
    assert all(r["decode_ms"] is None and r["error"].startswith("out of memory: CUDA out of memory") for r in failed)
    ran = [r for r in rows if r["impl"] != "batched_mm"]
    assert all(r["decode_ms"] is not None and r["agreement"] == 1.0 for r in ran)
    assert all(r["vs_best_transformers"] is not None for r in ran)  # against grouped_mm, the one that ran
    assert not current  # every switch undone, the failed cells' too
    assert any("out of memory" in line for line in said)
    table = model_bench.table_rows(rows)
    assert [row[-1] for row in table if row[0] == "batched_mm"] == [r["error"] for r in failed]
