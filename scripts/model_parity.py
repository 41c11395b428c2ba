"""How far is each experts implementation's bf16 model from the float32 model of the same weights, at full width?

``fusedmoe bench model`` compares implementations with each other; this compares each with the truth. For one of
its presets (random weights as it builds them, ``--layers`` deep), on the GPU:

1. whole model: the next-token logits of a random prompt from each implementation's bf16 model against the float32
   model's (transformers' ``grouped_mm``): relative error and the rows whose greedy token differs;
2. per layer: each MoE block of the bf16 model, fed the very input it had in the bf16 ``grouped_mm`` forward, under
   each implementation, against the float32 block on the same input (upcast): relative error. Beside it, the tokens
   whose top-k experts differ between the bf16 router and the float32 one on that input: a routing flip moves a
   token's output by a whole expert's share, whichever implementation computes the experts.

A layer where fusedmoe's error is far above ``grouped_mm``'s on the same input is a wrong layer; errors of the
same size that grow with depth are bf16 rounding carried through the model.

Usage: PYTHONPATH=src python3 scripts/model_parity.py --preset gpt-oss-20b --layers 8 [--impls grouped_mm,fusedmoe]
[--batch 1] [--prompt 128] [--tiny] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json

import torch

from fusedmoe.reference import relative_error
from fusedmoe.tools.bench import model as model_bench

ROUTERS = ("router", "gate")  # the router's name in gpt-oss's MLP; in Mixtral's, Qwen3's and DeepSeek's blocks


def _blocks(model) -> list[torch.nn.Module]:
    """Each decoder layer's MoE block (``mlp``), where it has a router."""
    return [layer.mlp for layer in model.model.layers if any(hasattr(layer.mlp, r) for r in ROUTERS)]


def _first(out) -> torch.Tensor:
    return (out[0] if isinstance(out, tuple) else out).float()


def _top_k_sets(block, x: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted top-k expert ids (tokens, k) of ``block``'s router on ``x`` (tokens, hidden)."""
    router = next(getattr(block, r) for r in ROUTERS if hasattr(block, r))
    logits = torch.nn.functional.linear(x, router.weight, getattr(router, "bias", None))
    return logits.float().topk(k, dim=-1).indices.sort(dim=-1).values


@contextlib.contextmanager
def _switched_to(model, impl: str, kept: dict):
    """``model`` running ``impl`` (a ``bench model`` implementation) inside the block, switched back after it."""
    undo = model_bench._use(model, impl, kept)
    try:
        yield
    finally:
        undo()


def _block_inputs(model, ids) -> list[torch.Tensor]:
    """The input of every MoE block in one forward of ``model`` on ``ids``."""
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone())) for b in _blocks(model)]
    try:
        with torch.inference_mode():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def run(preset: str, layers: int, impls: list[str], batch: int, prompt: int, tiny: bool, device: str) -> dict:
    """Build ``preset`` (``layers`` deep; ``tiny``: the bench's tiny dimensions) in float32 with transformers'
    ``grouped_mm`` experts, and a bf16 copy of the same weights; measure each implementation of ``impls`` (names
    of ``bench model``) on ``batch`` random prompts of ``prompt`` tokens. Returns ``whole`` (per implementation,
    :func:`~fusedmoe.tools.bench.model.compare_logits` of its bf16 next-token logits against the float32 model's)
    and ``per_layer`` (per MoE block: the relative error of each implementation's bf16 block against the float32
    block on the bf16 ``grouped_mm`` model's input, and ``routing_flips``, the tokens whose plain top-k of the
    router logits differs between bf16 and float32; for DeepSeek's grouped, bias-corrected routing this count is an
    approximation)."""
    torch.manual_seed(0)
    truth_model = model_bench.build(preset, tiny=tiny, layers=layers, device=device, dtype=torch.float32)
    truth_model.set_experts_implementation("grouped_mm")
    model = copy.deepcopy(truth_model).to(torch.bfloat16)
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    k = model.config.num_experts_per_tok
    with torch.inference_mode():
        truth = model_bench._next_token_logits(truth_model, ids, mask)
    kept: dict = {}
    whole = {}
    for impl in impls:
        with _switched_to(model, impl, kept), torch.inference_mode():
            logits = model_bench._next_token_logits(model, ids, mask)
        whole[impl] = model_bench.compare_logits(logits, truth)
    with _switched_to(model, "grouped_mm", kept):
        inputs = _block_inputs(model, ids)
    per_layer = []
    for i, (block, truth_block, x) in enumerate(zip(_blocks(model), _blocks(truth_model), inputs)):
        flat = x.reshape(-1, x.shape[-1])
        with torch.inference_mode():
            want = _first(truth_block(x.float()))
            flips = int((_top_k_sets(block, flat, k) != _top_k_sets(truth_block, flat.float(), k)).any(-1).sum())
        row = {"layer": i, "tokens": flat.shape[0], "routing_flips": flips}
        for impl in impls:
            with _switched_to(model, impl, kept), torch.inference_mode():
                row[impl] = relative_error(_first(_blocks(model)[i](x)), want)
        per_layer.append(row)
    return {"preset": preset, "layers": layers, "batch": batch, "prompt": prompt, "tiny": tiny, "whole": whole,
            "per_layer": per_layer}  # fmt: skip


def report(result: dict, impls: list[str]) -> None:
    print(
        f"{result['preset']} ({'tiny' if result['tiny'] else 'full width'}, {result['layers']} layers), "
        f"{result['batch']} x {result['prompt']} tokens: bf16 against float32 (grouped_mm)"
    )
    print("whole model, next-token logits: relative error, rows whose greedy token differs")
    for impl, d in result["whole"].items():
        print(
            f"  {impl:16} {d['rel_diff']:.2e}  {d['argmax_differs']}/{d['rows']}"
            f"  (float32 top-two gap {d['top2_gap']:.1e})"
        )
    print("per MoE block on the bf16 grouped_mm model's input: relative error vs the float32 block; routing flips")
    print("  layer  flips " + " ".join(f"{i:>16}" for i in impls))
    for r in result["per_layer"]:
        print(f"  {r['layer']:5}  {r['routing_flips']:5} " + " ".join(f"{r[i]:16.2e}" for i in impls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt-oss-20b", choices=sorted(model_bench.MODELS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--impls", default="grouped_mm,fusedmoe,fusedmoe-patch")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tiny", action="store_true", help="the bench's tiny dimensions (a CPU smoke run)")
    parser.add_argument("--json")
    args = parser.parse_args()
    from fusedmoe.integrations import hf

    hf.register()
    impls = args.impls.split(",")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = run(args.preset, args.layers, impls, args.batch, args.prompt, args.tiny, device)
    report(result, impls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
