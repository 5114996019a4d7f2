"""vLLM (with the ms-vllm plugin) as the rollout engine: weight sync writes into the model vLLM
serves, and vLLM's log-probs then equal the training forward's. Runs where vllm and ms-vllm are
installed (they are not dependencies of ms-rlhf; see README)."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is imported
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
pytest.importorskip("vllm", reason="vllm is not installed (pip install ms-vllm; vllm --no-deps)")
pytest.importorskip("ms_vllm", reason="ms-vllm is not installed")

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch]


def test_vllm_rollouts_follow_the_synced_policy():
    import mindspore as ms

    from ms_rlhf import RolloutConfig, TrainConfig
    from ms_rlhf.runtime.trainer import GRPOTrainer
    from ms_rlhf.runtime.vllm_engine import VllmEngine

    ms.set_device("CPU")
    trainer = GRPOTrainer(TrainConfig(jit=True, steps=2, rollout=RolloutConfig(engine="vllm", prompts_per_step=4)))
    assert isinstance(trainer.engine, VllmEngine)
    served = trainer.engine.weight_targets()
    for _ in range(2):
        m = trainer.step()
        assert m["infer_train_logprob_maxdiff"] < 1e-4  # vLLM sampled with the weights training computes with
    for name, param in trainer.model.parameters_and_names():
        assert np.array_equal(served[name].asnumpy(), param.asnumpy()), name
