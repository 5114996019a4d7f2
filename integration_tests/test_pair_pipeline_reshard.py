"""ms-pipeline/ms-models x ms-reshard: the weights a ZeroBubbleV training step leaves on 2 gloo
ranks (each rank holds the parameters of its own stages, updated by its optimizer) are resharded
online by ms-reshard -- first to ZeRO-style optimizer shards (dp=2, every matrix split along dim 0),
then from those to the TP=2 inference layout ms-models gives -- and offline, through ms-reshard's
checkpoint format, to TP=2 and to one full checkpoint. Every shard equals the numpy slice of the
gathered trained weights, bit for bit (resharding only moves bytes)."""

from __future__ import annotations

import _tiny
import numpy as np
import pytest

from ms_layout import Layout, ParallelConfig

pytest.importorskip("mindspore")
pytest.importorskip("torch")
pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch, pytest.mark.timeout(600)]

LR = 0.1
ZERO = ParallelConfig(dp=2, optimizer_shard=True)
SERVE = ParallelConfig(tp=2)


def _shapes() -> dict[str, tuple[int, ...]]:
    import ms_models

    return {k: tuple(v) for k, v in ms_models.param_shapes(_tiny.config()).items()}


def stage_specs():
    """Each parameter whole on the rank whose stages hold it (ZBV: rank 0 = stages 0 and 3)."""
    from ms_reshard import ParamSpec

    out = {}
    for name, shape in _shapes().items():
        layout = Layout((1,), ("pp",), ((),) * len(shape), rank_list=(_tiny.owner_rank(name),))
        out[name] = ParamSpec(layout, shape, "float32")
    return out


def config_specs(parallel: ParallelConfig, sharded: bool):
    """The layouts ms-models gives under `parallel`; `sharded` also splits dim 0 over dp (ZeRO)."""
    import ms_models
    from ms_reshard import ParamSpec, stored_layout

    shapes = _shapes()
    out = {}
    for name, placement in ms_models.model_layouts(_tiny.config(), parallel).items():
        layout = stored_layout(placement.layout, shapes[name]) if sharded else placement.layout
        out[name] = ParamSpec(layout, shapes[name], "float32")
    return out


def _empty(specs, rank: int, tag: str) -> dict:
    import mindspore as ms

    return {
        name: ms.Parameter(ms.Tensor(np.zeros(s.layout.shard_shape(s.shape), np.float32)), name=f"{tag}.{name}")
        for name, s in specs.items()
        if rank in s.layout.ranks
    }


def _rank(group):
    from mindspore import nn

    from ms_reshard import model_plan, reshard_parameters

    me = group.rank
    net = _tiny.model()
    runtime = _tiny.pipeline_runtime(group, net, optimizer=lambda params: nn.SGD(params, learning_rate=LR))
    inputs, labels = _tiny.data(net.config.vocab_size)
    before = {p.name: p.asnumpy().copy() for p in runtime.params}
    runtime.step(inputs, labels)
    runtime.optimizer_step()

    stages, zero, serve = stage_specs(), config_specs(ZERO, True), config_specs(SERVE, False)
    held = {name: p for name, p in net.parameters_and_names() if _tiny.owner_rank(name) == me}
    zero_params, serve_params = _empty(zero, me, "zero"), _empty(serve, me, "serve")
    zero_shards = reshard_parameters(model_plan(stages, zero), group, held, zero_params)
    serve_shards = reshard_parameters(model_plan(zero, serve), group, zero_params, serve_params)
    return dict(
        held={n: p.asnumpy() for n, p in held.items()},
        changed=sum(not np.array_equal(before[n], held[n].asnumpy()) for n in before),
        zero=zero_shards,
        serve=serve_shards,
        serve_params={n: p.asnumpy() for n, p in serve_params.items()},
    )


def _check(shards_by_rank, specs, full, what):
    for rank, shards in enumerate(shards_by_rank):
        mine = {n for n, s in specs.items() if rank in s.layout.ranks}
        assert set(shards) == mine, what
        for name, got in shards.items():
            want = full[name][specs[name].layout.global_slice(specs[name].shape, rank)]
            np.testing.assert_array_equal(got, want, err_msg=f"{what}: rank {rank} {name}")


def test_trained_stage_weights_resharded_online_and_offline(run_ranks, tmp_path):
    from ms_reshard import load_checkpoint, load_manifest, model_plan, reshard_checkpoint, save_checkpoint

    results = run_ranks(_rank, nprocs=2, timeout=500, env={"OMP_NUM_THREADS": "1"})

    # the numpy gather: each parameter from the one rank whose stage held it
    full = {n: a for r in results for n, a in r["held"].items()}
    assert full.keys() == _shapes().keys()
    assert all(r["changed"] > 0 for r in results)  # the optimizer really moved every rank's weights
    untrained = _tiny.model()
    moved = [n for n, p in untrained.parameters_and_names() if not np.array_equal(p.asnumpy(), full[n])]
    assert len(moved) >= 60  # all trainable weights (not the router's correction bias)

    stages, zero, serve = stage_specs(), config_specs(ZERO, True), config_specs(SERVE, False)
    split = [n for n, s in zero.items() if s.layout.shard_shape(s.shape) != s.shape]
    assert len(split) > 40  # ZeRO really splits the matrices
    _check([r["zero"] for r in results], zero, full, "stages -> zero")
    _check([r["serve"] for r in results], serve, full, "zero -> tp=2")
    _check([r["serve_params"] for r in results], serve, full, "tp=2 Parameters")
    assert any(s.layout.shard_shape(s.shape) != s.shape for s in serve.values())  # TP splits something

    # offline: the stage shards as an ms-reshard checkpoint, resharded to TP=2 and to one full copy
    src = tmp_path / "stages"
    save_checkpoint(src, stages, {n: {_tiny.owner_rank(n): a} for n, a in full.items()})
    manifest = load_manifest(src)
    reshard_checkpoint(src, tmp_path / "tp2", model_plan(stages, serve), manifest, SERVE, progress=False)
    got_specs, got = load_checkpoint(tmp_path / "tp2")
    assert got_specs == serve
    _check([{n: r[rank] for n, r in got.items()} for rank in range(2)], serve, full, "checkpoint tp=2")

    whole = {n: type(s)(Layout((1,), ("dp",), ((),) * len(s.shape)), s.shape, s.dtype) for n, s in stages.items()}
    reshard_checkpoint(src, tmp_path / "full", model_plan(stages, whole), manifest, progress=False)
    _, got = load_checkpoint(tmp_path / "full")
    assert got.keys() == full.keys()
    for name, array in full.items():
        np.testing.assert_array_equal(got[name][0], array, err_msg=name)
