"""What every stage of the demo shares: the model it trains, its text, checks and small helpers.

The demo is a script, not a package: ``python demo/run.py`` puts demo/ first on sys.path, so the
stages import this module as ``common`` (and spawned ranks find it the same way: multiprocessing's
spawn hands the parent's sys.path to its children).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# The pretraining text. The tiny model memorises it in a few dozen steps, so the prompts served by
# vLLM afterwards come back with a recognisable continuation, not random tokens.
TEXT = (
    "The pipeline runs the forward of one microbatch while the next one waits. "
    "Zero bubble schedules split the backward into the input gradient and the weight gradient. "
    "The weight gradient fills the idle time that the input gradient leaves behind. "
    "Recompute keeps only the inputs of a layer and runs its forward again in the backward. "
    "The checkpoint is gathered from the stages and served by vLLM with MindSpore. "
)

PROMPTS = (
    "The pipeline runs the",
    "Zero bubble schedules split",
    "Recompute keeps only",
    "The checkpoint is gathered",
)


@dataclass(frozen=True)
class ModelSpec:
    """The tiny DeepSeek-V3-style model every stage uses (ms-models' tiny config, overridden)."""

    arch: str = "deepseek_v3"
    """ms_models.tiny_config architecture."""
    layers: int = 4
    """Decoder layers (the first dense, the rest MoE, as DeepSeek-V3's first_k_dense_replace=1)."""
    seed: int = 0
    """Seed of the initial weights."""

    def overrides(self) -> dict[str, Any]:
        # no MTP module: the pipeline trains the main model only (an MTP head would need the
        # embedding on the last stage too)
        return {"num_hidden_layers": self.layers, "num_nextn_predict_layers": 0}


@dataclass
class Check:
    """One verified claim of a stage."""

    name: str
    """What was checked."""
    passed: bool
    """Whether it held."""
    detail: str = ""
    """The numbers behind it."""


@dataclass
class StageResult:
    """What every stage returns: its checks, its wall time and numbers for the report."""

    name: str
    """Stage name."""
    seconds: float = 0.0
    """Wall-clock time of the stage."""
    checks: list[Check] = field(default_factory=list)
    """Its verified claims."""
    numbers: dict[str, Any] = field(default_factory=dict)
    """Headline numbers (JSON-able) for the summary table and the report."""

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(passed), detail))
        return bool(passed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seconds": round(self.seconds, 2),
            "passed": self.passed,
            "checks": [c.__dict__ for c in self.checks],
            "numbers": self.numbers,
        }


@contextmanager
def timed(result: StageResult):
    start = time.perf_counter()
    try:
        yield result
    finally:
        result.seconds = time.perf_counter() - start


def tokenize(model_dir: str | os.PathLike, text: str) -> list[int]:
    """Token ids of `text` with the tokenizer ms_models.make_tiny wrote next to the weights."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).encode(text).ids


def batches(tokens: list[int], steps: int, microbatches: int, micro_batch: int, seq: int, seed: int):
    """For each step, `microbatches` (ids, labels) pairs of int32 [micro_batch, seq] windows of the
    text at seeded random offsets: the same batches for the pipeline and for the reference."""
    ids = np.asarray(tokens, np.int32)
    if len(ids) < seq + 2:
        raise ValueError(f"the text has {len(ids)} tokens; seq={seq} needs at least {seq + 2}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - seq - 1, size=(microbatches, micro_batch))
        windows = np.stack([[ids[s : s + seq + 1] for s in row] for row in starts])
        out.append([(w[:, :-1].copy(), w[:, 1:].copy()) for w in windows])
    return out


def setup_mindspore(threads: int = 1) -> None:
    """PyNative on CPU (hot paths compile themselves with mindspore.jit; ms-probe's hooks need
    PyNative), synchronous (what stays eager does not queue behind Python's ``.shape`` reads, docs/mindspore-cpu.md),
    few threads: the box is shared."""
    import mindspore as ms

    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    ms.set_context(mode=ms.PYNATIVE_MODE, runtime_num_threads=threads, pynative_synchronize=True)
    ms.set_device("CPU")


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write JSON whole or not at all (ms_layout.files: a temporary name, fsync, rename)."""
    from ms_layout.files import atomic_write

    atomic_write(path, json.dumps(data, indent=1, default=str))
    return Path(path)
