"""ms-pipeline x ms-recompute: pipeline stages that hold tensor-parallel layers, PP 2 x TP 2 on 4
gloo ranks, compiled, recompute paired inside the stages.

Each pipeline rank is a TP group of two (``tp_model`` shards of a tiny Llama); each stage's layers
are one ms-recompute ``TPStackBlock``, whose passes ms-pipeline's Stage chains in Python between
the compiled embedding and head (its all-reduces between compiled segments, recompute pairs in the
ping-pong order). 1F1B (fused BW: the f all-reduces in flight under the weight gradients) and
ZeroBubbleV (split B and W) train like the single-process model: the loss and every gradient (a
sharded weight's against the same shard of the reference gradient) within ``_tiny.RTOL``; paired
recompute gives the gradients of no recompute bit for bit, and the pairs ran their ping-pong order.
ZeroBubbleV's 1B1F pairs run interleaved at the TP all-reduces (``interleave_layers``): each
half's all-reduce in flight while the other half computes, in the recorded order, same numbers.
"""

from __future__ import annotations

import _tiny
import numpy as np
import pytest

from ms_layout import shard
from ms_layout.testing import assert_close

pytest.importorskip("mindspore")
pytest.importorskip("torch")
pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch, pytest.mark.timeout(900)]

LAYERS = 4
TP_GROUPS, PP_GROUPS = [[0, 1], [2, 3]], [[0, 2], [1, 3]]  # pipeline rank r = world ranks 2r, 2r + 1
RUNS = [  # (schedule, layers per stage, TPStackBlock options)
    ("1f1b", (2, 2), dict(recompute=True, paired=True)),
    ("1f1b", (2, 2), dict(recompute=False)),
    ("zbv", (1, 1, 1, 1), dict(recompute=True, paired=True)),
    ("zbv+1b1f", (1, 1, 1, 1), dict(recompute=False)),  # pairs interleaved at their all-reduces
]
# a 1B1F pair of one-layer TP stages, interleaved: the forward issues its attention all-reduce,
# the backward (B) computes its MLP part and issues its first, the forward waits and goes on, ...
INTERLEAVED = ("F 0>0", "B 0>1", "F 0>8", "B 0>2")


def _llama():
    import ms_models

    _tiny.setup()
    config = ms_models.tiny_config("llama", num_hidden_layers=LAYERS, tie_word_embeddings=False)
    return ms_models.from_config(config, seed=0)


def _rank(group):
    import ms_pipeline as mp
    from ms_recompute.runtime import TPStackBlock, tp_model, tp_stage_blocks

    tp, pp = group.split(TP_GROUPS), group.split(PP_GROUPS)
    full = _llama()
    net, layouts = tp_model(full, tp)
    inputs, labels = _tiny.data(full.config.vocab_size)
    out = []
    for name, counts, options in RUNS:
        pairs = name.endswith("+1b1f")
        overlap = dict(overlap=True) if pairs else {}
        schedule = mp.build(name.removesuffix("+1b1f"), pp.size, _tiny.M, **overlap)
        stages = tp_stage_blocks(net, counts, tp, **options)
        mine = {s: stages[s] for s in schedule.stages_of(pp.rank)}
        shape = (_tiny.MB, _tiny.SEQ, full.config.hidden_size)
        runtime = mp.runtime.PipelineRuntime(
            schedule, mine, pp, activation_shape=shape, jit=True,
            overlap_fn=mp.runtime.interleave_layers if pairs else None,
        )  # fmt: skip
        result = runtime.step(inputs, labels)
        stacks = [b for s in sorted(mine) for b in mine[s] if isinstance(b, TPStackBlock)]
        orders = [" ".join(str(step) for step in b.pipeline_passes().stack.order) for b in stacks]
        dw = {st.dw for st in runtime.stages.values()}
        out.append(dict(loss=result.loss, grads=runtime.grads(), dw=dw, orders=orders, interleaved=result.interleaved))
    return dict(tp_rank=tp.rank, layouts=layouts, runs=out)


def test_tensor_parallel_stages_train_like_one_process(run_ranks):
    full = _llama()
    loss, reference = _tiny.reference_step(full, *_tiny.data(full.config.vocab_size))

    results = run_ranks(_rank, nprocs=4, timeout=800, env={"OMP_NUM_THREADS": "1"})

    for i, (name, counts, options) in enumerate(RUNS):
        seen = set()
        for world, r in enumerate(results):
            run = r["runs"][i]
            assert run["dw"] == {"chained"}, (name, run["dw"])
            assert_close(run["loss"], loss, _tiny.RTOL, f"{name} rank {world} loss")
            for key, g in run["grads"].items():
                want = reference[key]
                if key in r["layouts"]:
                    want = shard(want, r["layouts"][key], r["tp_rank"])
                assert_close(g, want, _tiny.RTOL, f"{name} {options} rank {world} grad {key}")
                seen.add(key)
            if options.get("paired") and max(counts) == 2:  # the BW of the last microbatch: one pair
                assert run["orders"] == ["1c0 1>0 0c0 0>0 1<0 1c1 0<0 0c1"], run["orders"]
            if name.endswith("+1b1f"):
                assert run["interleaved"], "no 1B1F pair ran"
                assert {steps for _, steps in run["interleaved"]} == {INTERLEAVED}, run["interleaved"]
            else:
                assert run["interleaved"] == ()
        assert seen == set(reference), (name, sorted(set(reference) - seen))
    for r in results:  # paired recompute vs none: the same graphs on the same values
        paired, plain = r["runs"][0]["grads"], r["runs"][1]["grads"]
        for key in paired:
            np.testing.assert_array_equal(paired[key], plain[key], err_msg=key)
