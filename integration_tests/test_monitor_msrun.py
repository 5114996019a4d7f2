"""ms-monitor and MindSpore's own hook under msrun: a 2-rank data-parallel job (mccl all-reduce) that
only uses MindSpore's DynamicProfilerMonitor is traced by `ms-monitor trace`, both ranks' lanes
coming from one poller per node, while the job runs."""

import glob
import json
import os
import threading

from conftest import SCRIPTS, logs, run_msrun, wait_for

from ms_monitor import Daemon, DaemonConfig, check_chrome_trace
from ms_monitor.cli import main as ms_monitor


def test_msrun_job_traced_through_mindspores_hook(tmp_path, monkeypatch):
    daemon = Daemon(DaemonConfig(port=0, http_port=0, trace_dir=str(tmp_path / "traces"))).start_in_thread()
    monkeypatch.setenv("MSMONITOR_USE_DAEMON", "1")
    monkeypatch.setenv("MS_MONITOR_ADDR", daemon.agent_addrs[0])
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    shm_before = set(glob.glob("/dev/shm/DynamicProfileShm*"))
    rc = []
    # the job steps until the test writes `stop` (at most 10000 steps, ~5 min): the trace below must
    # be taken while it runs, and a fixed number of steps would race the capture (ends too soon on a
    # quiet box, where the steps are fastest, or where the profiler's analysis is slow)
    stop = tmp_path / "stop"
    args = ["10000", str(tmp_path / "dyn"), str(stop)]
    job = threading.Thread(
        target=lambda: rc.append(run_msrun(SCRIPTS / "msrun_dyno_train.py", args, 2, log_dir, timeout=400)),
        daemon=True,
    )
    job.start()
    try:
        wait_for(
            lambda: any(r["last_step"] > 5 for r in daemon.store.status()["ranks"]),
            300,
            f"a status report from MindSpore's hook\n{logs(log_dir)}",
        )
        out = tmp_path / "merged.json"
        assert ms_monitor(["trace", "--url", daemon.http_url, "--steps", "3", "--out", str(out), "--json"]) == 0
        assert job.is_alive(), "the job ran on through the capture"
    finally:
        stop.touch()
        job.join(400)
        daemon.stop()
        for path in set(glob.glob("/dev/shm/DynamicProfileShm*")) - shm_before:
            os.unlink(path)  # only a killed job leaves one behind
    assert rc == [0], logs(log_dir)
    doc = json.loads(out.read_text())
    assert sorted(check_chrome_trace(doc)) == [0, 1]  # both ranks, though only one process polled
    assert all(set(v) == {"mindspore-framework"} for v in doc["otherData"]["sources"].values())
