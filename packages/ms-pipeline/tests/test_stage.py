"""The dx/dw split of one stage, in one process, against MindSpore's own full gradient."""

from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import Parameter, nn, ops  # noqa: E402

from ms_pipeline import ScheduleError  # noqa: E402
from ms_pipeline.runtime import Stage  # noqa: E402

pytestmark = pytest.mark.needs_mindspore
D = 8


class Embed(nn.Cell):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(11, D)

    def construct(self, ids):
        return self.table(ids)


class Twice(nn.Cell):
    """x @ w @ w: one weight used twice on one path (the dW-split pitfall of pytorch #180952)."""

    def __init__(self, rng):
        super().__init__()
        self.w = Parameter(ms.Tensor(rng.standard_normal((D, D)).astype(np.float32) / 3), name="w")

    def construct(self, x):
        return ops.tanh(ops.matmul(ops.matmul(x, self.w), self.w))


class UseShared(nn.Cell):
    """A block calling a Dense that another block calls too (a weight shared by two blocks)."""

    def __init__(self, dense):
        super().__init__()
        self.dense = dense

    def construct(self, x):
        return x + ops.tanh(self.dense(x))


class Head(nn.Cell):
    def __init__(self):
        super().__init__()
        self.proj = nn.Dense(D, 11)

    def construct(self, x, labels):
        logits = self.proj(x)
        return ops.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1))


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        shared = nn.Dense(D, D)
        self.blocks = nn.CellList([Embed(), Twice(rng), UseShared(shared), UseShared(shared), Head()])

    def construct(self, ids, labels):
        x = ids
        for i in range(4):
            x = self.blocks[i](x)
        return self.blocks[4](x, labels)


def _data(m):
    rng = np.random.default_rng(1)
    ids = [ms.Tensor(rng.integers(0, 11, (2, 5)).astype(np.int32)) for _ in range(m)]
    labels = [ms.Tensor(rng.integers(0, 11, (2, 5)).astype(np.int32)) for _ in range(m)]
    return ids, labels


def _reference(net, ids, labels):
    params = net.trainable_params()

    def mean_loss():
        return sum((net(i, y) for i, y in zip(ids, labels)), ms.Tensor(0.0)) / len(ids)

    _, grads = ms.value_and_grad(mean_loss, None, params)()
    return {id(p): g.asnumpy() for p, g in zip(params, grads)}


@pytest.mark.parametrize("split_stage", [False, True])
def test_split_backward_equals_full_gradient(split_stage):
    net = Net()
    ids, labels = _data(3)
    ref = _reference(net, ids, labels)
    blocks = list(net.blocks)
    if split_stage:  # stage 0 = [embed, twice], stage 1 = [shared, shared, head]; dx crosses between
        stages = [Stage(0, blocks[:2], first=True, last=False), Stage(1, blocks[2:], first=False, last=True)]
    else:
        stages = [Stage(0, blocks, first=True, last=True)]
    sens = ms.Tensor(1 / 3, ms.float32)
    outs = {}
    for mb in range(3):  # F of every microbatch first, as GPipe/ZB warm-ups do
        x = ids[mb]
        for st in stages:
            x = st.forward(mb, x, labels[mb] if st.last else None)
        outs[mb] = x
    # microbatch 0: B then W (ZB), microbatch 1: fused BW, microbatch 2: B, later W
    for mb, fused in ((0, False), (1, True), (2, False)):
        g = sens
        for st in reversed(stages):
            g = st.backward_full(mb, g) if fused else st.backward_input(mb, g)
        assert g is None  # stage 0's input is token ids: no dx is computed there
    for st in stages:
        st.backward_weight(2)
        st.backward_weight(0)
    got = {}
    for st in stages:
        for pid, g in st.grads.items():
            got[pid] = got.get(pid, 0) + g
    assert set(got) == set(ref)
    for pid, g in ref.items():
        np.testing.assert_allclose(got[pid], g, rtol=1e-5, atol=1e-6)
    assert all(st.in_flight == 0 for st in stages)


def test_out_of_order_passes_are_named():
    net = Net()
    stage = Stage(0, list(net.blocks), first=True, last=True)
    ids, labels = _data(1)
    with pytest.raises(ScheduleError, match="stage 0: B of microbatch 0 runs before its F"):
        stage.backward_input(0, ms.Tensor(1.0))
    stage.forward(0, ids[0], labels[0])
    with pytest.raises(ScheduleError, match="W of microbatch 0 runs before its B"):
        stage.backward_weight(0)
    with pytest.raises(ScheduleError, match="microbatch 0 ran its forward twice"):
        stage.forward(0, ids[0], labels[0])


class _OneRank:
    """A process group of one rank: nothing to send, so the runtime runs in this process."""

    backend, rank, size, ranks = "local", 0, 1, (0,)

    def barrier(self):
        pass

    def all_reduce(self, array, op="sum", async_op=False):
        return None


@pytest.mark.parametrize("overlap", [False, True])
def test_runtime_on_one_rank_hands_tensors_over_at_the_turn_of_the_v(overlap):
    import ms_pipeline as mp
    from ms_pipeline.runtime import PipelineRuntime

    net = Net()
    ids, labels = _data(3)
    ref = _reference(net, ids, labels)
    blocks = list(net.blocks)
    schedule = mp.zero_bubble_v(1, 3, overlap=overlap)  # stages 0 and 1 both on rank 0
    runtime = PipelineRuntime(schedule, {0: blocks[:2], 1: blocks[2:]}, _OneRank(), activation_shape=(2, 5, D))
    result = runtime.step(ids, labels)
    grads = runtime.grads()
    by_id = {id(p): p.name for p in runtime.params}
    assert set(grads) == set(by_id.values())
    for pid, g in ref.items():
        np.testing.assert_allclose(grads[by_id[pid]], g, rtol=1e-5, atol=1e-6)
    # a pair runs as its halves: the trace and the executed order hold F, B and W only
    assert any(a.kind is mp.Kind.OVERLAP_F_B for a in schedule.actions[0]) == overlap
    assert {e.action.kind.value for e in result.events} == {"F", "B", "W"}
    assert list(result.order) == list(mp.lower(mp.split_pairs(schedule)).actions[0])


def test_runtime_argument_errors_are_named():
    import ms_pipeline as mp
    from ms_pipeline.runtime import PipelineRuntime

    blocks = list(Net().blocks)
    schedule = mp.zero_bubble_v(1, 2)
    with pytest.raises(ScheduleError, match=r"rank 0 holds stages \[0, 1\]"):
        PipelineRuntime(schedule, {0: blocks}, _OneRank(), activation_shape=(2, 5, D))
    with pytest.raises(ScheduleError, match="schedule 1f1b needs 2 ranks, the group has 1"):
        PipelineRuntime(mp.one_f_one_b(2, 2), {0: blocks}, _OneRank(), activation_shape=(2, 5, D))
    runtime = PipelineRuntime(schedule, {0: blocks[:2], 1: blocks[2:]}, _OneRank(), activation_shape=(2, 5, D))
    ids, labels = _data(3)
    with pytest.raises(ScheduleError, match="step needs 2 microbatches"):
        runtime.step(ids, labels)
    with pytest.raises(ScheduleError, match="no optimizer"):
        runtime.optimizer_step()


def test_interleave_layers_runs_pairs_whole_where_no_block_communicates():
    """interleave_layers on blocks without passes of their own: each pair runs as one action, its
    halves whole (no collective to alternate at), with the same gradients; tune_backward refuses
    what it cannot tune."""
    import ms_pipeline as mp
    from ms_pipeline.runtime import PipelineRuntime, interleave_layers

    net = Net()
    ids, labels = _data(3)
    ref = _reference(net, ids, labels)
    blocks = list(net.blocks)
    schedule = mp.zero_bubble_v(1, 3, overlap=True)
    runtime = PipelineRuntime(
        schedule, {0: blocks[:2], 1: blocks[2:]}, _OneRank(), activation_shape=(2, 5, D), overlap_fn=interleave_layers
    )
    result = runtime.step(ids, labels)
    pairs = [a for a in schedule.actions[0] if a.kind is mp.Kind.OVERLAP_F_B]
    assert [name for name, _ in result.interleaved] == [str(a) for a in pairs] and pairs
    assert {steps for _, steps in result.interleaved} == {()}
    by_id = {id(p): p.name for p in runtime.params}
    for pid, g in ref.items():
        np.testing.assert_allclose(runtime.grads()[by_id[pid]], g, rtol=1e-5, atol=1e-6)
    with pytest.raises(ScheduleError, match="has 1B1F pairs"):
        runtime.tune_backward(ids, labels)
    fused = PipelineRuntime(
        mp.fuse_backward(mp.zero_bubble_v(1, 3)), {0: blocks[:2], 1: blocks[2:]}, _OneRank(), activation_shape=(2, 5, D)
    )
    with pytest.raises(ScheduleError, match="no separate B"):
        fused.tune_backward(ids, labels)
