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


class GatedMLP:
    """A SwiGLU MLP whose linear_fc1 holds gate and up either stacked ([gate; up], Megatron) or with
    their rows interleaved ([g0, u0, g1, u1, ...], MindSpore Transformers' default): the same layer."""

    def __init__(self, interleaved: bool, prefix: str, seed: int = 0, hidden: int = 8, width: int = 6):
        rng = np.random.default_rng(seed)
        self.gate, self.up = (rng.normal(0, 0.3, (width, hidden)).astype(np.float32) for _ in range(2))
        self.down = rng.normal(0, 0.3, (hidden, width)).astype(np.float32)
        stacked = np.concatenate([self.gate, self.up])
        self.w1 = np.stack([self.gate, self.up], 1).reshape(2 * width, hidden) if interleaved else stacked
        self.interleaved, self.prefix, self.width = interleaved, prefix, width

    def run(self, rec: Recorder, x: np.ndarray) -> np.ndarray:
        p, w = self.prefix, self.width
        rec.forward_pre(f"{p}.linear_fc1", "Linear", (x,), {})
        h = x @ self.w1.T
        rec.forward_post(f"{p}.linear_fc1", h, [("weight", self.w1)])
        g, u = (h[:, 0::2], h[:, 1::2]) if self.interleaved else (h[:, :w], h[:, w:])
        act = g / (1 + np.exp(-g)) * u
        rec.forward_pre(f"{p}.linear_fc2", "Linear", (act,), {})
        out = act @ self.down.T
        rec.forward_post(f"{p}.linear_fc2", out, [("weight", self.down)])
        # backward of sum(out): the gradient into linear_fc1's output, in this layer's own layout
        d_act = np.ones_like(out) @ self.down
        sig = 1 / (1 + np.exp(-g))
        dg, du = d_act * u * sig * (1 + g * (1 - sig)), d_act * g * sig
        dh = np.stack([dg, du], -1).reshape(h.shape) if self.interleaved else np.concatenate([dg, du], -1)
        rec.backward(f"{p}.linear_fc1", "Linear", (dh @ self.w1,), (dh,), None)
        rec.param_grad(f"{p}.linear_fc1", "Linear", "weight", dh.T @ x, 1)
        return out
