"""scripts/model_parity.py on a tiny model (CPU): every implementation's bf16 model is measured against the float32
model of the same weights, whole and block by block, and fusedmoe's blocks are no farther from float32 than
transformers' own."""

import pytest
import torch
from script_module import load_script

pytest.importorskip("transformers")


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "mixtral-8x7b"])
def test_each_block_of_each_implementation_is_measured_against_float32(preset):
    from fusedmoe.integrations import hf

    parity = load_script("model_parity.py")
    hf.register()
    impls = ["grouped_mm", "fusedmoe", "fusedmoe-patch"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = parity.run(preset, 2, impls, batch=2, prompt=8, tiny=True, device="cpu")
    finally:
        torch.set_num_threads(threads)
    assert set(result["whole"]) == set(impls)
    for impl in impls:
        whole = result["whole"][impl]
        # bf16 against float32: rounding, not zero (more than rounding where a router flips a token somewhere)
        assert whole["rows"] == 2 and 0 < whole["rel_diff"] < 0.5
    assert [r["layer"] for r in result["per_layer"]] == [0, 1]
    for r in result["per_layer"]:
        assert r["tokens"] == 16 and 0 <= r["routing_flips"] <= 16
        if r["routing_flips"] == 0:  # a token routed elsewhere moves its output by a whole expert's share
            assert all(0 < r[impl] < 5e-2 for impl in impls)
        # fusedmoe accumulates each expert in float32 and rounds the intermediate once: no farther than transformers
        assert all(r[impl] <= 1.5 * r["grouped_mm"] + 1e-3 for impl in ("fusedmoe", "fusedmoe-patch"))
