"""GRPO with the actor trained under tensor parallelism (tp=2 on 2 gloo ranks): the same losses as
one process, the rollout model fed by ms-reshard from the TP-sharded master weights with exactly
the bytes it lacks, and the run's checkpoint resumed on one rank (tp2 -> 1) going on as the
single-process run does.

The TP shard is ms_models.parallel.training_shard (Megatron's f and g, eager); each rank holds half
of every projection, the embedding, norms and head whole. One rank's losses differ from the TP
run's only by the row-parallel sums' order (float32)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CONFIG

from ms_rlhf.config import DEFAULT_MODEL

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch]

STEPS = 3
TP_CONFIG = {**CONFIG, "steps": STEPS, "model": {**DEFAULT_MODEL, "num_key_value_heads": 2}}


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-6 + 1e-5 * abs(want)


def tp_rank(group, config: dict) -> dict:
    import mindspore as ms

    from ms_rlhf import TrainConfig
    from ms_rlhf.runtime.trainer import GRPOTrainer

    ms.set_device("CPU")
    trainer = GRPOTrainer(TrainConfig(**config), group)
    for _ in range(config["steps"]):
        trainer.step()
    path = trainer.save_checkpoint()
    return {
        "history": trainer.history,
        "path": path,
        "infer": {n: p.asnumpy().copy() for n, p in trainer.infer_model.parameters_and_names()},
        "train_shapes": {n: tuple(p.shape) for n, p in trainer.model.parameters_and_names()},
        "received": trainer.sync.received_bytes,
        "lower_bound": trainer.sync.lower_bound_bytes,
        "train_plan_bytes": trainer.sync.to_train.bytes_moved(),
    }


def test_tp2_matches_one_rank_and_resumes_on_one(run_ranks, tmp_path):
    import mindspore as ms

    from ms_rlhf import TrainConfig
    from ms_rlhf.runtime.trainer import GRPOTrainer

    ms.set_device("CPU")
    one = GRPOTrainer(TrainConfig(**{**TP_CONFIG, "steps": STEPS + 1}))
    for _ in range(STEPS):
        one.step()
    want = {n: p.asnumpy().copy() for n, p in one.model.parameters_and_names()}
    one.step()

    config = {**TP_CONFIG, "tp": 2, "checkpoint_dir": str(tmp_path / "ckpt")}
    results = run_ranks(tp_rank, nprocs=2, backend="gloo", timeout=900, args=(config,))
    for rank, r in enumerate(results):
        assert [h["reward"] for h in r["history"]] == [h["reward"] for h in one.history[:STEPS]]
        for got, ref in zip(r["history"], one.history):
            assert _close(got["loss"], ref["loss"]), (rank, got["loss"], ref["loss"])
        q = "model.layers.0.self_attn.q_proj.weight"
        assert r["train_shapes"][q] == (want[q].shape[0] // 2, want[q].shape[1])  # half of the heads
        assert r["train_shapes"]["lm_head.weight"] == want["lm_head.weight"].shape  # the head whole
        # the rollout model gets the half it lacks of each split weight, nothing more
        assert r["received"] == r["lower_bound"] > 0
        assert r["train_plan_bytes"] == 0  # the training shard is the master's own slice
        for name, value in want.items():
            np.testing.assert_allclose(r["infer"][name], value, rtol=1e-4, atol=1e-6, err_msg=name)

    # tp2 -> 1: the checkpoint's TP shards resharded into one rank's layout, then one more step
    resumed = GRPOTrainer(TrainConfig(**{**TP_CONFIG, "steps": STEPS + 1}))
    resumed.load_checkpoint(results[0]["path"])
    for name, p in resumed.model.parameters_and_names():
        assert np.array_equal(p.asnumpy(), results[0]["infer"][name]), name  # a copy of the gathered shards
    resumed.step()
    assert resumed.history[-1]["reward"] == one.history[-1]["reward"]
    assert _close(resumed.history[-1]["loss"], one.history[-1]["loss"])
