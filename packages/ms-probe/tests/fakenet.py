"""A numpy "framework" for tests that need no MindSpore or torch: modules with forward calls,
driven through the real Recorder and DumpWriter, so the dump, reader and compare run end to end."""

from __future__ import annotations

from typing import Any

import numpy as np

from ms_probe.config import DumpConfig
from ms_probe.recorder import Recorder


class NumpyAdapter:
    framework = "numpy"
    prefix = "Cell"
    type_name = "numpy.ndarray"

    def __init__(self, prefix: str = "Cell"):
        self.prefix = prefix

    def is_tensor(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def to_numpy(self, x: Any) -> np.ndarray:
        return x

    def dtype_name(self, x: Any) -> str:
        return str(x.dtype)

    def requires_grad(self, x: Any):
        return None

    def other_info(self, x: Any):
        return None


class MLPNet:
    """x -> [fc1 -> act -> fc2] (block) -> norm, with names and weights; `scale` injects a bug in act."""

    def __init__(self, seed: int = 0, scale: float = 1.0, names=("block", "fc1", "act", "fc2", "norm")):
        rng = np.random.default_rng(seed)
        self.w1 = rng.normal(0, 0.3, (16, 8)).astype(np.float32)
        self.w2 = rng.normal(0, 0.3, (8, 16)).astype(np.float32)
        self.scale = scale
        self.names = names

    def run(self, rec: Recorder, x: np.ndarray) -> np.ndarray:
        block, fc1, act, fc2, norm = self.names

        def call(path, cls, fn, arg, params=()):
            rec.forward_pre(path, cls, (arg,), {})
            out = fn(arg)
            rec.forward_post(path, out, list(params))
            return out

        def blk(h):
            h = call(f"{block}.{fc1}", "Dense", lambda a: a @ self.w1.T, h, [("weight", self.w1)])
            h = call(f"{block}.{act}", "ReLU", lambda a: np.maximum(a, 0) * self.scale, h)
            return call(f"{block}.{fc2}", "Dense", lambda a: a @ self.w2.T, h, [("weight", self.w2)])

        h = call(block, "MLP", blk, x)
        out = call(norm, "Norm", lambda a: a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6), h)
        # A backward pass in miniature: gradients of sum(out) flow back through norm then block.
        g = np.ones_like(out)
        rec.backward(norm, "Norm", (g * 0.5,), (g,), None)
        rec.param_grad(f"{block}.{fc2}", "Dense", "weight", (g * 0.5).T @ np.maximum(x @ self.w1.T, 0) * self.scale, 1)
        rec.backward(f"{block}.{fc2}", "Dense", (g @ self.w2 * 0.5,), (g * 0.5,), (block, "MLP"))
        rec.backward(block, "MLP", (x,), (g * 0.5,), None)
        return out


def dump_fake(path, net: MLPNet, task="statistics", step=0, rank=0, prefix="Cell", x=None, **cfg) -> str:
    rec = Recorder(DumpConfig(dump_path=str(path), task=task, **cfg), NumpyAdapter(prefix), rank)
    rec.step = step
    rec.start()
    x = np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32) if x is None else x
    net.run(rec, x)
    return rec.stop()
