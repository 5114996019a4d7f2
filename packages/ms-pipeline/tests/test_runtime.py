"""Real runs on local CPU ranks (gloo): gradients and losses equal single-process training.

Few and small on purpose (the test machine has 2 cores): each run spawns its ranks once and
checks several things. The reference is the same model trained in this process with MindSpore's
own autograd over the mean loss of all microbatches.
"""

from __future__ import annotations

import pytest

from ms_layout.testing import UNIT_ROUNDOFF as U
from ms_layout.testing import assert_close

ms = pytest.importorskip("mindspore")
pytest.importorskip("torch")
from mindspore import nn  # noqa: E402

import ms_pipeline as mp  # noqa: E402
from ms_pipeline.runtime import ToyModel, reference_step, split_blocks, toy_batch  # noqa: E402

# spawning MindSpore ranks on 2 shared cores takes minutes, beyond the 300 s default
pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch, pytest.mark.timeout(1500)]

VOCAB, D, SEQ, MB = 32, 16, 8, 2
# Pipelined vs single-process: the same float32 ops grouped differently (per-stage ms.grad, microbatch
# gradients summed in another order), so they agree to rounding relative to each tensor's scale. A
# length-n sum in another order is off by up to ~n*u of its terms; the longest chain behind a
# gradient: the head's sum over VOCAB (32), one over <= 4 * D (64) per block (6 blocks), the step's
# <= 5 * MB * SEQ (80) tokens: n ~ 32 + 6 * 64 + 80 < 512. Measured: <= 2e-7 of the scale for losses
# and gradients. The weights after an optimizer step inherit it (SGD: lr times the gradient's error;
# Adam's first step is ~lr * sign(g) but amplifies it where |g| is near Adam's eps: measured 1.8e-6).
RTOL = 512 * U  # ~3.1e-5


def _setup():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")


def _optimizer(name, params):
    return nn.SGD(params, learning_rate=0.5) if name == "sgd" else nn.Adam(params, learning_rate=0.01)


def _train_two_steps(group, name, p, m, counts, layers, opt_name, options, steps=2, jit=False):
    """One rank: step, optimizer update, step again (``steps=1``: the first step only)."""
    _setup()
    schedule = mp.build(name, p, m, **options)
    model = ToyModel(vocab=VOCAB, d=D, layers=layers, heads=2, seed=0)
    blocks = split_blocks(list(model.blocks), mp.LayerPlacement.from_counts(counts))
    mine = {s: blocks[s] for s in schedule.stages_of(group.rank)}
    params = list({id(p): p for s in mine for b in mine[s] for p in b.trainable_params()}.values())
    runtime = mp.runtime.PipelineRuntime(
        schedule, mine, group, activation_shape=(MB, SEQ, D), optimizer=_optimizer(opt_name, params), jit=jit
    )
    inputs, labels = toy_batch(m, MB, SEQ, VOCAB)
    first = runtime.step(inputs, labels)
    grads = runtime.grads()
    if steps == 1:
        return first.loss, grads, None, None, first.events, first.order
    runtime.optimizer_step()
    second = runtime.step(inputs, labels)
    weights = {p.name: p.asnumpy() for p in runtime.params}
    return first.loss, grads, second.loss, weights, first.events, first.order


def _reference(m, layers, opt_name):
    _setup()
    model = ToyModel(vocab=VOCAB, d=D, layers=layers, heads=2, seed=0)
    inputs, labels = toy_batch(m, MB, SEQ, VOCAB)
    loss, grads = reference_step(model, inputs, labels)
    params = model.trainable_params()
    _optimizer(opt_name, params)(tuple(ms.Tensor(grads[p.name]) for p in params))
    loss_after, _ = reference_step(model, inputs, labels)
    return loss, grads, loss_after, {p.name: p.asnumpy() for p in params}


def _compare(results, reference):
    loss, grads, loss_after, weights = reference
    seen = set()
    for rank, (rank_loss, rank_grads, rank_loss_after, rank_weights, *_) in enumerate(results):
        assert_close(rank_loss, loss, RTOL, f"rank {rank} loss")
        assert_close(rank_loss_after, loss_after, RTOL, f"rank {rank} loss after the update")
        for name, g in rank_grads.items():
            assert_close(g, grads[name], RTOL, f"rank {rank} grad {name}")
            assert_close(rank_weights[name], weights[name], RTOL, f"rank {rank} updated {name}")
            seen.add(name)
    assert seen == set(grads)  # every parameter lives on some rank


def _many(group, runs, jit):
    """Several schedules in one spawn of the ranks (spawning MindSpore processes is the slow part)."""
    return [_train_two_steps(group, *run, jit=jit) for run in runs]


ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize(
    "p,runs,jit",
    [
        # (schedule, ranks, microbatches, blocks per stage, decoder layers, optimizer, options);
        # PyNative on 2 ranks, stages compiled with mindspore.jit on 4
        (2, [("1f1b", 2, 4, [3, 5], 3, "sgd", {}), ("zbv", 2, 4, [1, 3, 2, 2], 3, "adam", {})], False),
        (4, [("1f1b", 4, 4, [2, 2, 2, 2], 3, "adam", {}), ("zbv", 4, 5, [1] * 8, 3, "sgd", {})], True),
    ],
    ids=["2ranks-1f1b-zbv-uneven-pynative", "4ranks-1f1b-zbv-jit"],
)
def test_pipelined_training_matches_single_process(run_ranks, p, runs, jit):
    results = run_ranks(_many, nprocs=p, timeout=900, args=(runs, jit), env=ONE_THREAD)
    for i, (name, _, m, _, layers, opt, _) in enumerate(runs):
        per_rank = [r[i] for r in results]
        _compare(per_rank, _reference(m, layers, opt))
        # the run's own trace: every computation of the schedule ran once, on the right rank
        events = [e for r in per_rank for e in r[4] if e.action.is_compute]
        ran = sorted(str(part) for e in events for part in e.action.computes())
        schedule = mp.build(name, p, m)
        assert ran == sorted(str(part) for acts in schedule.actions for a in acts for part in a.computes())
        # ... in its rank's order, after what it depends on; so the same durations with free
        # transfers replay to a lower bound of the measured step
        assert mp.check_trace(schedule, events) == []
        measured, replayed = mp.Bubbles.of(events, p), mp.replay(schedule, events)
        assert replayed.busy == pytest.approx(measured.busy)
        assert replayed.makespan <= measured.makespan + 1e-3


def _one_step(group, runs):
    out = []
    for name, counts, options in runs:
        loss, grads, *_, order = _train_two_steps(group, name, 2, 4, counts, 3, "sgd", options, steps=1, jit=True)
        out.append((name, loss, grads, order))
    return out


def test_every_schedule_family_matches_single_process(run_ranks):
    runs = [
        ("gpipe", [4, 4], {}),
        ("zbh1", [5, 3], {}),
        ("interleaved", [2, 2, 2, 2], {}),
        ("zbv", [2, 2, 2, 2], {"overlap": True}),
    ]
    results = run_ranks(_one_step, nprocs=2, timeout=900, args=(runs,), env=ONE_THREAD)
    loss, grads, _, _ = _reference(4, 3, "sgd")
    for rank, rank_results in enumerate(results):
        for (name, rank_loss, rank_grads, order), (_, _, options) in zip(rank_results, runs):
            # the rank ran its plan in order, transfers included; a 1B1F pair as its two halves,
            # each with its own send and receive at its edges (ms_pipeline.split_pairs)
            planned = mp.lower(mp.split_pairs(mp.build(name, 2, 4, **options))).actions[rank]
            assert list(order) == list(planned), name
            assert_close(rank_loss, loss, RTOL, f"{name} loss")
            for key, g in rank_grads.items():
                assert_close(g, grads[key], RTOL, f"{name} grad {key}")


def test_a_probe_without_pipeline_pass_is_refused_by_name():
    schedule = mp.build("zbv", 2, 4)
    with pytest.raises(mp.ScheduleError, match="probe=object has no pipeline_pass"):
        mp.runtime.PipelineRuntime(schedule, {}, None, activation_shape=(MB, SEQ, D), probe=object())
