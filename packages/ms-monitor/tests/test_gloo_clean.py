"""No false alert in a clean run: 4 ranks (processes), 250 synthetic 50 ms steps synchronised by gloo."""

import pytest
from conftest import wait_for

pytestmark = pytest.mark.needs_torch

# 250 steps of ~52 ms: after warm-up and the 20-step baseline, the regression and jitter detectors
# judge ~11.7 s of steps, more than the 10 s a condition must last to raise them
STEPS = 250


def synthetic_rank(group, addr, steps):
    import time

    import numpy as np

    from ms_monitor import Monitor

    mon = Monitor(rank=group.rank, world_size=group.size, addr=addr, tokens_per_step=2048)
    buf = np.ones(4096, dtype=np.float32)
    for _ in range(steps):
        with mon.step():
            with mon.range("compute"):
                time.sleep(0.05)  # well above the scheduler's latency on a loaded host
            with mon.range("allreduce", kind="comm"):
                group.all_reduce(buf)
    mon.close(timeout=30.0)  # flush all: on a loaded host the default 2 s can end the rank with samples queued
    return mon.stats()


def test_clean_250_step_run_raises_no_alert(daemon):
    from ms_layout.comm import run_local

    results = run_local(synthetic_rank, 4, args=(daemon.agent_addrs[0], STEPS), timeout=300)
    assert [r["step"] for r in results] == [STEPS] * 4 and all(r["dropped"] == 0 for r in results)
    wait_for(
        lambda: len(daemon.store.ranks) == 4 and all(i.received == STEPS for i in daemon.store.ranks.values()),
        what="all samples",
    )
    status = daemon.store.status()
    assert status["alerts"] == [], status["alerts"]
    assert all(r["last_step"] == STEPS for r in status["ranks"])
