"""What recompute saves, measured in MindSpore against what the formula and the planner predict.

The meter (``SavedTensorMeter``) adds up the distinct storages the autograd tape keeps for the
backward -- each tensor an op saves, parameters excluded -- plus the inputs recompute checkpoints hold.
The formula counts the same thing from the config, so the two must agree to the byte. Two kinds of
bytes are not activations and are accounted apart: the attention's mask copy and the dense MoE path's
transposed expert stacks (``ModuleMemory.constant_bytes``, freed with the module), and the inputs every layer
reads (RoPE cos/sin, the mask: ``shared_bytes``), which a checkpoint holds once.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import ops

import ms_models
from ms_recompute import Granularity, RecomputePlan, Shape, model_memory, plan_recompute, shared_bytes
from ms_recompute.runtime import SavedTensorMeter, apply_plan

pytestmark = pytest.mark.needs_mindspore
ms.set_device("CPU")
CONFIG = ms_models.tiny_config("llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def model():
    return ms_models.from_config(CONFIG, seed=0)


def layer_inputs(model, b, s):
    x = ms.Tensor(np.random.default_rng(0).normal(size=(b, s, CONFIG.hidden_size)).astype(np.float32))
    positions = ms.Tensor(np.tile(np.arange(s, dtype=np.int32), (b, 1)))
    cos, sin = model.model.rotary_emb(positions)
    return x, cos, sin, ms.Tensor(np.tril(np.ones((s, s), bool))[None, None])


def measure_layer(model, plan_spec, b, s):
    """Bytes the tape keeps for one call of layer 0, under a plan for that layer."""
    layer = model.model.layers[0]
    x, cos, sin, allowed = layer_inputs(model, b, s)
    plan = RecomputePlan.parse(plan_spec, 3, comms=0)
    with apply_plan(model, plan) as applied:
        with SavedTensorMeter(exclude=model.get_parameters(), runners=[applied.runner]) as meter:
            ms.grad(lambda x: layer(x, cos, sin, allowed), grad_position=0, weights=layer.trainable_params())(x)
    return meter.bytes


@pytest.mark.parametrize("b, s", [(2, 8), (1, 12)])
def test_one_layer_measured_equals_the_formula(model, b, s):
    mem = model_memory(CONFIG, Shape(b, s))[0]
    shared = shared_bytes(CONFIG, Shape(b, s))
    attn, mlp = mem.module("self_attn"), mem.module("mlp")
    assert measure_layer(model, "", b, s) == mem.total_bytes + mem.constant_bytes
    assert measure_layer(model, "0=full", b, s) == mem.input_bytes + shared
    assert (
        measure_layer(model, "0=mlp", b, s)
        == mem.total_bytes + mem.constant_bytes - mlp.activation_bytes - mlp.constant_bytes
    )
    kept = mem.total_bytes + mem.constant_bytes - attn.activation_bytes - attn.constant_bytes + shared
    assert measure_layer(model, "0=self_attn", b, s) == kept


def model_run(model, plan, ids, labels):
    """(bytes the tape keeps, most recomputed bytes alive at once) for one training step."""
    params = model.trainable_params()

    def loss(ids, labels):
        return ops.cross_entropy(model(ids).reshape(-1, CONFIG.vocab_size), labels.reshape(-1))

    with apply_plan(model, plan) as applied:
        with SavedTensorMeter(exclude=model.get_parameters(), runners=[applied.runner]) as meter:
            ms.grad(loss, grad_position=None, weights=params)(ids, labels)
        return meter.bytes, applied.peak_working_bytes


def test_planned_savings_measured_against_the_planner(model):
    b, s = 2, 16
    rng = np.random.default_rng(0)
    ids = ms.Tensor(rng.integers(0, CONFIG.vocab_size, (b, s)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, CONFIG.vocab_size, (b, s)).astype(np.int32))
    layers = model_memory(CONFIG, Shape(b, s))
    baseline = sum(m.total_bytes for m in layers)
    plans = [
        plan_recompute(layers, int(baseline * 0.55)),  # the planner mixes selective and full
        RecomputePlan.uniform(3, Granularity.FULL),
        RecomputePlan.uniform(3, Granularity.SELECTIVE, ["mlp"]),
    ]
    assert len({lp.label for lp in plans[0].layers}) > 1, plans[0].spec
    kept_none, _ = model_run(model, RecomputePlan.uniform(3, "none"), ids, labels)
    for plan in plans:
        kept, working = model_run(model, plan, ids, labels)
        predicted = plan.prediction if plan.prediction is not None else _predict(plan, layers)
        constants, holds_shared, transposed = 0, False, 0
        for i, (lp, mem) in enumerate(zip(plan.layers, layers)):
            names = [m.name for m in mem.modules] if lp.granularity is Granularity.FULL else lp.modules
            constants += sum(mem.module(n).constant_bytes for n in names)
            holds_shared |= "self_attn" in names
            # the largest re-run layer's linear weights, counted from the model
            transposed = max(transposed, sum(linear_weight_bytes(getattr(model.model.layers[i], n)) for n in names))
        shared = shared_bytes(CONFIG, Shape(b, s))
        activations_saved = kept_none - kept - constants + (shared if holds_shared else 0)
        assert activations_saved == predicted.saved_bytes, plan.spec
        # The measured working set also holds what the formula leaves out: the layer input, the
        # shared inputs (RoPE, mask), and in PyNative a transient transposed copy of each re-run
        # linear weight (ops.dense transposes per call there, keeping nothing for the backward).
        slack = constants + layers[0].input_bytes + shared + transposed
        assert predicted.working_bytes <= working <= predicted.working_bytes + slack, plan.spec


def linear_weight_bytes(cell) -> int:
    """Bytes of the 2-D (linear) weights of a module."""
    return sum(4 * int(np.prod(p.shape)) for p in cell.trainable_params() if len(p.shape) == 2)


def _predict(plan, layers):
    from ms_recompute import predict

    return predict(plan, layers)


def test_pairing_holds_two_layers_of_recomputed_activations(model):
    rng = np.random.default_rng(0)
    ids = ms.Tensor(rng.integers(0, CONFIG.vocab_size, (2, 16)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, CONFIG.vocab_size, (2, 16)).astype(np.int32))
    alone = model_run(model, RecomputePlan.uniform(3, Granularity.FULL), ids, labels)
    paired = model_run(model, RecomputePlan.uniform(3, Granularity.FULL, overlap=True), ids, labels)
    assert paired[0] == alone[0]  # the same tensors are kept between forward and backward
    assert paired[1] == 2 * alone[1]  # but a pair's recompute has both layers alive at once
