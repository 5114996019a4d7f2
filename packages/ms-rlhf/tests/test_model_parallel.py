"""GRPO with the actor trained under tensor parallelism (tp=2) or pipeline parallelism (pp=2,
ZeroBubbleV) on 2 gloo ranks: the same losses as one process, the rollout model fed by ms-reshard
from the split master weights with exactly the bytes it lacks, and the run's checkpoint resumed on
one rank (tp2 -> 1, pp2 -> 1) and the tp2 one as pp2 (tp2 -> pp2), going on as the single-process
run does.

The TP shard is ms_models.parallel.training_shard (Megatron's f and g, eager): each rank holds half
of every projection, the embedding, norms and head whole. The pipelined actor is ms-pipeline's
runtime over the model's blocks (compiled), the GRPO loss in the head block: each rank holds its
two stages' weights. One rank's losses differ from these runs' only by the order of float32 sums."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CONFIG

from ms_rlhf.config import DEFAULT_MODEL

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch]

STEPS = 3
# one model both splits take: two kv heads (tp=2), two layers (ZeroBubbleV's four stages need four
# blocks: embedding, two layers, head), padded rows (pipeline blocks see one causal row)
MODEL = {**DEFAULT_MODEL, "num_key_value_heads": 2, "num_hidden_layers": 2}
BASE = {**CONFIG, "steps": STEPS, "packing.enabled": False, "model": MODEL}


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-6 + 1e-5 * abs(want)


def parallel_rank(group, config: dict) -> dict:
    import mindspore as ms

    from ms_rlhf import TrainConfig
    from ms_rlhf.runtime.trainer import GRPOTrainer

    ms.set_device("CPU")
    trainer = GRPOTrainer(TrainConfig.from_dict(config), group)
    for _ in range(config["steps"]):
        trainer.step()
    path = trainer.save_checkpoint()
    into_train = trainer.sync.run(trainer.master, dict(trainer.model.parameters_and_names()), to="train")
    into_rollout = trainer.sync.run(trainer.master, trainer.engine.weight_targets())
    return {
        "into_train": (into_train.received_bytes, into_train.local_bytes),
        "into_rollout": (into_rollout.received_bytes, into_rollout.local_bytes),
        "master_bytes": sum(p.asnumpy().nbytes for p in trainer.master.values()),
        "history": trainer.history,
        "path": path,
        "infer": {n: p.asnumpy().copy() for n, p in trainer.infer_model.parameters_and_names()},
        "train_shapes": {n: tuple(p.shape) for n, p in trainer.model.parameters_and_names()},
        "master": sorted(trainer.master),
        "received": trainer.sync.received_bytes,
        "lower_bound": trainer.sync.lower_bound_bytes,
        "train_plan_bytes": trainer.sync.to_train.bytes_moved(),
    }


@pytest.fixture(scope="module")
def one_process():
    """The single-process run both splits are held to: its trainer after STEPS + 1 steps and its
    weights after STEPS."""
    import mindspore as ms

    from ms_rlhf import TrainConfig
    from ms_rlhf.runtime.trainer import GRPOTrainer

    ms.set_device("CPU")
    one = GRPOTrainer(TrainConfig.from_dict({**BASE, "steps": STEPS + 1}))
    for _ in range(STEPS):
        one.step()
    want = {n: p.asnumpy().copy() for n, p in one.model.parameters_and_names()}
    one.step()
    return one, want


@pytest.mark.parametrize("split", [{"parallel.tp": 2}, {"parallel.pp": 2}], ids=["tp2", "pp2-zbv"])
def test_two_ranks_match_one_rank_and_resume_on_one(run_ranks, tmp_path, split, one_process):
    from ms_rlhf import TrainConfig
    from ms_rlhf.runtime.trainer import GRPOTrainer

    one, want = one_process

    config = {**BASE, **split, "checkpoint.dir": str(tmp_path / "ckpt")}
    results = run_ranks(parallel_rank, nprocs=2, backend="gloo", timeout=900, args=(config,))
    for rank, r in enumerate(results):
        assert [h["reward"] for h in r["history"]] == [h["reward"] for h in one.history[:STEPS]]
        for got, ref in zip(r["history"], one.history):
            assert _close(got["loss"], ref["loss"]), (rank, got["loss"], ref["loss"])
        q = "model.layers.0.self_attn.q_proj.weight"
        if "parallel.tp" in split:
            assert r["train_shapes"][q] == (want[q].shape[0] // 2, want[q].shape[1])  # half of the heads
            assert r["train_shapes"]["lm_head.weight"] == want["lm_head.weight"].shape  # the head whole
        else:  # ZeroBubbleV's V: rank 0 holds stages 0 and 3 (embedding, head), rank 1 the layers
            held = {n.split(".")[0] if "layers" not in n else n.split(".")[2] for n in r["master"]}
            assert held == ({"model", "lm_head"} if rank == 0 else {"0", "1"}), held
        # the rollout model gets what this rank lacks, nothing more
        assert r["received"] == r["lower_bound"] > 0
        assert r["train_plan_bytes"] == 0  # the training model's weights are the master's own
        # each plan's own figures: the training model copies this rank's masters, the rollout model
        # receives the rest of the whole model
        total = sum(v.nbytes for v in want.values())
        assert r["into_train"] == (0, r["master_bytes"]) and 0 < r["master_bytes"] < total
        assert r["into_rollout"] == (r["received"], total - r["received"])
        for name, value in want.items():
            np.testing.assert_allclose(r["infer"][name], value, rtol=1e-4, atol=1e-6, err_msg=name)

    # tp2 -> 1: the checkpoint's TP shards resharded into one rank's layout, then one more step
    resumed = GRPOTrainer(TrainConfig.from_dict({**BASE, "steps": STEPS + 1}))
    resumed.load_checkpoint(results[0]["path"])
    for name, p in resumed.model.parameters_and_names():
        assert np.array_equal(p.asnumpy(), results[0]["infer"][name]), name  # a copy of the gathered shards
    resumed.step()
    assert resumed.history[-1]["reward"] == one.history[-1]["reward"]
    assert _close(resumed.history[-1]["loss"], one.history[-1]["loss"])
    if "parallel.tp" in split:  # tp2 -> pp2: the TP shards resharded into the pipeline's stages, one more step
        config = {**BASE, "parallel.pp": 2, "steps": STEPS + 1}
        for last in run_ranks(resume_rank, nprocs=2, backend="gloo", timeout=900, args=(config, results[0]["path"])):
            assert last["reward"] == one.history[-1]["reward"]
            assert _close(last["loss"], one.history[-1]["loss"])


def resume_rank(group, config: dict, path: str) -> dict:
    import mindspore as ms

    from ms_rlhf import TrainConfig
    from ms_rlhf.runtime.trainer import GRPOTrainer

    ms.set_device("CPU")
    trainer = GRPOTrainer(TrainConfig.from_dict(config), group)
    trainer.load_checkpoint(path)
    return trainer.step()


@pytest.mark.parametrize("split", [{"parallel.tp": 2}, {"parallel.pp": 2, "packing.enabled": False}])
def test_a_split_that_does_not_fit_the_ranks_is_refused(split):
    from ms_rlhf import RLHFError, TrainConfig
    from ms_rlhf.runtime.trainer import GRPOTrainer

    with pytest.raises(RLHFError, match="do not fit the 1 ranks of this run"):
        GRPOTrainer(TrainConfig.from_dict({**BASE, **split}))


class _Rank:
    """The rank and size of a process group, for building one rank's pipeline stages in this process
    (building them sends nothing)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.ranks = rank, size, tuple(range(size))


@pytest.mark.parametrize("schedule", ["zbv", "1f1b"])
def test_owners_name_the_ranks_whose_stages_hold_each_parameter(schedule):
    """`owners` derives a parameter's rank from its name; the pipelined actor's runtime holds the
    parameters of each rank's stages. Three layers cut unevenly (5 blocks over 4 or 2 stages)."""
    import mindspore as ms

    from ms_rlhf import TrainConfig, make_task
    from ms_rlhf.runtime.pipelined import PipelinedActor, build_schedule, owners
    from ms_rlhf.runtime.policy import build_model

    ms.set_device("CPU")
    config = TrainConfig.from_dict({**BASE, "model": {**MODEL, "num_hidden_layers": 3}, "jit": False,
                                    "parallel.pp": 2, "parallel.pipeline_schedule": schedule})  # fmt: skip
    model = build_model(config, make_task("add").tokenizer, 0)
    names = [n for n, _ in model.parameters_and_names()]
    held = [(name, rank) for rank in (0, 1) for name in PipelinedActor(model, _Rank(rank, 2), 4, 2, 16, config).names]
    assert sorted(n for n, _ in held) == sorted(names)  # every parameter on exactly one rank
    schedule = build_schedule(schedule, 2, 4)
    assert owners(names, 3, schedule) == dict(held)
    assert {r for _, r in held} == {0, 1}
