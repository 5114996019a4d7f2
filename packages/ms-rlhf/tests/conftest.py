"""Shared fixtures: ms-layout's pytest plugin, and one reference GRPO run other tests compare with."""

from __future__ import annotations

import numpy as np
import pytest

STEPS = 40
CONFIG = dict(jit=True, seed=0, steps=STEPS)  # the shipped defaults: "add" with operands 0..4


def pytest_configure(config):
    if not config.pluginmanager.has_plugin("ms_layout"):
        import ms_layout.testing

        config.pluginmanager.register(ms_layout.testing, "ms_layout")


def params(model) -> dict[str, np.ndarray]:
    """Copies of a model's parameters by name."""
    return {n: p.asnumpy().copy() for n, p in model.parameters_and_names()}


def first_moments(trainer) -> dict[str, np.ndarray]:
    """Copies of Adam's first moments by parameter name: after one step, (1 - beta1) times the step's
    (clipped) gradient."""
    prefix = "moment1.master."
    return {
        n[len(prefix) :]: p.asnumpy().copy()
        for n, p in trainer.optimizer.parameters_and_names()
        if n.startswith(prefix)
    }


@pytest.fixture(scope="session")
def reference_run():
    """A 40-step single-process run with snapshots of the three models after steps 1, 2 and 6."""
    import mindspore as ms

    from ms_rlhf import TrainConfig
    from ms_rlhf.runtime.trainer import GRPOTrainer

    ms.set_device("CPU")
    trainer = GRPOTrainer(TrainConfig(**CONFIG))
    out = {"initial": params(trainer.model), "infer_initial": params(trainer.infer_model),
           "ref_initial": params(trainer.ref_model)}  # fmt: skip
    for step in range(1, STEPS + 1):
        trainer.step()
        if step in (1, 2, 6):
            out[step] = {"train": params(trainer.model), "infer": params(trainer.infer_model),
                         "ref": params(trainer.ref_model), "moment1": first_moments(trainer)}  # fmt: skip
    out["history"] = trainer.history
    return out
