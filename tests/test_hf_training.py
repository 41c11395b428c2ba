"""transformers models train through fusedmoe: every supported architecture x {experts interface, patch_model},
float32 on the CPU, against an identical model on transformers' default experts implementation (what
tests/test_hf_parity.py compares against; tests/test_gpu_hf.py: bf16 on the GPU).

The loss (with the load-balancing loss where the model has one) and the gradient of every parameter agree to
float32 rounding (TOL); switching to fusedmoe changes no ``requires_grad``; one AdamW step moves the same
parameter elements; activation checkpointing and torch.compile give the same gradients; parameters the user
froze get no gradient while the others get transformers' gradients.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import (  # noqa: E402
    ARCHS,
    fusedmoe_pair,
    one_thread,  # noqa: F401 (a fixture)
    padded_batch,
    tiny_model,
    use_fusedmoe,
)

from fusedmoe.integrations import hf  # noqa: E402
from fusedmoe.reference import relative_error  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
MODES = ("experts", "patch")

params = pytest.mark.parametrize("mode", MODES)
archs = pytest.mark.parametrize("arch", ARCHS)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    hf.register()


def _batch():
    """(ids, attention mask, labels): a padded batch whose padding positions are ignored by the loss."""
    ids, mask = padded_batch()
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _train_step(model, batch=None, **kw):
    """One training-mode forward with labels and router logits, then ``loss.backward()``:
    (loss, aux loss or None, {name: gradient or None} of every parameter)."""
    ids, mask, labels = batch if batch is not None else _batch()
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask, labels=labels, output_router_logits=True, use_cache=False, **kw)
    out.loss.backward()
    named = getattr(model, "_orig_mod", model).named_parameters()  # a compiled model's: the original's names
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in named}
    aux = getattr(out, "aux_loss", None)
    return out.loss.detach(), None if aux is None else aux.detach(), grads


def _assert_same_step(got, want, tol=TOL):
    """Two :func:`_train_step` results agree: the losses, and each parameter's gradient (present in both or in
    neither)."""
    (loss, aux, grads), (want_loss, want_aux, want_grads) = got, want
    assert relative_error(loss, want_loss) < tol
    assert (aux is None) == (want_aux is None)
    if want_aux is not None:
        assert relative_error(aux, want_aux) < tol
    assert list(grads) == list(want_grads)
    for name, want_grad in want_grads.items():
        grad = grads[name]
        assert (grad is None) == (want_grad is None), f"{name}: gradient {'missing' if grad is None else 'extra'}"
        if want_grad is not None:
            err = relative_error(grad, want_grad)
            assert err < tol, f"{name}: relative error {err:.2e}"


def _flags(model):
    return {n: p.requires_grad for n, p in model.named_parameters()}


def _expert_param_names(model):
    return {
        f"{n}.{p}" for n, m in model.named_modules() if m in hf.experts_modules(model) for p, _ in m.named_parameters()
    }


# ---- gradients -----------------------------------------------------------------------------------------------
@params
@archs
def test_gradients_match_transformers(arch, mode):
    """Loss, aux loss and the gradient of every parameter (embeddings, attention, norms, routers, experts,
    shared experts, the head) agree with transformers'; every parameter gets one; no requires_grad changed."""
    ref = tiny_model(arch)
    flags = _flags(ref)
    model = copy.deepcopy(ref)
    manager = use_fusedmoe(model, mode)
    assert _flags(model) == flags
    calls = manager.stats.calls
    got = _train_step(model)
    assert manager.stats.calls > calls  # fusedmoe computed the experts
    want = _train_step(ref)
    _assert_same_step(got, want)
    assert all(g is not None for g in got[2].values())
    assert _flags(model) == flags


@params
@archs
def test_adamw_step_moves_the_same_parameters(arch, mode):
    """One AdamW step (no weight decay: an element moves iff its gradient is not zero) moves exactly the elements
    it moves in transformers' model (embedding rows of absent tokens and experts no token chose stay put in
    both), and the stepped models compute the same logits (gpt-oss: its converted inference copy follows)."""
    ref, model, _ = fusedmoe_pair(arch, mode)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for m in (ref, model):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)
        _train_step(m)
        optimizer.step()
    ref_params, params_after = dict(ref.named_parameters()), dict(model.named_parameters())
    moved = set()
    for name, old in before.items():
        got, want = params_after[name].detach() != old, ref_params[name].detach() != old
        assert torch.equal(got, want), f"{name}: {int((got != want).sum())} elements differ in whether they moved"
        if want.any():
            moved.add(name)
    assert _expert_param_names(ref) <= moved  # the experts trained
    ids, mask, _ = _batch()
    ref.eval()
    model.eval()
    with torch.no_grad():
        out, expected = model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert relative_error(out[valid], expected[valid]) < TOL


@params
@archs
def test_frozen_parameters_get_no_gradient(arch, mode):
    """Experts frozen before switching to fusedmoe and one router frozen after: those get no gradient (and keep
    requires_grad=False), every other parameter gets transformers' gradient."""
    ref = tiny_model(arch)
    for experts in hf.experts_modules(ref):
        experts.requires_grad_(False)
    model = copy.deepcopy(ref)
    use_fusedmoe(model, mode)
    router = [n for n, p in ref.named_parameters() if ".mlp.gate.weight" in n or ".mlp.router." in n][-1]
    for m in (ref, model):
        m.get_parameter(router).requires_grad_(False)
    flags = _flags(ref)
    assert _flags(model) == flags
    got, want = _train_step(model), _train_step(ref)
    _assert_same_step(got, want)
    frozen = {n for n, f in flags.items() if not f}
    assert frozen == _expert_param_names(ref) | {router}
    assert {n for n, g in got[2].items() if g is None} == frozen
    assert _flags(model) == flags


@params
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@archs
def test_gradient_checkpointing(arch, mode, reentrant):
    """``gradient_checkpointing_enable()`` (both of torch's checkpoint modes) on both models: the MoE forwards run
    again in the backward, and the gradients are those of transformers' checkpointed model. (Reentrant
    checkpointing runs the first forward without autograd, so the recorded router logits, and the aux loss, carry
    no gradient there: in transformers' model too.)"""
    ref, model, manager = fusedmoe_pair(arch, mode)
    plain = manager.stats.calls
    _train_step(model)
    plain = manager.stats.calls - plain  # MoE calls of one step without checkpointing
    for m in (ref, model):
        with warnings.catch_warnings():  # transformers >= 5.2x: a FutureWarning naming activation_checkpointing_enable
            warnings.simplefilter("ignore", FutureWarning)
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    calls = manager.stats.calls
    got = _train_step(model)
    assert manager.stats.calls - calls == 2 * plain  # recomputed in the backward
    _assert_same_step(got, _train_step(ref))


@params
def test_mixtral_router_jitter_gradients(mode):
    """Training-mode router jitter, seeded alike: the same noise (patch_model draws it as transformers does), the
    same loss and gradients."""
    ref, model, _ = fusedmoe_pair("mixtral", mode, router_jitter_noise=0.1)
    results = []
    for m in (ref, model):
        torch.manual_seed(11)
        results.append(_train_step(m))
    _assert_same_step(results[1], results[0])
    torch.manual_seed(12)
    assert relative_error(_train_step(model)[0], results[0][0]) > 100 * TOL  # the noise is drawn and applied


@pytest.mark.parametrize("dense", [False, True], ids=["top-k", "dense"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_experts_function_gradients(arch, dense):
    """The experts function alone (int64 index, [T, k] or dense [T, E] routing weights): the gradients of the
    hidden states, the routing weights and every expert parameter (gpt-oss: transposed, interleaved weights and
    biases) are the eager experts forward's."""
    model = tiny_model(arch)
    experts = hf.experts_modules(model)[0]
    T, H, E, k = 11, model.config.hidden_size, experts.gate_up_proj.shape[0], 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    if dense:
        weights = torch.zeros(T, E).scatter(1, index, weights)
    upstream = torch.randn(T, H, generator=g)
    grads = []
    for run in ("eager", "fusedmoe"):
        experts.zero_grad(set_to_none=True)
        xr, wr = x.clone().requires_grad_(), weights.clone().requires_grad_()
        if run == "eager":
            out = hf._eager_experts_forward(experts)(experts, xr, index, wr.gather(1, index) if dense else wr)
        else:
            out = hf.fusedmoe_experts_forward(experts, xr, index, wr)
        out.backward(upstream)
        grads.append([xr.grad, wr.grad, *(p.grad for _, p in experts.named_parameters())])
    assert len(grads[1]) >= 4 and all(t is not None for t in grads[1])
    for got, want in zip(*reversed(grads)):
        assert relative_error(got, want) < TOL


# ---- torch.compile -------------------------------------------------------------------------------------------
@pytest.mark.slow
@params
def test_compiled_training_step(mode):
    """``torch.compile(model)`` (aot_eager) trains: the gradients of a compiled step are transformers' eager ones
    (the experts through fusedmoe's registered op and its registered backward), and an AdamW step on them moves
    the model like transformers'."""
    torch._dynamo.reset()
    ref, model, manager = fusedmoe_pair("qwen3_moe", mode)
    compiled = torch.compile(model, backend="aot_eager")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0) for m in (ref, model)]
    calls = manager.stats.calls
    got = _train_step(compiled)
    assert manager.stats.calls > calls
    _assert_same_step(got, _train_step(ref))
    for optimizer in optimizers:
        optimizer.step()
    _assert_same_step(_train_step(compiled), _train_step(ref), tol=10 * TOL)
