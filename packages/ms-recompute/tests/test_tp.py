"""Recompute under tensor parallelism on 2 CPU ranks (gloo): the TP model built from an ms_models
model matches the single-device model, and recompute -- each layer alone, or in pairs whose
all-reduces overlap the partner's compute -- leaves its gradients bit-identical, also in the split
backward. The pair runs exactly the order its plan prints."""

from __future__ import annotations

import numpy as np
import pytest

from ms_layout.testing import UNIT_ROUNDOFF as U
from ms_layout.testing import assert_close

pytestmark = [pytest.mark.needs_torch, pytest.mark.needs_mindspore]
LAYERS = 3
# TP vs single device: the row-parallel matmuls' sums split in two halves and all-reduced, so the
# gradients agree to rounding relative to each tensor's scale; a length-n sum in another order is off
# by up to ~n*u of its terms. The longest chain behind a gradient of the tiny Llama: the LM head's
# sum over the vocabulary (320), one over <= 128 (intermediate size) per layer (LAYERS), the batch's
# 16 tokens: n ~ 320 + 3 * 128 + 16 < 1024 (measured: <= 1.1e-6 of the scale, ~6e-8 absolute).
TP_RTOL = 1024 * U  # ~6.1e-5


def _grads(model, ids, labels):
    import mindspore as ms
    from mindspore import ops

    params = model.trainable_params()

    def loss(ids, labels):
        return ops.cross_entropy(model(ids).reshape(-1, model.config.vocab_size), labels.reshape(-1))

    return {p.name: g.asnumpy() for p, g in zip(params, ms.grad(loss, grad_position=None, weights=params)(ids, labels))}


def _split(model, ids):
    """ms-pipeline's split backward over the decoder layers: dx, then the weights in a second pass."""
    import mindspore as ms

    layers = model.model.layers
    weights = [p for layer in layers for p in layer.trainable_params()]
    x = model.model.embed_tokens(ids)
    s = ids.shape[1]
    cos, sin = model.model.rotary_emb(ms.Tensor(np.tile(np.arange(s, dtype=np.int32), (ids.shape[0], 1))))
    allowed = ms.Tensor(np.tril(np.ones((s, s), bool))[None, None])

    def block(x):
        for layer in layers:
            x = layer(x, cos, sin, allowed)
        return x

    dout = ms.Tensor(np.random.default_rng(1).normal(size=x.shape).astype(np.float32))
    dx = ms.grad(block, grad_position=0, sens_param=True)(x, dout)
    dw = ms.grad(block, grad_position=None, weights=weights, sens_param=True)(x, dout)
    return {"dx": dx.asnumpy(), **{p.name: g.asnumpy() for p, g in zip(weights, dw)}}


def _diff(a, b):
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def _executed(events):
    """The steps each recompute ran, in the plan's notation, one string per recompute group."""
    groups, steps = [], []
    for e in events:
        if e.op == "recompute":
            groups.append(" ".join(steps))
            steps = []
        else:
            steps.append(f"{e.layer}{dict(compute='c', issue='>', wait='<')[e.op]}{e.index}")
    return groups


def _rank(group):
    import mindspore as ms

    import ms_models
    from ms_layout import shard
    from ms_recompute import RecomputePlan
    from ms_recompute.runtime import apply_plan, tp_model

    ms.set_device("CPU")
    full = ms_models.from_config(ms_models.tiny_config("llama", num_hidden_layers=LAYERS), seed=0)
    rng = np.random.default_rng(0)
    ids = ms.Tensor(rng.integers(0, full.config.vocab_size, (2, 8)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, full.config.vocab_size, (2, 8)).astype(np.int32))
    reference = _grads(full, ids, labels)
    tp, layouts = tp_model(full, group)
    mine = {n: shard(g, layouts[n], group.rank) if n in layouts else g for n, g in reference.items()}
    plain, plain_split = _grads(tp, ids, labels), _split(tp, ids)
    out = {"tp": plain, "single_device": mine}
    for overlap in (False, True):
        plan = RecomputePlan.parse(f"0-{LAYERS - 1}=full", LAYERS, overlap=overlap, comms=1)
        with apply_plan(tp, plan, trace=True) as applied:
            out[f"overlap={overlap}"] = _diff(_grads(tp, ids, labels), plain)
            out[f"order overlap={overlap}"] = (_executed(applied.events), [str(g) for g in plan.groups])
            if overlap:
                out["split overlap=True"] = _diff(_split(tp, ids), plain_split)
    return out


def test_tensor_parallel_recompute_on_two_ranks(run_ranks):
    results = run_ranks(_rank, nprocs=2, backend="gloo", timeout=600)
    for rank, r in enumerate(results):
        assert r["tp"].keys() == r["single_device"].keys()
        for name, g in r["tp"].items():
            assert_close(g, r["single_device"][name], TP_RTOL, f"rank {rank} TP grad {name}")
        assert r["overlap=False"] == 0.0 and r["overlap=True"] == 0.0, rank
        assert r["split overlap=True"] == 0.0, rank
        # the backward reaches layer 2 first (alone), then the pair (0, 1), run in its ping-pong order;
        # every recompute stops before the MLP's all-reduce, whose result nothing saved depends on
        executed, planned = r["order overlap=True"]
        assert planned == ["(0, 1): 1c0 1>0 0c0 0>0 1<0 1c1 0<0 0c1", "(2): 2c0 2>0 2<0 2c1"]
        assert executed == ["2c0 2>0 2<0 2c1", "1c0 1>0 0c0 0>0 1<0 1c1 0<0 0c1"]
        executed, planned = r["order overlap=False"]
        assert executed == ["2c0 2>0 2<0 2c1", "1c0 1>0 1<0 1c1", "0c0 0>0 0<0 0c1"] and len(planned) == 3
