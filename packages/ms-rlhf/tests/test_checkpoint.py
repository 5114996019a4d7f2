"""Checkpoint files: atomic, verified, and a half-written one is never picked up."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from ms_rlhf import CheckpointError, checkpoint
from ms_rlhf.runtime.group import SingleProcessGroup


def test_round_trip_and_latest(tmp_path):
    group = SingleProcessGroup()
    arrays = {"master.w": np.arange(6, dtype=np.float32).reshape(2, 3), "optim.step": np.array([3], np.int32)}
    path = checkpoint.save(tmp_path, 3, arrays, {"step": 3, "note": "x"}, group)
    assert checkpoint.latest(tmp_path) == path
    got, state = checkpoint.load(tmp_path, 0, 1)
    assert state == {"step": 3, "note": "x"}
    assert all(np.array_equal(got[k], v) for k, v in arrays.items())
    for step in (4, 5):
        checkpoint.save(tmp_path, step, arrays, {"step": step}, group, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "step_000004", "step_000005"]


def test_corruption_and_wrong_world_size_are_refused(tmp_path):
    group = SingleProcessGroup()
    path = checkpoint.save(tmp_path, 1, {"w": np.ones(8, np.float32)}, {"step": 1}, group)
    with pytest.raises(CheckpointError, match="written by 1 ranks; this run has 2"):
        checkpoint.load(path, 0, 2)
    blob = os.path.join(path, checkpoint.rank_file(0))
    data = bytearray(open(blob, "rb").read())
    data[-1] ^= 0xFF
    open(blob, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="rank_00000.safetensors. does not match its sha256"):
        checkpoint.load(path, 0, 1)


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path):
    group = SingleProcessGroup()
    good = checkpoint.save(tmp_path, 1, {"w": np.ones(2, np.float32)}, {"step": 1}, group)
    # saves killed half way (this version's temporary name and 0.1's): LATEST still names step 1
    dead = subprocess.Popen(["true"])
    dead.wait()
    for stale in (f".step_000002.tmp-{dead.pid}-x1", ".step_000002.tmp"):
        os.makedirs(tmp_path / stale)
        (tmp_path / stale / checkpoint.rank_file(0)).write_bytes(b"partial")
    assert checkpoint.latest(tmp_path) == good
    assert checkpoint.resolve(tmp_path) == good
    checkpoint.save(tmp_path, 2, {"w": np.zeros(2, np.float32)}, {"step": 2}, group)
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "step_000001", "step_000002"]
    with pytest.raises(CheckpointError, match="no checkpoint"):
        checkpoint.resolve(tmp_path / "nowhere")


def _two_rank_save_and_resume(group, root):
    from ms_rlhf import CheckpointConfig, TrainConfig
    from ms_rlhf.runtime.run import _resume_path

    for step, value in ((4, 1.0), (4, 2.0), (5, 3.0)):  # (4, 2.0): the re-save of a step
        arrays = {"w": np.full(3, value + group.rank, np.float32)}
        checkpoint.save(root, step, arrays, {"step": step} if group.rank == 0 else None, group)
    if group.rank == 0:  # step 5 damaged: every rank must still agree on step 4
        with open(os.path.join(root, "step_000005", checkpoint.rank_file(1)), "r+b") as f:
            f.write(b"X")
    group.barrier()
    path, skipped = _resume_path(TrainConfig(checkpoint=CheckpointConfig(dir=str(root))), "auto", group)
    arrays, state = checkpoint.load(path, group.rank, group.size)
    return path, [s["checkpoint"] for s in skipped], arrays["w"].tolist(), state


@pytest.mark.needs_torch
def test_two_ranks_save_resave_and_agree_on_the_fallback(run_ranks, tmp_path):
    results = run_ranks(_two_rank_save_and_resume, nprocs=2, backend="gloo", timeout=300, args=(str(tmp_path),))
    path = str(tmp_path / "step_000004")
    assert results[0] == (path, ["step_000005"], [2.0] * 3, {"step": 4})
    assert results[1] == (path, [], [3.0] * 3, {"step": 4})  # rank 1 follows rank 0's choice
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "step_000004", "step_000005"]
    assert sorted(checkpoint.read_manifest(path)["files"]) == ["rank_00000.safetensors", "rank_00001.safetensors",
                                                               "state.json"]  # fmt: skip
