"""ms-pipeline x ms-monitor: 2 ZeroBubbleV training steps of the tiny DeepSeek-V3 on 2 gloo ranks,
each rank with an ms-monitor agent that times every step and, inside it, the forward, input-gradient
and weight-gradient passes the runtime runs (a PipelineRuntime subclass wraps ``run_compute``,
the runtime's public per-pass entry point). The node daemon runs in the test process: every
rank's samples reach it with those phase ranges, each no longer than the runtime's own record of
the same passes, and ``ms-monitor status --json`` lists both ranks at step 2."""

from __future__ import annotations

import json

import _tiny
import pytest
from conftest import wait_for

from ms_monitor import Daemon, DaemonConfig
from ms_monitor.cli import main as ms_monitor

pytest.importorskip("mindspore")
pytest.importorskip("torch")
pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch, pytest.mark.timeout(600)]

STEPS = 2
PHASES = {"F": "forward", "B": "backward", "W": "backward_weight", "BW": "backward"}


def _rank(group, addr: str) -> dict:
    from mindspore import nn

    import ms_pipeline as mp
    from ms_monitor import Monitor

    class MonitoredRuntime(mp.runtime.PipelineRuntime):
        """Every F, B and W pass inside a monitor range named after its phase."""

        monitor: Monitor

        def run_compute(self, part):
            with self.monitor.range(PHASES[part.kind.value]):
                super().run_compute(part)

    net = _tiny.model()
    monitor = Monitor(rank=group.rank, world_size=group.size, addr=addr, job="pair-pipeline-monitor")
    plan = _tiny.schedule(group.size)
    staged = mp.runtime.split_blocks(_tiny.blocks(net), mp.LayerPlacement.from_counts(list(_tiny.COUNTS)))
    mine = {s: staged[s] for s in plan.stages_of(group.rank)}
    params = list({id(p): p for s in mine for b in mine[s] for p in b.trainable_params()}.values())
    runtime = MonitoredRuntime(
        plan, mine, group, activation_shape=(_tiny.MB, _tiny.SEQ, net.config.hidden_size),
        optimizer=nn.SGD(params, learning_rate=0.05),
    )  # fmt: skip
    runtime.monitor = monitor
    inputs, labels = _tiny.data(net.config.vocab_size)
    measured = []  # per step: the runtime's own seconds per phase, from its event record
    losses = []
    for _ in range(STEPS):
        with monitor.step(tokens=_tiny.M * _tiny.MB * _tiny.SEQ):
            result = runtime.step(inputs, labels)
            runtime.optimizer_step()
        totals: dict[str, float] = {}
        for event in result.events:
            if event.action.is_compute:
                name = PHASES[event.action.kind.value]
                totals[name] = totals.get(name, 0.0) + event.end - event.start
        measured.append(totals)
        losses.append(result.loss)
    monitor.close(timeout=10.0)
    return {"measured": measured, "losses": losses, "stats": monitor.stats()}


def test_pipelined_ranks_report_their_phases_to_the_daemon(run_ranks, tmp_path, capsys):
    daemon = Daemon(DaemonConfig(port=0, http_port=0, trace_dir=str(tmp_path / "traces"))).start_in_thread()
    try:
        results = run_ranks(_rank, nprocs=2, timeout=500, args=(daemon.agent_addrs[0],), env={"OMP_NUM_THREADS": "1"})

        def arrived():
            ranks = daemon.store.status()["ranks"]
            return ranks if len(ranks) == 2 and all(r["last_step"] == STEPS for r in ranks) else None

        ranks = wait_for(arrived, 30, "both ranks' last samples")
        capsys.readouterr()
        assert ms_monitor(["status", "--url", daemon.http_url, "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
    finally:
        daemon.stop()

    assert results[0]["losses"][-1] < results[0]["losses"][0]  # it trained
    assert [r["rank"] for r in status["ranks"]] == [0, 1]
    assert all(r["last_step"] == STEPS for r in status["ranks"])
    for rank, info in enumerate(ranks):
        assert info["received"] == STEPS and results[rank]["stats"]["dropped"] == 0
        phases = info["phases"]  # the last step's ranges
        own = results[rank]["measured"][-1]
        assert set(phases) == set(own) == {"forward", "backward", "backward_weight"}, phases
        for name, seconds in phases.items():
            # the range sits inside the runtime's timed action: never longer, and not empty
            assert 0 < seconds <= own[name] + 1e-6, (rank, name, seconds, own[name])
        assert sum(phases.values()) <= info["step_time"]
