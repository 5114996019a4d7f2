"""kill -9 a checkpoint writer at 20 random moments, for saves of new steps and for the re-save of
the same step (a finished run resumed saves its last step again): afterwards the previous good
checkpoint verifies, nothing is skipped, no temporary file outlives the next run, and the next
writer resumes from exactly the checkpoint found.

The writer is a subprocess driving checkpoint.save with a single-rank group (no MindSpore): it
resumes from checkpoint.newest_valid, prints the step it resumed from, then saves in a loop until
it is killed."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ms_rlhf import checkpoint
from ms_rlhf.runtime.group import SingleProcessGroup

SIZE = 1 << 16  # floats per array: 256 KiB, so a save takes a few milliseconds
KILLS = 20

WRITER = """
import sys
import numpy as np
from ms_rlhf import checkpoint
from ms_rlhf.runtime.group import SingleProcessGroup

root, mode, size, once = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "once"
path, skipped = checkpoint.newest_valid(root)
arrays, state = checkpoint.load(path, 0, 1)
step = state["step"]
assert skipped == [] and arrays["w"][0] == step and arrays["w"].size == size, (skipped, step)
print(step, flush=True)
group = SingleProcessGroup()
while True:
    step += mode == "new"
    arrays = {"w": np.full(size, step, np.float32), "m": np.arange(size, dtype=np.float32)}
    checkpoint.save(root, step, arrays, {"step": step, "mode": mode}, group, keep=2 if mode == "new" else 1)
    if once:
        break
"""


def _arrays(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(SIZE, step, np.float32), "m": np.arange(SIZE, dtype=np.float32)}


def _writer(root, mode: str, once: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), mode, str(SIZE), "once" if once else "loop"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _check_good(root, at_least: int) -> int:
    """The checkpoint a resume picks verifies, holds its own step's arrays, and nothing was skipped."""
    path, skipped = checkpoint.newest_valid(root)  # also removes the killed writer's leftovers
    assert skipped == [] and path is not None
    manifest = checkpoint.verify(path)
    arrays, state = checkpoint.load(root, 0, 1)
    step = manifest["step"]
    assert step >= at_least and state["step"] == step and os.path.basename(path) == checkpoint.step_name(step)
    assert np.array_equal(arrays["w"], _arrays(step)["w"]) and np.array_equal(arrays["m"], _arrays(step)["m"])
    assert [n for n in os.listdir(root) if n.startswith(".")] == []
    return step


@pytest.mark.parametrize("mode, seed", [("new", 16), ("resave", 61)])
def test_kill_9_writer_leaves_a_good_checkpoint_to_resume_from(tmp_path, mode, seed):
    start = 7
    checkpoint.save(tmp_path, start, _arrays(start), {"step": start, "mode": mode}, SingleProcessGroup(), keep=1)
    rng = random.Random(seed)
    good, landed = start, 0
    for _ in range(KILLS):
        proc = _writer(tmp_path, mode)
        try:
            resumed = int(proc.stdout.readline())  # the writer has imported, verified and loaded
            time.sleep(rng.uniform(0.0, 0.25))
            landed += proc.poll() is None
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        assert resumed == good, proc.stderr.read()[-2000:]
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]
        good = _check_good(tmp_path, good)
        if mode == "resave":
            assert good == start and sorted(os.listdir(tmp_path)) == ["LATEST", checkpoint.step_name(start)]
    assert landed == KILLS  # every kill hit a writer in its save loop
    if mode == "new":
        assert good > start  # the writers made progress between the kills
    done = _writer(tmp_path, mode, once=True)  # the next run resumes from the last good one and finishes
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0 and int(out) == good, err[-2000:]
    assert _check_good(tmp_path, good) == good + (mode == "new")
