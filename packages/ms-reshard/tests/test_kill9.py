"""`ms-reshard checkpoint --overwrite` killed with SIGKILL at 20 random moments: the checkpoint
already in place still verifies after every kill, and the next run succeeds and leaves no
temporary folder behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np

from ms_layout import ParallelConfig
from ms_reshard import param_specs
from ms_reshard.checkpoint import load_checkpoint, load_manifest, save_checkpoint, verify

# 8 MiB per tensor: writing the target takes long enough for kills to land inside the write
SHAPES = {"model.embed_tokens.weight": (2048, 1024), "lm_head.weight": (2048, 1024), "model.norm.weight": (1024,)}


def _run(src, dst):
    args = ["checkpoint", str(src), str(dst), "--dst-config", "tp=4", "--overwrite", "--json"]
    return subprocess.Popen(
        [sys.executable, "-m", "ms_reshard.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def _leftovers(dst, pid: int | None = None) -> list[str]:
    """Temporary names beside `dst` (``.dst.tmp-PID-*``, ``.dst.old-PID-*``), of one writer if `pid`."""
    names = (n for n in os.listdir(dst.parent) if n.startswith(f".{dst.name}."))
    return sorted(n for n in names if pid is None or f"-{pid}-" in n)


def _same(dst, want) -> None:
    verify(dst, load_manifest(dst))
    _, shards = load_checkpoint(dst)
    for name in SHAPES:
        for rank, array in want[name].items():
            np.testing.assert_array_equal(shards[name][rank], array)


def test_kill9_during_checkpoint_keeps_the_good_copy(tmp_path):
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    specs = param_specs(SHAPES, ParallelConfig(tp=2), num_layers=1)
    shards = {n: {r: weights[n][s.layout.global_slice(s.shape, r)] for r in s.layout.ranks} for n, s in specs.items()}
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_checkpoint(src, specs, shards, model={"num_layers": 1})
    first = _run(src, dst)
    assert first.wait(timeout=120) == 0, first.stderr.read().decode()
    want = load_checkpoint(dst)[1]

    delays = random.Random(16)
    left_behind = 0
    for i in range(20):
        proc = _run(src, dst)
        if i % 2:  # a random moment of the whole run, start-up included
            time.sleep(delays.uniform(0.0, 1.5))
        else:  # a random moment once the temporary folder exists: inside the write or the swap
            deadline = time.monotonic() + 60
            while not _leftovers(dst, proc.pid) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(delays.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        left_behind += bool(_leftovers(dst, proc.pid))
        _same(dst, want)  # whatever the moment, the checkpoint in place verifies and holds the data

    print(f"{left_behind} of 20 kills left a temporary folder behind")
    assert left_behind >= 1  # some kills did land inside a write
    last = _run(src, dst)
    assert last.wait(timeout=120) == 0, last.stderr.read().decode()
    assert _leftovers(dst) == []
    _same(dst, want)
