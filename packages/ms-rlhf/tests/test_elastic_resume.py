"""Elastic resume: kill -9 a run mid-way, resume it on another number of ranks (2 -> 1, 1 -> 2, with
optimizer sharding switched too), and the run goes on as the single-process reference run did.

The checkpoint's master, reference and Adam shards are resharded by ms-reshard into the new
layout (runtime/elastic.py). Weights, Adam state, data cursor and rollouts carry over exactly; the
world size changes how micro-batches split over ranks and the order gradients add up in, so the
losses match the reference within float32 summation-order error, as the 2-rank run itself does
(test_distributed.py), and the final weights too."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import CONFIG, flatten_checkpoint_config
from test_resume import cli

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch]

STEPS = 6  # the reference run keeps its weights after step 6


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (the launcher's forkserver and the ranks it started), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except (OSError, ValueError):
            continue  # not a process, or gone
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _kill_at(cmd, ckpt, step: int, log_path) -> int:
    """Run `cmd` and SIGKILL it and every process it started (the ranks run in process groups of
    their own) once a checkpoint of `step` or later is in place; returns the step it was killed after."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        try:
            while time.time() < deadline and proc.poll() is None:
                latest = ckpt / "LATEST"
                if latest.exists() and latest.read_text() >= f"step_{step:06d}":
                    break
                time.sleep(0.05)
        finally:
            for pid in [proc.pid, *_descendants(proc.pid)]:  # mid-run, every rank at once
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, open(log_path).read()[-3000:]
    killed_at = int((ckpt / "LATEST").read_text().split("_")[1])
    assert step <= killed_at < STEPS
    return killed_at


@pytest.mark.parametrize(
    "first, then",
    [((2, True), (1, False)), ((1, False), (2, True))],
    ids=["2-ranks-zero-to-1", "1-rank-to-2-zero"],
)
def test_kill_9_then_resume_on_another_world_size(tmp_path, reference_run, first, then):
    from safetensors.numpy import load_file

    ckpt = tmp_path / "ckpt"
    config = tmp_path / "run.json"
    base = {**CONFIG, "steps": STEPS, "checkpoint": {"dir": str(ckpt), "every": 1}}
    config.write_text(json.dumps({**base, "parallel": {"optimizer_shard": first[1]}}))
    killed_at = _kill_at(cli(config, "--nprocs", str(first[0])), ckpt, 2, tmp_path / "killed.log")
    assert checkpoint_world(ckpt / f"step_{killed_at:06d}") == first[0]
    if first[0] == 2:
        _damaged_copy_is_refused(ckpt / f"step_{killed_at:06d}", tmp_path / "damaged", then)
        # an earlier version's checkpoint: its stored config flat, the layout read from it all the same
        flatten_checkpoint_config(ckpt / f"step_{killed_at:06d}")

    extra = ("--nprocs", str(then[0]), "--set", f"parallel.optimizer_shard={str(then[1]).lower()}")
    out = subprocess.run(cli(config, "--resume", "auto", "--json", *extra), capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"from {first[0]} to {then[0]} ranks" in out.stderr  # it resharded, not a same-layout load
    summary = json.loads(out.stdout)
    assert summary["resumed_from"].endswith(f"step_{killed_at:06d}") and summary["steps"] == STEPS
    ref = reference_run["history"][:STEPS]
    assert summary["rewards"] == [h["reward"] for h in ref]  # keyed sampling: the same rollouts
    for got, want in zip(summary["losses"], (h["loss"] for h in ref)):
        assert abs(got - want) <= 1e-6 + 1e-5 * abs(want)
    final = summary["checkpoint"]
    assert checkpoint_world(final) == then[0]
    shards = [load_file(os.path.join(final, f"rank_{r:05d}.safetensors")) for r in range(then[0])]
    for name, value in reference_run[STEPS]["train"].items():
        got = shards[0][f"master.{name}"]
        if got.shape != value.shape:  # ZeRO: dim 0 split over the ranks
            got = np.concatenate([s[f"master.{name}"] for s in shards])
        np.testing.assert_allclose(got, value, rtol=1e-4, atol=1e-6, err_msg=name)


def _damaged_copy_is_refused(good, damaged, then) -> None:
    """A resharding resume reads every old rank's file: a flipped byte in one it would read from
    is a CheckpointError naming that file, and nothing is written (the good checkpoint is intact)."""
    from ms_rlhf import TrainConfig
    from ms_rlhf.errors import CheckpointError
    from ms_rlhf.runtime.trainer import GRPOTrainer

    shutil.copytree(good, damaged)
    target = damaged / "rank_00001.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    trainer = GRPOTrainer(TrainConfig.from_dict({**CONFIG, "parallel.optimizer_shard": then[1]}))
    with pytest.raises(CheckpointError, match="rank_00001.safetensors"):
        trainer.load_checkpoint(str(damaged))
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before


def checkpoint_world(path) -> int:
    return json.loads(Path(path, "manifest.json").read_text())["world_size"]
