"""Compiled TP passes with paired recompute on 2 CPU ranks (gloo): the gradients of the compiled
stack equal ``ms.grad`` of the PyNative TP layers (to rounding), recompute paired or sequential and
no recompute give bit-identical gradients, and a pair runs exactly its ping-pong order."""

from __future__ import annotations

import numpy as np
import pytest
from test_tp import TP_RTOL

from ms_layout.testing import assert_close

pytestmark = [pytest.mark.needs_torch, pytest.mark.needs_mindspore]
LAYERS = 3  # a pair (0, 1) and layer 2 alone


def _inputs(model, batch=2, seq=8):
    import mindspore as ms

    rng = np.random.default_rng(0)
    hidden = model.config.hidden_size
    x = ms.Tensor(rng.normal(size=(batch, seq, hidden)).astype(np.float32))
    dout = ms.Tensor(rng.normal(size=(batch, seq, hidden)).astype(np.float32))
    cos, sin = model.model.rotary_emb(ms.Tensor(np.tile(np.arange(seq, dtype=np.int32), (batch, 1))))
    allowed = ms.Tensor(np.tril(np.ones((seq, seq), bool))[None, None])
    return x, dout, cos, sin, allowed


def _rank(group, jit):
    import mindspore as ms

    import ms_models
    from ms_recompute.errors import RecomputeError
    from ms_recompute.runtime import CompiledTPStack, tp_model

    ms.set_device("CPU")
    full = ms_models.from_config(ms_models.tiny_config("llama", num_hidden_layers=LAYERS), seed=0)
    tp, _ = tp_model(full, group)
    layers = tp.model.layers
    x, dout, cos, sin, allowed = _inputs(tp)

    def block(x):
        for layer in layers:
            x = layer(x, cos, sin, allowed)
        return x

    shards = [layer.layer for layer in layers]
    stack = CompiledTPStack(shards, group, recompute=False, jit=jit)
    weights = [p for w in stack.weights() for p in w]
    dx_ref, dw_ref = ms.grad(block, grad_position=0, weights=weights, sens_param=True)(x, dout)
    out_ref = block(x).asnumpy()
    reference = {"dx": dx_ref.asnumpy(), **{p.name: g.asnumpy() for p, g in zip(weights, dw_ref)}}
    runs = {}
    for name, kwargs in {
        "plain": dict(recompute=False),
        "sequential": dict(recompute=True, paired=False, overlap=False),
        "paired": dict(recompute=True, paired=True, overlap=True),
    }.items():
        stack = CompiledTPStack(shards, group, jit=jit, **kwargs)
        out, kept = stack.forward(x, cos, sin, allowed)
        out = out.asnumpy()
        dx, grads = stack.backward(kept, dout)
        runs[name] = {
            "out": out,
            "dx": dx.asnumpy(),
            **{p.name: g for w, gs in zip(stack.weights(), grads) for p, g in zip(w, gs)},
            "order": [str(s) for s in stack.order],
            "recompute_events": sum(e.op == "recompute" for e in stack.events),
        }
    # B and W apart (a pipeline's split backward): the same graphs on the same values as the fused one
    stack = CompiledTPStack(shards, group, jit=jit, recompute=True, paired=True)
    _, kept = stack.forward(x, cos, sin, allowed)
    dx, pairs = stack.backward_input(kept, dout)
    split_order = [str(s) for s in stack.order]
    grads = stack.backward_weight(pairs)
    runs["split"] = {
        "dx": dx.asnumpy(),
        **{p.name: g for w, gs in zip(stack.weights(), grads) for p, g in zip(w, gs)},
        "order": split_order,
    }
    # two microbatches in flight (a pipeline's F, F, B, B): each backward uses its own forward's values
    stack = CompiledTPStack(shards, group, jit=jit, recompute=True, paired=True)
    _, first = stack.forward(x, cos, sin, allowed)
    _, second = stack.forward(x * 2, cos, sin, allowed)
    dx_first = stack.backward(first, dout)[0].asnumpy()
    stack.backward(second, dout)
    runs["two in flight"] = {"dx": dx_first}
    try:
        stack.backward(first, dout)
        runs["reused"] = "accepted"
    except RecomputeError as e:
        runs["reused"] = str(e)
    return out_ref, reference, runs


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "pynative"])
def test_compiled_tp_recompute_on_two_ranks(run_ranks, jit):
    results = run_ranks(_rank, nprocs=2, args=(jit,), backend="gloo", timeout=600)
    for rank, (out_ref, reference, runs) in enumerate(results):
        plain = runs["plain"]
        assert_close(plain["out"], out_ref, TP_RTOL, f"rank {rank} output")
        for name, g in reference.items():
            assert_close(plain[name], g, TP_RTOL, f"rank {rank} grad {name}")
        for mode in ("sequential", "paired", "split"):
            for name in ("dx", *reference):
                np.testing.assert_array_equal(runs[mode][name], plain[name], err_msg=f"rank {rank} {mode} {name}")
        assert plain["order"] == [] and plain["recompute_events"] == 0
        # the backward reaches layer 2 first (alone), then the pair (0, 1) in its ping-pong order
        assert runs["sequential"]["order"] == "2c0 2>0 2<0 2c1 1c0 1>0 1<0 1c1 0c0 0>0 0<0 0c1".split()
        assert runs["paired"]["order"] == "2c0 2>0 2<0 2c1 1c0 1>0 0c0 0>0 1<0 1c1 0<0 0c1".split()
        assert runs["split"]["order"] == runs["paired"]["order"]
        np.testing.assert_array_equal(runs["two in flight"]["dx"], runs["paired"]["dx"])
        assert runs["reused"] == "this forward's values were already used by a backward"
        assert runs["sequential"]["recompute_events"] == 3 and runs["paired"]["recompute_events"] == 2


def test_misuse_is_refused_by_name():
    import ms_models
    from ms_recompute.errors import RecomputeError
    from ms_recompute.runtime import CompiledTPStack

    with pytest.raises(RecomputeError, match="at least one layer"):
        CompiledTPStack([], group=None)
    model = ms_models.from_config(ms_models.tiny_config("llama", num_hidden_layers=1), seed=0)
    stack = CompiledTPStack([model.model.layers[0]], group=None, jit=False)
    with pytest.raises(RecomputeError, match="needs what this stack's forward kept, got NoneType"):
        stack.backward(None, None)
    with pytest.raises(RecomputeError, match="needs what this stack's forward kept, got NoneType"):
        stack.backward_input(None, None)
    with pytest.raises(RecomputeError, match="needs 1 layers' pairs, got 2"):
        stack.backward_weight([(), ()])
