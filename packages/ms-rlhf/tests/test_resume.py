"""kill -9 the trainer in the middle of a run, restart it with --resume, and the losses and the
final weights equal an uninterrupted run's bit for bit -- with the config file and the checkpoint's
stored config in the flat form of earlier versions (nested is what this version writes).

The uninterrupted run is the session's reference run (conftest.py, in this process); the
interrupted and resumed runs are `ms-rlhf train` processes. Rollout sampling is keyed by
(seed, step, request), the data cursor and RNG states are in the checkpoint, and every kernel
runs on CPU in a fixed order, so nothing is left to chance."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import CONFIG, OLD_FLAT_DEFAULTS, flatten_checkpoint_config

pytestmark = pytest.mark.needs_mindspore

STEPS = 6


def cli(config_path, *extra):
    return [sys.executable, "-m", "ms_rlhf.cli", "train", "--config", str(config_path), "--no-progress", *extra]


def test_kill_9_then_resume_is_bit_exact(tmp_path, reference_run):
    from safetensors.numpy import load_file

    ckpt = tmp_path / "ckpt"
    config = tmp_path / "run.json"
    # a config file as users of earlier versions wrote it: flat keys
    config.write_text(json.dumps({**CONFIG, "steps": STEPS, "checkpoint_dir": str(ckpt), "checkpoint_every": 1}))
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen(cli(config), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    try:
        while time.time() < deadline and proc.poll() is None:
            latest = ckpt / "LATEST"
            if latest.exists() and latest.read_text() >= "step_000002":
                os.kill(proc.pid, signal.SIGKILL)  # mid-run: no chance to clean up
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, open(tmp_path / "killed.log").read()[-3000:]
    killed_at = int((ckpt / "LATEST").read_text().split("_")[1])
    assert 2 <= killed_at < STEPS
    # the checkpoint as an earlier version wrote it: its config flat (resume compares against it)
    stored = flatten_checkpoint_config(ckpt / f"step_{killed_at:06d}")
    assert stored.keys() == OLD_FLAT_DEFAULTS.keys() and stored["checkpoint_dir"] == str(ckpt)

    out = subprocess.run(cli(config, "--resume", "auto", "--json"), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert summary["resumed_from"].endswith(f"step_{killed_at:06d}") and summary["steps"] == STEPS
    want = [h["loss"] for h in reference_run["history"][:STEPS]]
    assert summary["losses"] == want  # bit-exact: float equality of every step's loss
    assert summary["rewards"] == [h["reward"] for h in reference_run["history"][:STEPS]]
    final = load_file(os.path.join(summary["checkpoint"], "rank_00000.safetensors"))
    for name, value in reference_run[STEPS]["train"].items():
        assert np.array_equal(final[f"master.{name}"], value), name
