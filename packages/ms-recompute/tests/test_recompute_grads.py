"""Recompute changes memory, never gradients: full, selective and paired plans on tiny ms_models
models give the gradients of the plain model (measured: bit-identical), including the split
backward ms-pipeline runs (input gradients first, weight gradients in a second pass)."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import ops

import ms_models
from ms_layout.testing import UNIT_ROUNDOFF as U
from ms_layout.testing import assert_close
from ms_recompute import RecomputeError, RecomputePlan
from ms_recompute.runtime import apply_plan, checkpoint

pytestmark = pytest.mark.needs_mindspore
# Recompute replays the same ops (measured: bit-identical); only the backward graph may group them
# differently, so allow a few dozen roundings relative to each gradient's own scale: 64 u ~ 3.8e-6.
# (The absolute 1e-6 this replaces was ~1e-7 of the split test's dx, scale 8.6, i.e. 2 u, and ~2e-3
# of the smallest weight gradients, scale 4.9e-4.)
RTOL = 64 * U
ms.set_device("CPU")


def batch(vocab, b=2, s=8):
    rng = np.random.default_rng(0)
    ids = ms.Tensor(rng.integers(0, vocab, (b, s)).astype(np.int32))
    return ids, ms.Tensor(rng.integers(0, vocab, (b, s)).astype(np.int32))


def grads(model, ids, labels):
    params = model.trainable_params()

    def loss(ids, labels):
        logits = model(ids)
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    return {p.name: g.asnumpy() for p, g in zip(params, ms.grad(loss, grad_position=None, weights=params)(ids, labels))}


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def assert_same_grads(got, reference):
    assert got.keys() == reference.keys()
    for name in reference:
        assert_close(got[name], reference[name], RTOL, f"grad {name} with recompute")


@pytest.fixture(scope="module")
def llama():
    model = ms_models.from_config(ms_models.tiny_config("llama", num_hidden_layers=3), seed=0)
    ids, labels = batch(model.config.vocab_size)
    return model, ids, labels, grads(model, ids, labels)


@pytest.mark.parametrize(
    "spec, overlap",
    [
        ("0-2=full", False),  # each layer alone
        ("0-2=full", True),  # a pair (0, 1) and layer 2 alone
        ("0-2=mlp", False),  # selective
        ("0=full,1=input_layernorm+self_attn,2=full", True),  # a pair of non-adjacent layers around a selective one
    ],
)
def test_gradients_equal_the_plain_model(llama, spec, overlap):
    model, ids, labels, reference = llama
    names = [p.name for p in model.trainable_params()]
    plan = RecomputePlan.parse(spec, 3, overlap=overlap, comms=0)
    with apply_plan(model, plan, trace=True) as applied:
        got = grads(model, ids, labels)
        recomputes = [e for e in applied.events if e.op == "recompute"]
    assert_same_grads(got, reference)
    # one recompute per full layer (a pair counts once) and per selected sub-module call
    full, selective = plan.layers_with("full"), plan.layers_with("selective")
    expected = len(plan.groups) + sum(len(plan.layers[i].modules) for i in selective)
    assert len(recomputes) == expected, (full, selective)
    assert [p.name for p in model.trainable_params()] == names  # HF names untouched


def test_split_backward_input_then_weights_as_ms_pipeline_runs_it(llama):
    model, ids, _, _ = llama
    layers = model.model.layers
    weights = [p for layer in layers for p in layer.trainable_params()]
    x = model.model.embed_tokens(ids)
    positions = ms.Tensor(np.tile(np.arange(ids.shape[1], dtype=np.int32), (ids.shape[0], 1)))
    cos, sin = model.model.rotary_emb(positions)
    allowed = ms.Tensor(np.tril(np.ones((ids.shape[1], ids.shape[1]), bool))[None, None])

    def block(x):  # a pipeline stage of 3 layers
        for layer in layers:
            x = layer(x, cos, sin, allowed)
        return x

    dout = ms.Tensor(np.random.default_rng(1).normal(size=x.shape).astype(np.float32))

    def split():  # docs/mindspore-cpu.md §5, recipe 3: B pass, then W pass from the same input
        dx = ms.grad(block, grad_position=0, sens_param=True)(x, dout)
        dw = ms.grad(block, grad_position=None, weights=weights, sens_param=True)(x, dout)
        return {"dx": dx.asnumpy(), **{str(i): g.asnumpy() for i, g in enumerate(dw)}}

    reference = split()
    with apply_plan(model, RecomputePlan.parse("0-1=full,2=mlp", 3, overlap=True, comms=0)) as applied:
        got = split()
        assert applied.recompute_s > 0
    assert_same_grads(got, reference)


def test_a_plain_function_is_recomputed_with_its_closure_parameters(llama):
    model, ids, labels, reference = llama
    mlp = model.model.layers[1].mlp
    original = mlp.construct
    calls = []

    def swiglu(x):
        calls.append(1)
        return original(x)

    mlp.construct = lambda x: checkpoint(swiglu, x)  # the function form, inside a model
    try:
        got = grads(model, ids, labels)
    finally:
        del mlp.construct
    assert_same_grads(got, reference)
    assert len(calls) == 2  # forward once, recompute once


def test_deepseek_v3_mla_and_moe_layers(tmp_path):
    model = ms_models.from_config(ms_models.tiny_config("deepseek_v3"), seed=0)
    ids, labels = batch(model.config.vocab_size, s=8)
    reference = grads(model, ids, labels)
    with apply_plan(model, RecomputePlan.parse("0-1=full,2=self_attn+mlp", 3, overlap=True, comms=0)):
        assert_same_grads(grads(model, ids, labels), reference)


def test_bad_plans_attach_nothing(llama):
    model, ids, labels, reference = llama
    with pytest.raises(RecomputeError, match="no sub-module 'attention'"):
        apply_plan(model, RecomputePlan.parse("0=full,1=attention", 3))
    with pytest.raises(RecomputeError, match="plan is for 4 layers"):
        apply_plan(model, RecomputePlan.parse("0=full", 4))
    with apply_plan(model, RecomputePlan.parse("0=mlp", 3)):  # nothing was left attached by the failures
        with pytest.raises(RecomputeError, match="applied twice"):
            apply_plan(model, RecomputePlan.parse("0=mlp", 3))
    # removed: the plain model again, bit for bit
    assert max_diff(grads(model, ids, labels), reference) == 0.0
