"""TraceManager on its own: files in chunks, order checks, merge on completion, dyno folders."""

import json
import os

import pytest

from ms_monitor import check_chrome_trace, wire
from ms_monitor.dyno import RANKS_KEY, format_ranks, install_rank_gate, rank_selected
from ms_monitor.traces import TraceManager, choose_start, dyno_config


def agent_file(n_events):
    events = [
        {
            "ph": "X",
            "name": f"range{i}",
            "cat": "phase",
            "ts": 1.0e15 + i,
            "dur": 1.0,
            "pid": "ms-monitor",
            "tid": 0,
            "args": {"step": 5},
        }
        for i in range(n_events)
    ]
    return json.dumps(events).encode()


def send_file(mgr, job_id, rank, name, data, order=None):
    chunks = [data[i : i + wire.CHUNK] for i in range(0, len(data), wire.CHUNK)]
    for seq in order or range(len(chunks)):
        mgr.on_tfile(
            {
                "t": "tfile",
                "id": job_id,
                "rank": rank,
                "name": name,
                "seq": seq,
                "last": seq == len(chunks) - 1,
                "data": chunks[seq],
            }
        )
    return len(chunks)


def test_multi_chunk_files_are_reassembled_and_merged(tmp_path):
    mgr = TraceManager(str(tmp_path))
    job = mgr.new_job(start=5, steps=1, ranks=None, timeout=60)
    job.expected = {0, 1}
    data = agent_file(20000)
    assert send_file(mgr, job.id, 0, "agent_ranges.json", data) == 3  # 2.8 MB: three chunks
    send_file(mgr, job.id, 1, "agent_ranges.json", agent_file(3))
    mgr.on_tdone({"t": "tdone", "id": job.id, "rank": 0, "first": 5, "last": 5, "sources": ["agent_ranges.json"]})
    assert job.state == "running"  # rank 1 is not done yet
    mgr.on_tdone({"t": "tdone", "id": job.id, "rank": 1, "first": 5, "last": 5, "sources": ["agent_ranges.json"]})
    assert job.state == "done"
    assert check_chrome_trace(json.load(open(job.path))) == {0: 20000, 1: 3}


def test_out_of_order_chunks_drop_the_file(tmp_path):
    mgr = TraceManager(str(tmp_path))
    job = mgr.new_job(start=5, steps=1, ranks=None, timeout=60)
    job.expected = {0}
    send_file(mgr, job.id, 0, "agent_ranges.json", agent_file(20000), order=[1, 0])
    assert "out of order" in job.errors["0"]
    mgr.on_tdone({"t": "tdone", "id": job.id, "rank": 0, "first": 5, "last": 5, "sources": []})
    assert job.state == "failed"  # nothing usable arrived


def test_dyno_output_folders_are_read_once_stable(tmp_path):
    mgr = TraceManager(str(tmp_path))
    job = mgr.new_job(start=7, steps=2, ranks=None, timeout=60)
    job.dyno_ranks = [0]
    folder = os.path.join(job.out_dir, "dyno", "rank1_start7_stop8", "vm_1_2_ascend_ms", "FRAMEWORK")
    os.makedirs(folder)
    with open(os.path.join(folder, "cpu_op_execute_timestamp_0.txt"), "w") as f:
        f.write("Default/MatMul-op0;HostCpuOps;1796039105143047281,0.14882,0 \n")
    mgr.check(job)
    assert job.state == "running"  # just seen: wait until it stops changing
    job.dyno_stable_since -= 3.0
    mgr.check(job)
    assert job.state == "done" and job.summary()["sources"] == {"1": ["cpu_op_execute_timestamp_0.txt"]}
    assert check_chrome_trace(json.load(open(job.path))) == {1: 1}


def test_dyno_config_and_start_choice():
    cfg = dict(line.split("=", 1) for line in dyno_config(12, 3, "/x/y", analyse=False).splitlines())
    assert cfg["PROFILE_START_STEP"] == "12" and cfg["ACTIVITIES_ITERATIONS"] == "3"
    assert cfg["ACTIVITIES_LOG_FILE"] == "/x/y" and cfg["PROFILE_ANALYSE"] == "false"
    assert choose_start([100, 98], [0.05, 0.06], lead_seconds=0.25) == 100 + 6  # ceil(0.25 / 0.06) + 1
    assert choose_start([10], [None], lead_seconds=3.0, min_lead=3) == 14  # unknown step time: 1 s assumed


def test_rank_lists_in_dyno_configs():
    assert format_ranks([8, 0, 2, 1, 3, 3]) == "0-3,8" and format_ranks([5]) == "5"
    assert [r for r in range(10) if rank_selected(r, "0-3,8")] == [0, 1, 2, 3, 8]
    assert rank_selected(7, "not a list")  # a gate never stops a trace it cannot read
    cfg = dict(line.split("=", 1) for line in dyno_config(12, 3, "/x", analyse=False, ranks=[1, 2]).splitlines())
    assert cfg[RANKS_KEY] == "1-2"
    assert RANKS_KEY not in dyno_config(12, 3, "/x", analyse=False)


def test_rank_gate_drops_a_config_for_other_ranks():
    class FakeMonitor:  # the two things the gate uses of MindSpore's DynamicProfilerMonitor
        def __init__(self, rank, cfg):
            self._rank_id, self.cfg = rank, cfg

        def _get_prof_args(self):
            return self.cfg

    assert install_rank_gate(FakeMonitor) and install_rank_gate(FakeMonitor)  # idempotent
    cfg = {"start_step": "12", "iterations": "3", RANKS_KEY: "1-2,5"}
    assert [r for r in range(7) if FakeMonitor(r, cfg)._get_prof_args()] == [1, 2, 5]
    idle = {"start_step": "-1", "iterations": "0"}
    assert all(FakeMonitor(r, idle)._get_prof_args() == idle for r in range(3))  # no selection: every rank


def test_mindspores_parser_keeps_the_rank_line():
    utils = pytest.importorskip("mindspore.profiler.dynamic_profile.dynamic_profiler_utils")
    parsed = utils.DynamicProfilerUtils.dyno_str_to_dict(dyno_config(12, 3, "/x", analyse=False, ranks=[0, 4, 5]))
    assert parsed[RANKS_KEY] == "0,4-5" and parsed["start_step"] == "12"


def test_dyno_output_of_a_rank_outside_the_selection_is_left_out(tmp_path):
    mgr = TraceManager(str(tmp_path))
    job = mgr.new_job(start=7, steps=1, ranks=[1], timeout=60)
    job.dyno_ranks, job.dyno_select = [0], [1]
    for rank in (0, 1):
        folder = os.path.join(job.out_dir, "dyno", f"rank{rank}_start7_stop7", "vm_ascend_ms", "FRAMEWORK")
        os.makedirs(folder)
        with open(os.path.join(folder, "cpu_op_execute_timestamp_0.txt"), "w") as f:
            f.write("Default/MatMul-op0;HostCpuOps;1796039105143047281,0.14882,0 \n")
    mgr.check(job)
    job.dyno_stable_since -= 3.0
    mgr.check(job)
    assert job.state == "done" and job.summary()["sources"] == {"1": ["cpu_op_execute_timestamp_0.txt"]}
    assert "rank 0 captured although the trace was for ranks 1" in job.errors["0"]
    assert check_chrome_trace(json.load(open(job.path))) == {1: 1}
