"""``fusedmoe demo``: patch a (small, random or local) Qwen3-MoE model, generate with and without fusedmoe,
check that the tokens match, print tokens/s and the workspace stats.

On CPU it runs float32 with the torch experts (well under a minute); on a GPU bfloat16 with the Triton experts.
"""

from __future__ import annotations

import time

import torch

DEMO_CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    num_experts=16,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    vocab_size=1024,
    max_position_embeddings=1024,
)


def build_model(path: str | None, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A local checkpoint (``from_pretrained(path)``, no network) or a random-initialised small Qwen3-MoE."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    if path:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**DEMO_CONFIG))
        with torch.no_grad():  # unit-scale random weights, so the experts matter to every logit
            for name, p in model.named_parameters():
                if "norm" not in name and p.dim() >= 2:
                    p.normal_(0.0, p.shape[-1] ** -0.5)
        model = model.to(dtype)
    return model.to(device).eval()


def _generate(model, ids: torch.Tensor, tokens: int) -> tuple[torch.Tensor, float]:
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return out[:, ids.shape[1] :], time.perf_counter() - t0


def run(path: str | None = None, tokens: int = 32, prompt_len: int = 16, batch: int = 1, seed: int = 0) -> int:
    """Returns 0 if the patched model generated the same tokens as the original, 1 otherwise."""
    from ..api import resolve_backend
    from ..integrations.hf import patch_model, unpatch_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(path, device, dtype, seed)
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen).to(device)
    print(
        f"model    {path or 'random Qwen3-MoE'}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{getattr(cfg, 'num_experts', '?')} experts, top-{cfg.num_experts_per_tok}, {dtype}, {device}"
    )
    print(f"backend  {resolve_backend('auto', device)}")

    _generate(model, ids, 2)  # warm-up
    ref, t_ref = _generate(model, ids, tokens)
    manager = patch_model(model)
    _generate(model, ids, 2)
    manager.stats.calls = 0
    out, t_fused = _generate(model, ids, tokens)
    unpatch_model(model)

    n = ref.numel()
    same = torch.equal(ref, out)
    impl = getattr(cfg, "_experts_implementation", None)
    print(
        f"original {n / t_ref:9.1f} tokens/s  ({t_ref:.2f} s for {tokens} tokens x {batch}; transformers "
        f"experts_implementation={impl!r})"
    )
    print(f"fusedmoe {n / t_fused:9.1f} tokens/s  ({t_fused:.2f} s)")
    print(f"tokens   {'identical' if same else 'DIFFER'}: {out[0, :16].tolist()}{' ...' if tokens > 16 else ''}")
    s = manager.stats
    print(
        f"workspace {manager.strategy}: reserved {s.reserved_bytes} B, peak plan {s.peak_bytes} B, "
        f"allocations {s.device_allocations}, growths {s.growths}, bytes zeroed {s.bytes_zeroed}, "
        f"layer calls {s.calls}"
    )
    if not same:
        first = int((ref != out).nonzero()[0, 1]) if ref.shape == out.shape else 0
        print(f"first differing position: {first} (bf16 rounding can flip near-ties on a GPU)")
    return 0 if same else 1


def main(args) -> int:
    return run(path=args.model, tokens=args.tokens, prompt_len=args.prompt, batch=args.batch or 1)
