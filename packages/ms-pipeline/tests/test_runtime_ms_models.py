"""A tiny ms-models Llama, split into pipeline stages, trains like the unsplit model.

ms-models is a sibling package (HF-named MindSpore decoders); only its public names are used.
The model is cut into blocks at the natural seams by ``ms_models.pipeline_blocks``: the token
embedding, each decoder layer, and a head (final norm, LM head, cross-entropy). Each decoder-layer
block derives its RoPE angles and causal mask from the hidden state's shape, so the only tensor
crossing stages is the hidden state.
"""

from __future__ import annotations

import numpy as np
import pytest

from ms_layout.testing import UNIT_ROUNDOFF as U
from ms_layout.testing import assert_close

ms = pytest.importorskip("mindspore")
pytest.importorskip("torch")
ms_models = pytest.importorskip("ms_models")
from mindspore import ops  # noqa: E402

import ms_pipeline as mp  # noqa: E402

# spawning MindSpore ranks on 2 shared cores takes minutes, beyond the 300 s default
pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch, pytest.mark.timeout(1500)]

MB, SEQ, M = 2, 6, 4
# Pipelined vs unsplit: the same float32 ops grouped differently, so they agree to rounding relative
# to each tensor's scale; a length-n sum in another order is off by up to ~n*u of its terms. The
# longest chain behind a gradient of the tiny Llama: the LM head's sum over the vocabulary (320), one
# over <= 128 (intermediate size) per decoder layer (2), the step's M * MB * SEQ = 48 tokens:
# n ~ 320 + 2 * 128 + 48 < 1024 (measured: <= 1.5e-7 of the scale).
RTOL = 1024 * U  # ~6.1e-5


def _llama():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    config = ms_models.tiny_config("llama")
    return ms_models.from_config(config, seed=0), config


def _data(vocab):
    rng = np.random.default_rng(3)
    ids = rng.integers(0, vocab, (M, MB, SEQ + 1)).astype(np.int32)
    return [ms.Tensor(x[:, :-1]) for x in ids], [ms.Tensor(x[:, 1:]) for x in ids]


def _rank(group, runs):
    out = []
    for name, counts in runs:
        model, config = _llama()
        blocks = mp.runtime.split_blocks(ms_models.pipeline_blocks(model), mp.LayerPlacement.from_counts(counts))
        schedule = mp.build(name, 2, M)
        mine = {s: blocks[s] for s in schedule.stages_of(group.rank)}
        runtime = mp.runtime.PipelineRuntime(schedule, mine, group, activation_shape=(MB, SEQ, config.hidden_size))
        inputs, labels = _data(config.vocab_size)
        result = runtime.step(inputs, labels)
        out.append((name, result.loss, runtime.grads()))
    return out


def _single_process(model, vocab):
    """(mean loss over the microbatches, its gradient by parameter name): the unsplit model."""
    inputs, labels = _data(vocab)
    params = model.trainable_params()

    def mean_loss():
        total = ms.Tensor(0.0)
        for ids, y in zip(inputs, labels):
            logits = model(ids)
            total = total + ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        return total / M

    loss, grads = ms.value_and_grad(mean_loss, None, params)()
    return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(params, grads)}


def test_tiny_llama_pipelined_matches_single_process(run_ranks):
    model, config = _llama()
    assert not config.tie_word_embeddings and config.num_hidden_layers == 2
    loss, reference = _single_process(model, config.vocab_size)
    assert "model.layers.1.mlp.down_proj.weight" in reference  # HF names

    runs = [("1f1b", [2, 2]), ("zbv", [1, 1, 1, 1])]
    results = run_ranks(_rank, nprocs=2, timeout=900, args=(runs,), env={"OMP_NUM_THREADS": "1"})
    for i, (name, _) in enumerate(runs):
        seen = set()
        for rank_results in results:
            run_name, rank_loss, rank_grads = rank_results[i]
            assert_close(rank_loss, loss, RTOL, f"{run_name} loss")
            for key, g in rank_grads.items():
                assert_close(g, reference[key], RTOL, f"{name} grad {key}")
                seen.add(key)
        assert seen == set(reference), name


# ---------------------------------------------------------------- compiled explicit passes
ARCHS = ("llama", "deepseek_v3")
COMPILED_RTOL = 1e-5
"""Compiled pipelined vs single-process PyNative: each loss and gradient within 1e-5 of its
tensor's scale (the ops are the same float32 arithmetic regrouped; measured ~1e-7)."""


def _model(arch, layers):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    config = ms_models.tiny_config(arch, num_hidden_layers=layers, tie_word_embeddings=False)
    return ms_models.from_config(config, seed=1), config


def _reference(arch, layers):
    model, config = _model(arch, layers)
    return _single_process(model, config.vocab_size)


def _compiled_rank(group, layers, runs):
    out = []
    for arch, name in runs:
        model, config = _model(arch, layers)
        blocks = ms_models.pipeline_blocks(model)
        inputs, labels = _data(config.vocab_size)
        schedule = mp.build(name, group.size, M)
        placement = mp.LayerPlacement.even(len(blocks), schedule.num_stages)
        staged = mp.runtime.split_blocks(blocks, placement)
        mine = {s: staged[s] for s in schedule.stages_of(group.rank)}
        runtime = mp.runtime.PipelineRuntime(
            schedule, mine, group, activation_shape=(MB, SEQ, config.hidden_size), jit=True
        )
        assert {stage.dw for stage in runtime.stages.values()} == {"explicit"}
        result = runtime.step(inputs, labels)
        out.append((arch, name, result.loss, runtime.grads()))
    return out


EVERY_RUN = [(arch, name) for arch in ARCHS for name in ("1f1b", "zbv")]


@pytest.mark.parametrize(
    ("ranks", "runs"),
    # 4 ranks (middle stages with neither embedding nor head) on half the pairs: 4 compiling
    # processes on 2 cores took 160 s for all four; the toy model's 4-rank test runs both families
    [(2, EVERY_RUN), (4, [("deepseek_v3", "zbv"), ("llama", "1f1b")])],
    ids=["2", "4"],
)
def test_compiled_1f1b_and_zbv_match_single_process(run_ranks, ranks, runs):
    """Both families, compiled explicit passes (B never re-runs the forward), on 2 and 4 ranks."""
    layers = 2 * ranks - 2  # ZBV has 2 stages per rank: embed, layers and head make 2 * ranks blocks
    references = {arch: _reference(arch, layers) for arch in {arch for arch, _ in runs}}
    results = run_ranks(_compiled_rank, nprocs=ranks, timeout=1200, args=(layers, runs), env={"OMP_NUM_THREADS": "1"})
    for i in range(len(runs)):
        arch, name = results[0][i][:2]
        loss, reference = references[arch]
        seen = set()
        for rank_results in results:
            _, _, rank_loss, rank_grads = rank_results[i]
            assert_close(rank_loss, loss, COMPILED_RTOL, f"{arch} {name} loss")
            for key, g in rank_grads.items():
                assert_close(g, reference[key], COMPILED_RTOL, f"{arch} {name} grad {key}")
                seen.add(key)
        blocks = {k for k in reference if not k.startswith("model.mtp_layers.")}  # MTP trains apart
        assert seen == blocks, (arch, name, sorted(blocks - seen))


def _tuned_rank(group, layers):
    model, config = _model("llama", layers)
    blocks = ms_models.pipeline_blocks(model)
    inputs, labels = _data(config.vocab_size)
    schedule = mp.build("zbv", group.size, M)
    staged = mp.runtime.split_blocks(blocks, mp.LayerPlacement.even(len(blocks), schedule.num_stages))
    mine = {s: staged[s] for s in schedule.stages_of(group.rank)}
    runtime = mp.runtime.PipelineRuntime(
        schedule, mine, group, activation_shape=(MB, SEQ, config.hidden_size), jit=True
    )
    runtime.step(inputs, labels)  # compiles
    runtime.zero_grads()
    with pytest.raises(mp.ScheduleError, match="steps=0"):
        runtime.tune_backward(inputs, labels, steps=0)
    chosen = runtime.tune_backward(inputs, labels, comm=1e-4)
    result = runtime.step(inputs, labels)
    return chosen, runtime.costs, result.order, result.loss, runtime.grads()


def test_tune_backward_picks_the_fusions_from_every_rank_s_costs_and_trains_the_same(run_ranks):
    """tune_backward times split and fused backwards, every rank picks the same schedule (the
    simulator's choice under the gathered costs), runs it, and the step still equals the
    single-process one (the timing steps' gradients are discarded)."""
    loss, reference = _reference("llama", 2)
    results = run_ranks(_tuned_rank, nprocs=2, timeout=1200, args=(2,), env={"OMP_NUM_THREADS": "1"})
    (chosen, costs, _, _, _), other = results[0], results[1]
    assert chosen.name == "zbv+auto" and other[0] == chosen and other[1] == costs
    assert chosen == mp.fuse_where_faster(mp.build("zbv", 2, M), costs)
    assert all(costs.at(k, s) > 0 for k in ("f", "b", "w", "bw") for s in range(4))
    for rank, (_, _, order, rank_loss, grads) in enumerate(results):
        assert tuple(a for a in order if a.is_compute) == mp.split_pairs(chosen).actions[rank]
        assert_close(rank_loss, loss, COMPILED_RTOL, "loss")
        for key, g in grads.items():
            assert_close(g, reference[key], COMPILED_RTOL, f"grad {key}")
