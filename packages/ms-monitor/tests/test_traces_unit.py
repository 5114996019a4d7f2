"""TraceManager on its own: files in chunks, order checks, merge on completion, dyno folders."""

import json
import os

from ms_monitor import check_chrome_trace, wire
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
