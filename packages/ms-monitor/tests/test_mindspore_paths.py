"""The MindSpore side: the Model callback, a capture with MindSpore's profiler, and the IPCMonitor proxy."""

import glob
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import get_json, wait_for
from ms_train import make_step

from ms_monitor import Monitor, check_chrome_trace

pytestmark = pytest.mark.needs_mindspore


def test_model_callback_reports_every_step_with_batch_size(daemon):
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore import nn

    from ms_monitor import MonitorCallback

    ms.set_device("CPU")
    data = np.random.default_rng(0).standard_normal((40, 8)).astype(np.float32)
    dataset = ds.NumpySlicesDataset({"x": data, "y": data}, shuffle=False).batch(4)
    net = nn.Dense(8, 8)
    model = ms.train.Model(net, nn.MSELoss(), nn.Adam(net.trainable_params()))
    cb = MonitorCallback(rank=0, addr=daemon.agent_addrs[0], tokens_per_sample=16)
    model.train(2, dataset, callbacks=[cb], dataset_sink_mode=False)
    wait_for(lambda: daemon.store.ranks.get(0) and daemon.store.ranks[0].last_step == 20, what="20 steps")
    points = list(daemon.store.ranks[0].window)
    assert [p.step for p in points] == list(range(1, 21))
    assert {(p.smp, p.tok) for p in points} == {(4, 64)}


def test_capture_runs_mindspore_profiler_between_step_boundaries(daemon):
    step = make_step()
    mon = Monitor(rank=0, addr=daemon.agent_addrs[0])
    wait_for(lambda: mon.stats()["connected"], what="agent connection")
    job = get_json(daemon.http_url + "/api/trace", {"steps": 2, "start_step": 6})
    for _ in range(12):
        with mon.step():
            with mon.range("train_step"):
                step()
    job = wait_for(lambda: (j := daemon.trace_status(job["id"]))["state"] != "running" and j, timeout=120)
    mon.close()
    assert job["state"] == "done" and job["sources"]["0"] == ["agent_ranges.json", "trace_view.json"], job
    doc = json.load(open(job["path"]))
    assert check_chrome_trace(doc) == {0: check_chrome_trace(doc)[0]}
    steps = {e["args"]["step"]: e for e in doc["traceEvents"] if e.get("cat") == "step"}
    assert sorted(steps) == [6, 7]
    ops = [e for e in doc["traceEvents"] if e["ph"] == "X" and "MatMul" in e["name"]]
    assert ops, "MindSpore's CPU ops are in the lane"
    lo, hi = steps[6]["ts"], steps[7]["ts"] + steps[7]["dur"]
    assert all(lo - 1e3 <= e["ts"] <= hi + 1e3 for e in ops)  # same clock: ops fall inside the captured steps


def test_proxy_speaks_mindspores_dyno_format(daemon, monkeypatch):
    monkeypatch.setenv("MSMONITOR_USE_DAEMON", "1")
    monkeypatch.setenv("MS_MONITOR_ADDR", daemon.agent_addrs[0])
    monkeypatch.setenv("RANK_ID", "3")  # what MindSpore's get_real_rank falls back to without init()
    from IPCMonitor import PyDynamicMonitorProxy
    from mindspore.profiler.dynamic_profile.dynamic_profiler_config_context import DynamicProfilerConfigContext
    from mindspore.profiler.dynamic_profile.dynamic_profiler_utils import DynamicProfilerUtils

    poller, reporter = PyDynamicMonitorProxy(), PyDynamicMonitorProxy()
    assert poller.init_dyno(3) is True
    idle = DynamicProfilerUtils.dyno_str_to_dict(poller.poll_dyno())  # first: a config that starts nothing
    assert DynamicProfilerConfigContext({**idle, "is_valid": True}).start_step == -1
    assert poller.poll_dyno() == ""  # nothing asked yet
    reporter.update_profiler_status(
        {"profiler_status": "0", "current_step": "12", "start_step": "-1", "stop_step": "-1"}
    )
    wait_for(lambda: daemon.store.ranks.get(3) and daemon.store.ranks[3].last_step == 12, what="status")
    assert get_json(daemon.http_url + "/api/status")["ranks"][0]["profiler_status"] == 0
    job = get_json(daemon.http_url + "/api/trace", {"ranks": [3], "steps": 4, "start_step": 20})
    assert job["dyno_ranks"] == [3]
    cfg = wait_for(poller.poll_dyno, what="config")
    parsed = DynamicProfilerUtils.dyno_str_to_dict(cfg)  # MindSpore's own parser is the reference
    parsed["is_valid"] = True
    ctx = DynamicProfilerConfigContext(parsed)
    assert (ctx.start_step, ctx.stop_step, ctx.is_valid) == (20, 23, True)
    assert ctx.prof_path == os.path.join(daemon.config.trace_dir, job["id"], "dyno")
    assert ctx.args["activities"] and not ctx.analyse
    poller.finalize_dyno()
    reporter.finalize_dyno()


MODEL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import mindspore as ms, mindspore.dataset as ds
    from mindspore import nn
    from mindspore.profiler import DynamicProfilerMonitor
    from mindspore.train import Callback
    ms.set_device("CPU")
    class Pace(Callback):
        def on_train_step_end(self, run_context):
            time.sleep(0.03)
    data = np.random.default_rng(0).standard_normal((4 * int(sys.argv[1]), 8)).astype(np.float32)
    dataset = ds.NumpySlicesDataset({"x": data, "y": data}, shuffle=False).batch(4)
    net = nn.Dense(8, 8)
    model = ms.train.Model(net, nn.MSELoss(), nn.Adam(net.trainable_params()))
    dp = DynamicProfilerMonitor(output_path=sys.argv[2], poll_interval=1)
    model.train(1, dataset, callbacks=[dp, Pace()], dataset_sink_mode=False)
    """
)

UNMODIFIED = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from ms_train import make_step
    from mindspore.profiler import DynamicProfilerMonitor
    step = make_step()
    dp = DynamicProfilerMonitor(output_path=sys.argv[3], poll_interval=1)
    for i in range(int(sys.argv[1])):
        step()
        time.sleep(0.03)
        dp.step()
        print("step", i + 1, flush=True)
    """
)


def test_unmodified_script_is_traced_through_mindspores_hook(daemon, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(UNMODIFIED)
    env = dict(os.environ, MSMONITOR_USE_DAEMON="1", MS_MONITOR_ADDR=daemon.agent_addrs[0], RANK_ID="0")
    here = os.path.dirname(__file__)
    shm_before = set(glob.glob("/dev/shm/DynamicProfileShm*"))
    log = open(tmp_path / "train.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(script), "150", here, str(tmp_path / "dyn")],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        wait_for(
            lambda: daemon.store.ranks.get(0) and daemon.store.ranks[0].last_step > 3,
            timeout=90,
            what=f"status from MindSpore's hook; log: {(tmp_path / 'train.log').read_text()[-2000:]}",
        )
        job = get_json(daemon.http_url + "/api/trace", {"steps": 3})
        assert job["dyno_ranks"] == [0] and job["expected"] == []
        job = wait_for(lambda: (j := daemon.trace_status(job["id"]))["state"] != "running" and j, timeout=120)
        assert proc.poll() is None, "the job kept running through the capture"
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            # a killed job leaves MindSpore's segment behind, and the next job of the hour would attach to it
            for path in set(glob.glob("/dev/shm/DynamicProfileShm*")) - shm_before:
                os.unlink(path)
        log.close()
    assert job["state"] == "done", job
    assert job["sources"]["0"] == ["cpu_op_execute_timestamp_0.txt"]
    doc = json.load(open(job["path"]))
    assert check_chrome_trace(doc)[0] > 0
    dirs = os.listdir(os.path.join(daemon.config.trace_dir, job["id"], "dyno"))
    start = job["start_step"]
    assert dirs == [f"rank0_start{start}_stop{start + 2}"]  # MindSpore's own layout for [start, stop]


def test_unmodified_model_train_is_traced_through_mindspores_hook(daemon, tmp_path):
    # The Model-callback path reports no step to the daemon: the trace names its start step.
    script = tmp_path / "train_model.py"
    script.write_text(MODEL_SCRIPT)
    env = dict(os.environ, MSMONITOR_USE_DAEMON="1", MS_MONITOR_ADDR=daemon.agent_addrs[0], RANK_ID="0")
    shm_before = set(glob.glob("/dev/shm/DynamicProfileShm*"))
    log_path = tmp_path / "train.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(script), "300", str(tmp_path / "dyn")],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
        try:
            wait_for(
                lambda: daemon.store.ranks.get(0) and daemon.store.ranks[0].role == "dyno",
                timeout=90,
                what="MindSpore's poller",
            )
            job = get_json(daemon.http_url + "/api/trace", {"steps": 3, "start_step": 150})
            job = wait_for(lambda: (j := daemon.trace_status(job["id"]))["state"] != "running" and j, timeout=120)
            assert proc.wait(timeout=120) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                for path in set(glob.glob("/dev/shm/DynamicProfileShm*")) - shm_before:
                    os.unlink(path)
    assert job["state"] == "done" and job["sources"]["0"] == ["cpu_op_execute_timestamp_0.txt"], job
    assert os.listdir(os.path.join(daemon.config.trace_dir, job["id"], "dyno")) == ["rank0_start150_stop152"]
    assert "json is not valid" not in log_path.read_text()  # the idle config keeps MindSpore quiet


def test_a_trace_for_some_ranks_is_acted_on_by_those_ranks_only(daemon, tmp_path):
    # Two ranks of one node: MindSpore forks one poller, both ranks read its config. The config
    # names rank 1; rank 0 (whichever of the two created the node's segment) must not capture.
    script = tmp_path / "train.py"
    script.write_text(
        UNMODIFIED.replace("from ms_train import make_step", "from ms_train import make_step\nimport IPCMonitor")
    )
    here = os.path.dirname(__file__)
    shm_before = set(glob.glob("/dev/shm/DynamicProfileShm*"))
    procs, logs = [], []
    try:
        for rank in (0, 1):
            env = dict(os.environ, MSMONITOR_USE_DAEMON="1", MS_MONITOR_ADDR=daemon.agent_addrs[0], RANK_ID=str(rank))
            logs.append(tmp_path / f"rank{rank}.log")
            with open(logs[-1], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(script), "260", here, str(tmp_path / "dyn")],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=tmp_path,
                    )
                )
        wait_for(
            lambda: all("step 1\n" in p.read_text() for p in logs),
            timeout=120,
            what="both ranks stepping; logs: " + " | ".join(p.read_text()[-500:] for p in logs),
        )
        job = get_json(daemon.http_url + "/api/trace", {"ranks": [1], "steps": 3, "start_step": 150})
        assert job["dyno_select"] == [1]
        job = wait_for(lambda: (j := daemon.trace_status(job["id"]))["state"] != "running" and j, timeout=150)
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for path in set(glob.glob("/dev/shm/DynamicProfileShm*")) - shm_before:
            os.unlink(path)
    assert job["state"] == "done", job
    assert job["sources"] == {"1": ["cpu_op_execute_timestamp_1.txt"]} and job["errors"] == {}, job
    assert os.listdir(os.path.join(daemon.config.trace_dir, job["id"], "dyno")) == ["rank1_start150_stop152"]
