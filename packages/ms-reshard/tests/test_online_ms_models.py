"""A tiny ms-models Llama resharded between live ranks, then run: logits equal the reference model's.

Four gloo ranks each build the same reference model (seed 0) and their own differently seeded
model. The reference weights are cut into the training layout (dp=2, tp=2, optimizer sharding:
every rank stores a quarter of each matrix) and resharded into the second model's Parameters,
replicated on every rank (dp=4), through the plan built from ms_models.model_layouts. Each rank's
model must then reproduce the reference logits exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from ms_layout import ParallelConfig

TRAIN = ParallelConfig(dp=2, tp=2, optimizer_shard=True)
SERVE = ParallelConfig(dp=4)


def _specs(cfg, parallel, sharded):
    import ms_models
    from ms_reshard import ParamSpec, stored_layout

    shapes = ms_models.param_shapes(cfg)
    out = {}
    for name, placement in ms_models.model_layouts(cfg, parallel).items():
        layout = stored_layout(placement.layout, shapes[name]) if sharded else placement.layout
        out[name] = ParamSpec(layout, tuple(shapes[name]), "float32")
    return out


def rank_ms_models(group):
    import mindspore as ms

    import ms_models
    from ms_reshard import model_plan
    from ms_reshard.execute import reshard_parameters

    me = group.rank
    cfg = ms_models.tiny_config("llama")
    reference = ms_models.from_config(cfg, seed=0)
    weights = ms_models.hf_state_dict(reference)
    ids = ms.Tensor(np.arange(12, dtype=np.int32).reshape(1, 12) % cfg.vocab_size)
    want = reference(ids).asnumpy()
    src_specs, dst_specs = _specs(cfg, TRAIN, True), _specs(cfg, SERVE, False)
    shards = {n: ms.Tensor(weights[n][s.layout.global_slice(s.shape, me)]) for n, s in src_specs.items()}
    model = ms_models.from_config(cfg, seed=100 + me)
    params = dict(model.parameters_and_names())
    before = model(ids).asnumpy()
    mp = model_plan(src_specs, dst_specs)
    reshard_parameters(mp, group, shards, params)
    got = model(ids).asnumpy()
    return {
        "max_abs_before": float(np.abs(before - want).max()),
        "equal_after": bool(np.array_equal(got, want)),
        "params_equal": all(np.array_equal(params[n].asnumpy(), w) for n, w in weights.items()),
        "moved": mp.per_rank()[me]["received"],
        "lower_bound": mp.per_rank()[me]["lower_bound"],
    }


@pytest.mark.needs_torch
@pytest.mark.needs_mindspore
def test_tiny_ms_models_llama_resharded_online_runs_like_the_reference(run_ranks):
    pytest.importorskip("ms_models", reason="ms-models is not installed in this environment")
    results = run_ranks(rank_ms_models, nprocs=4, backend="gloo", timeout=240)
    for rank, r in enumerate(results):
        assert r["max_abs_before"] > 0, rank  # the target model really started different
        assert r["params_equal"] and r["equal_after"], (rank, r)
        assert r["moved"] == r["lower_bound"] > 0
