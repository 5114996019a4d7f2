"""The GRPO trainer end to end on one process: weight sync into the rollout and reference models,
packed and padded steps agree, and the reward on the shipped task rises within a CI-sized run.

One 40-step run (module fixture) serves several tests; test_resume.py and test_distributed.py
compare their runs against its history and snapshots too."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CONFIG, STEPS, first_moments, params

from ms_layout.testing import UNIT_ROUNDOFF as U
from ms_layout.testing import assert_close
from ms_rlhf import TrainConfig

pytestmark = pytest.mark.needs_mindspore


def test_models_start_apart_and_sync_makes_them_equal(reference_run):
    from ms_rlhf import make_task
    from ms_rlhf.runtime.policy import build_model

    init = reference_run["initial"]
    other = params(
        build_model(TrainConfig.from_dict(CONFIG), make_task("add").tokenizer, 1000)
    )  # the rollout model's init
    assert any(not np.array_equal(other[n], init[n]) for n in init)
    for name in init:  # after the initial sync: the rollout and reference models hold the initial weights
        assert np.array_equal(reference_run["infer_initial"][name], init[name]), name
        assert np.array_equal(reference_run["ref_initial"][name], init[name]), name
    after = reference_run[1]
    assert any(not np.array_equal(after["train"][n], init[n]) for n in init)  # the step changed the policy
    for name in init:
        assert np.array_equal(after["infer"][name], after["train"][name]), name  # synced bit for bit
        assert np.array_equal(after["ref"][name], init[name]), name  # frozen reference


def test_rollout_and_training_log_probs_agree(reference_run):
    # the rollout engine's log-probs vs the training forward on packed rows, same weights
    assert max(h["infer_train_logprob_maxdiff"] for h in reference_run["history"]) < 1e-4


def test_packing_never_exceeds_the_bound_by_much(reference_run):
    for h in reference_run["history"]:
        assert h["pack_lower_bound"] <= h["packs"] <= h["pack_lower_bound"] + 1


def test_reward_rises(reference_run):
    rewards = np.array([h["reward"] for h in reference_run["history"]])
    first, last = rewards[:10].mean(), rewards[-10:].mean()
    print(f"mean reward: steps 1-10 {first:.3f}, steps {STEPS - 9}-{STEPS} {last:.3f}; curve {np.round(rewards, 3)}")
    assert last > first + 0.1 and last > 3 * first


def test_padded_step_equals_packed_step(reference_run):
    from ms_rlhf.runtime.trainer import GRPOTrainer

    trainer = GRPOTrainer(TrainConfig.from_dict({**CONFIG, "packing.enabled": False, "packing.micro_batch_size": 8}))
    m = trainer.step()
    want = reference_run["history"][0]
    assert m["packs"] == 0 and want["packs"] > 0
    assert m["reward"] == want["reward"]  # same weights, keyed sampling: the same rollout
    assert abs(m["loss"] - want["loss"]) <= 1e-6 and abs(m["kl"] - want["kl"]) <= 1e-6
    # The gradients (Adam's first moment after one step is (1 - beta1) times the clipped gradient):
    # the same float32 math summed in another order, so equal to rounding relative to each tensor's
    # scale. A length-n sum in another order is off by up to ~n*u of its terms; a gradient sums over
    # the step's <= 64 sequences x 16 tokens (1024), after a chain through the one layer and the
    # head (2 x (64 + 32 + 15) < 256): n < 2048 (measured: <= 5.4 u).
    moments = first_moments(trainer)
    for name, want_m in reference_run[1]["moment1"].items():
        assert_close(moments[name], want_m, 2048 * U, f"Adam first moment of {name}")
    # The weights: Adam's first update, lr * g / (|g| + eps), moves an entry whose gradient is within a
    # few eps of zero by an amount its rounding decides (the q/k projections' gradients are at most
    # ~3e-5; measured: 1.2e-6 = 1.2e-4 lr), so the weights agree to a fraction of lr, not of their scale.
    # An update applied differently (skipped, doubled, another lr) moves the other entries by ~lr.
    lr = trainer.config.optimizer.lr
    packed = reference_run[1]["train"]
    for name, value in params(trainer.model).items():
        assert_close(value, packed[name], 0.0, f"weight {name} after the step", atol=1e-2 * lr)
