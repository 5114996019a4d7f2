"""The W pass from queued linear-layer pairs equals a full ``ms.grad``, in one process.

Each case runs F, B and W of a few microbatches on one Stage twice -- ``dw="stored"`` and
``dw="recompute"`` (MindSpore's own autograd over the whole stage) -- and compares the input
gradients and the accumulated weight gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import nn, ops  # noqa: E402

from ms_pipeline import LayerPlacement, ScheduleError  # noqa: E402
from ms_pipeline.runtime import Stage, ToyModel, split_blocks, toy_batch  # noqa: E402
from ms_pipeline.runtime.deferred_dw import is_linear  # noqa: E402

pytestmark = pytest.mark.needs_mindspore

D = 8


@pytest.fixture(autouse=True)
def _pynative():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")


def _tensor(shape, seed):
    return ms.Tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _run(blocks, dw, *, first=False, last=False, microbatches=3):
    """F, B (all microbatches), then W (all): returns the dx per microbatch and the gradients."""
    stage = Stage(0 if first else 1, blocks, first=first, last=last, dw=dw)
    dxs = []
    for mb in range(microbatches):
        x = ms.Tensor(np.arange(6).reshape(2, 3) % 5, ms.int32) if first else _tensor((2, 3, D), mb)
        stage.forward(mb, x)
        dx = stage.backward_input(mb, _tensor((2, 3, D) if not last else (), 100 + mb))
        dxs.append(None if dx is None else dx.asnumpy())
    for mb in range(microbatches):
        stage.backward_weight(mb)
    assert stage.in_flight == 0
    names = {id(p): p.name for p in stage.weights}
    return stage, dxs, {names[k]: v for k, v in stage.grads.items()}


def _same(blocks, **kw):
    stored, dx_s, g_s = _run(blocks, "stored", **kw)
    _, dx_r, g_r = _run(blocks, "recompute", **kw)
    for a, b in zip(dx_s, dx_r):
        if b is not None:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert g_s.keys() == g_r.keys()
    for name in g_r:
        np.testing.assert_allclose(g_s[name], g_r[name], rtol=1e-5, atol=1e-6, err_msg=name)
    return stored


class Mlp(nn.Cell):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm((D,))
        self.up, self.down = nn.Dense(D, 2 * D), nn.Dense(2 * D, D, has_bias=False)

    def construct(self, x):
        return x + self.down(ops.relu(self.up(self.norm(x))))


class Twice(nn.Cell):
    """One linear cell called twice (a shared weight inside one block)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Dense(D, D)

    def construct(self, x):
        return self.lin(ops.tanh(self.lin(x)))


class Tied(nn.Cell):
    """An embedding table also used as an output projection through a linear cell."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, D)
        self.head = nn.Dense(D, 16, has_bias=False)
        self.head.weight = self.embed.embedding_table  # tied: both cells hold the Parameter

    def construct(self, ids):
        return self.head(self.embed(ids))[..., :D]


class Sneaky(nn.Cell):
    """Uses its linear cell's weight outside the cell's construct: invisible to hooks."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Dense(D, D)

    def construct(self, x):
        return self.lin(x) + ops.matmul(x, self.lin.weight)


def test_linear_cells_are_recognised_by_what_they_compute():
    assert is_linear(nn.Dense(D, 4)) and is_linear(nn.Dense(D, 4, has_bias=False))
    assert not is_linear(nn.Dense(D, 4, activation="relu"))  # not x W^T + b
    assert not is_linear(nn.LayerNorm((D,))) and not is_linear(Mlp())


def test_stored_equals_recompute_on_a_middle_stage():
    stage = _same([Mlp(), Mlp()])
    deferred = stage.backward.deferred
    assert sorted(p.name.rsplit(".", 1)[-1] for p in deferred.params) == sorted(["bias", "weight", "weight"] * 2)
    assert stage.backward.deferred.pending(0) == 0  # W took every queued pair


def test_a_linear_called_twice_gets_both_uses():
    _same([Twice()])


def test_a_tied_weight_stays_with_b_and_stage_zero_differentiates_weights_only():
    stage = _same([Tied(), Mlp()], first=True)
    deferred = {id(p) for p in stage.backward.deferred.params}
    assert id(stage.blocks[0].embed.embedding_table) not in deferred


def test_toy_model_stages_with_the_loss():
    model = ToyModel(vocab=32, d=D, layers=2, heads=2, seed=0)
    n = len(model.blocks)
    blocks = split_blocks(list(model.blocks), LayerPlacement.from_counts([n - 2, 2]))
    inputs, labels = toy_batch(2, 2, 6, 32)
    x = inputs[0]
    for block in blocks[0]:
        x = block(x)
    for dw in ("stored", "recompute"):
        stage = Stage(1, blocks[1], first=False, last=True, dw=dw)
        stage.forward(0, x, labels[0])
        stage.backward_input(0, ms.Tensor(1.0, ms.float32))
        stage.backward_weight(0)
        if dw == "stored":
            stored = dict(stage.grads)
            assert stage.backward.deferred.params
    for k, v in stage.grads.items():
        np.testing.assert_allclose(stored[k], v, rtol=1e-5, atol=1e-6)


def test_a_weight_used_outside_its_cell_is_caught_by_the_first_w():
    with pytest.raises(ScheduleError, match=r"lin\.weight.*dw='recompute'"):
        _run([Sneaky()], "stored")
    _run([Sneaky()], "recompute")  # the other mode is right for it


def test_bad_modes_are_refused():
    with pytest.raises(ScheduleError, match="dw='fast'"):
        Stage(0, [Mlp()], first=False, last=False, dw="fast")
    with pytest.raises(ScheduleError, match="PyNative"):
        Stage(0, [Mlp()], first=False, last=False, jit=True, dw="stored")


def test_the_same_cells_compile_with_jit_after_a_stored_stage_hooked_them():
    blocks = [Mlp()]
    stored, _, grads = _run(blocks, "stored", microbatches=1)
    assert stored.backward.deferred is not None
    compiled = Stage(1, blocks, first=False, last=False, jit=True)  # takes the hooks off first
    assert compiled.dw == "recompute" and not hasattr(compiled.backward, "deferred")
    compiled.forward(0, _tensor((2, 3, D), 0))
    compiled.backward_full(0, _tensor((2, 3, D), 100))
    for p in compiled.weights:
        np.testing.assert_allclose(compiled.grads[id(p)], grads[p.name], rtol=1e-5, atol=1e-6, err_msg=p.name)
