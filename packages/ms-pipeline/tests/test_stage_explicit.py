"""A Stage on its blocks' explicit passes (ms-models' pipeline blocks), in one process: compiled F,
B and W in any microbatch order give ms.grad's gradients; recompute flags change what is held
between F and B, not a number; the modes refuse what they cannot do, naming it."""

from __future__ import annotations

import numpy as np
import pytest

from ms_layout.testing import assert_close

ms = pytest.importorskip("mindspore")
ms_models = pytest.importorskip("ms_models")

from ms_pipeline import ScheduleError  # noqa: E402
from ms_pipeline.runtime import Stage  # noqa: E402

pytestmark = pytest.mark.needs_mindspore
RTOL = 1e-5


@pytest.fixture(scope="module")
def blocks():
    ms.set_device("CPU")
    config = ms_models.tiny_config("llama", num_hidden_layers=3, tie_word_embeddings=False)
    return ms_models.pipeline_blocks(ms_models.from_config(config, seed=2))


def _data(m=3):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 320, (m, 2, 9)).astype(np.int32)
    return [ms.Tensor(x[:, :-1]) for x in ids], [ms.Tensor(x[:, 1:]) for x in ids]


def _reference(blocks, inputs, labels):
    """ms.grad of the whole model as one Cell: mean loss over the microbatches."""
    params = [p for b in blocks for p in b.trainable_params()]

    def mean_loss():
        total = 0.0
        for ids, y in zip(inputs, labels):
            x = ids
            for b in blocks[:-1]:
                x = b(x)
            total = total + blocks[-1](x, y)
        return total / len(inputs)

    grads = ms.grad(mean_loss, grad_position=None, weights=params)()
    return {id(p): g.asnumpy() for p, g in zip(params, grads)}


@pytest.mark.parametrize(
    "recompute, host_w",
    [(False, None), (False, False), (True, None), ((False, True, False, True, False), True)],
)
def test_compiled_passes_in_schedule_order_equal_ms_grad(blocks, recompute, host_w):
    """F of every microbatch, then B in another order than F, W later in yet another: FIFO by
    microbatch is the Stage's job, each pass takes its own microbatch's values. W in a compiled
    graph (its gradients joined in one flat output; the default) or on the host (numpy on the kept
    pairs) gives the same numbers."""
    inputs, labels = _data()
    stage = Stage(0, blocks, first=True, last=True, jit=True, recompute=recompute, host_w=host_w)
    assert stage.dw == "explicit"
    assert stage.host_w is bool(host_w)  # None: off
    assert stage.backward.flat  # every weight float32: W and BW return one joined tensor
    scale = ms.Tensor(1.0 / len(inputs), ms.float32)
    for mb in range(3):
        stage.forward(mb, inputs[mb], labels[mb])
    for mb in (2, 0, 1):
        assert stage.backward_input(mb, scale) is None  # stage 0: no input gradient
    for mb in (1, 2, 0):
        stage.backward_weight(mb)
    assert stage.in_flight == 0
    want = _reference(blocks, inputs, labels)
    got = stage.grads
    assert set(got) == set(want)
    for p in stage.weights:
        assert_close(got[id(p)], want[id(p)], RTOL, p.name)


def test_recompute_holds_less_and_fused_bw_gives_the_same(blocks):
    inputs, labels = _data(2)
    scale = ms.Tensor(0.5, ms.float32)
    held, grads = {}, {}
    for flags in (False, True):
        stage = Stage(0, blocks, first=True, last=True, jit=True, recompute=flags)
        for mb in range(2):
            stage.forward(mb, inputs[mb], labels[mb])
        held[flags] = stage.held_bytes()
        for mb in range(2):
            stage.backward_full(mb, scale)
        grads[flags] = stage.grads
    assert held[True] < held[False] / 5  # inputs (token ids and labels) against every layer's values
    for k, g in grads[False].items():
        assert_close(grads[True][k], g, 0.0, "recompute replays the same ops")


def test_zero_and_set_grads(blocks):
    inputs, labels = _data(1)
    stage = Stage(0, blocks, first=True, last=True, jit=True)
    stage.forward(0, inputs[0], labels[0])
    stage.backward_full(0, ms.Tensor(1.0, ms.float32))
    first = stage.grads
    stage.set_grads(first)
    stage.forward(1, inputs[0], labels[0])
    stage.backward_full(1, ms.Tensor(1.0, ms.float32))
    for k, g in stage.grads.items():
        assert_close(g, 2 * first[k], RTOL, "accumulated twice")
    stage.zero_grads()
    assert stage.grads == {}


def test_misuse_is_refused_by_name(blocks):
    with pytest.raises(ScheduleError, match=r"recompute=\[True\] is not a bool or one bool per block"):
        Stage(0, blocks, first=True, last=True, jit=True, recompute=[True])
    plain = ms.nn.Dense(4, 4)
    with pytest.raises(ScheduleError, match=r"needs explicit_passes\(\) on every block, not on \['Dense'\]"):
        Stage(0, [plain], first=False, last=False, dw="explicit")
    with pytest.raises(ScheduleError, match="recompute= needs the blocks' explicit passes"):
        Stage(0, [plain], first=False, last=False, jit=True, recompute=True)
    with pytest.raises(ScheduleError, match="host_w=True needs the blocks' explicit passes"):
        Stage(0, [plain], first=False, last=False, jit=True, host_w=True)
    with pytest.raises(ScheduleError, match="host_w='yes' is not True, False or None"):
        Stage(0, blocks, first=True, last=True, jit=True, host_w="yes")
    assert not Stage(0, [plain], first=False, last=False, jit=True).host_w  # no passes: nothing to run
    stage = Stage(0, blocks, first=True, last=True, jit=True)
    inputs, labels = _data(1)
    with pytest.raises(ScheduleError, match="W of microbatch 0 runs before its B"):
        stage.backward_weight(0)
    stage.forward(0, inputs[0], labels[0])
    with pytest.raises(ScheduleError, match="microbatch 0 ran its forward twice"):
        stage.forward(0, inputs[0], labels[0])


def test_cells_with_recompute_hooks_keep_the_construct_path(blocks):
    """ms-recompute's PyNative hooks work through construct, which explicit passes never call:
    'auto' takes the construct-based modes for such blocks and 'explicit' says why it cannot. In
    PyNative 'auto' runs the modules as Cells (the debug path: hooks and dumps see them)."""
    layer = blocks[1].layer
    layer.register_saved_tensors_hooks(lambda t: t, lambda t: t)
    try:
        assert Stage(1, blocks[1:3], first=False, last=False, jit=True).dw == "recompute"
        with pytest.raises(ScheduleError, match="saved-tensor hooks"):
            Stage(1, blocks[1:3], first=False, last=False, dw="explicit")
    finally:
        layer.register_saved_tensors_hooks(None, None)
    assert Stage(1, blocks[1:3], first=False, last=False, jit=True).dw == "explicit"
    assert Stage(1, blocks[1:3], first=False, last=False).dw == "stored"
    assert Stage(1, blocks[1:3], first=False, last=False, dw="explicit").dw == "explicit"  # eager passes


class _OwnPasses:
    """The block-passes protocol over a block's explicit passes, run eagerly (a stand-in for a
    block whose passes hold collectives, as ms-recompute's TPStackBlock)."""

    def __init__(self, block):
        self.passes = block.explicit_passes()

    def weights(self):
        return self.passes.weights()

    def forward(self, x):
        return self.passes.forward(x)

    def backward_input(self, kept, g):
        return self.passes.backward_input(kept, g)

    def backward_weight(self, pairs):
        return [g.asnumpy() for g in self.passes.backward_weight(pairs)]

    def backward_full(self, kept, g):
        dx, pairs = self.backward_input(kept, g)
        return dx, self.backward_weight(pairs)


class _OwnBlock(ms.nn.Cell):
    def __init__(self, block):
        super().__init__(auto_prefix=False)
        self.block = block
        self._passes = _OwnPasses(block)

    def construct(self, x):
        return self.block(x)

    def pipeline_passes(self):
        return self._passes


def test_blocks_with_their_own_passes_chain_between_compiled_segments(blocks):
    """embed | own-passes layer | layer, head: the stage chains a compiled segment, the block's
    own passes and another compiled segment; split and fused backwards give ms.grad's gradients."""
    inputs, labels = _data()
    chained = [blocks[0], _OwnBlock(blocks[1]), *blocks[2:]]
    stage = Stage(0, chained, first=True, last=True, jit=True)
    assert stage.dw == "chained"
    scale = ms.Tensor(1.0 / len(inputs), ms.float32)
    for mb in range(3):
        stage.forward(mb, inputs[mb], labels[mb])
    stage.backward_input(1, scale)
    stage.backward_full(0, scale)
    stage.backward_input(2, scale)
    stage.backward_weight(2)
    stage.backward_weight(1)
    assert stage.in_flight == 0
    want = _reference(blocks, inputs, labels)
    got = stage.grads
    assert set(got) == set(want)
    for p in stage.weights:
        assert_close(got[id(p)], want[id(p)], RTOL, p.name)
    with pytest.raises(ScheduleError, match="recomputes by its own options"):
        Stage(0, chained, first=True, last=True, jit=True, recompute=True)
    with pytest.raises(ScheduleError, match="not dw='stored'"):
        Stage(0, chained, first=True, last=True, dw="stored")
    with pytest.raises(ScheduleError, match="must end with an ordinary block"):
        Stage(1, [_OwnBlock(blocks[1])], first=False, last=True, jit=True)
