"""Trace jobs without MindSpore: agents capture their ranges at a step boundary; relays; the CLI."""

import json
import os

import pytest
from conftest import Ranks, get_json, wait_for

from ms_layout.files import verify_manifest
from ms_monitor import Daemon, DaemonConfig, check_chrome_trace
from ms_monitor.cli import main, parse_ranks


def finished(daemon, job_id):
    return wait_for(
        lambda: (j := get_json(f"{daemon.http_url}/api/trace/{job_id}"))["state"] != "running" and j,
        timeout=60,
        what=f"trace {job_id}",
    )


def step_spans(doc, rank):
    return sorted(e["args"]["step"] for e in doc["traceEvents"] if e["pid"] == rank and e.get("cat") == "step")


def test_trace_captures_the_requested_steps_of_each_rank(daemon):
    ranks = Ranks(daemon.agent_addrs[0], ranks=(0, 1, 2))
    try:
        wait_for(lambda: len(daemon.store.ranks) == 3 and min(r.last_step for r in daemon.store.ranks.values()) > 3)
        start = max(r.last_step for r in daemon.store.ranks.values()) + 20
        job = get_json(
            daemon.http_url + "/api/trace", {"ranks": [0, 2], "steps": 3, "start_step": start, "profiler": False}
        )
        assert job["expected"] == [0, 2] and job["start_step"] == start
        job = finished(daemon, job["id"])
        still_running = ranks.monitors[1].step_num
    finally:
        ranks.close()
    assert job["state"] == "done" and job["sources"] == {"0": ["agent_ranges.json"], "2": ["agent_ranges.json"]}
    doc = json.load(open(job["path"]))
    assert check_chrome_trace(doc).keys() == {0, 2}
    for rank in (0, 2):
        assert step_spans(doc, rank) == [start, start + 1, start + 2]
        ranges = {e["name"] for e in doc["traceEvents"] if e["pid"] == rank and e.get("cat") in ("phase", "comm")}
        assert ranges == {"forward", "allreduce"}
    assert still_running > start + 2  # the ranks kept stepping through and after the capture
    # the rank left out never heard of the trace: no command pending, no capture
    assert ranks.monitors[1].captures == [] and ranks.monitors[1]._pending is None
    assert [len(ranks.monitors[r].captures) for r in (0, 2)] == [1, 1]
    manifest = verify_manifest(os.path.dirname(job["path"]))  # sizes and sha256 match
    assert manifest["files"]["merged_trace.json"]["bytes"] == os.path.getsize(job["path"])
    assert manifest["ranks"] == [0, 2] and manifest["file"] == "merged_trace.json"


def test_aggregator_traces_ranks_behind_a_relay(tmp_path, sock_dir):
    agg = Daemon(DaemonConfig(port=0, http_port=0, trace_dir=str(tmp_path / "agg"))).start_in_thread()
    node = Daemon(
        DaemonConfig(
            port=None,
            unix=os.path.join(sock_dir, "n.sock"),
            http_port=None,
            forward=agg.agent_addrs[0],
            trace_dir=str(tmp_path / "node"),
        )
    ).start_in_thread()
    ranks = Ranks(node.agent_addrs[0], ranks=(4, 5))
    try:
        wait_for(
            lambda: {4, 5} <= set(agg.store.ranks) and min(r.last_step for r in agg.store.ranks.values()) > 3,
            what="relayed samples",
        )
        assert {r["role"] for r in get_json(agg.http_url + "/api/status")["ranks"]} == {"relay"}
        job = get_json(agg.http_url + "/api/trace", {"steps": 2, "profiler": False})
        assert job["expected"] == [4, 5]
        job = finished(agg, job["id"])
    finally:
        ranks.close()
        node.stop()
        agg.stop()
    assert job["state"] == "done", job
    doc = json.load(open(job["path"]))
    assert check_chrome_trace(doc).keys() == {4, 5}
    assert len(step_spans(doc, 4)) == 2
    # two hops, one clock: each rank's offset is the relay's plus the rank's against the relay, near 0
    clock = doc["otherData"]["clock"]
    assert all(abs(clock[r]["offset_us"]) <= clock[r]["error_us"] + 1 for r in ("4", "5")), clock


def test_parse_ranks():
    assert parse_ranks("0-3") == [0, 1, 2, 3]
    assert parse_ranks("5,0-1,1") == [0, 1, 5]
    for bad in ("", "a", "3-1", "1-"):
        with pytest.raises(ValueError):
            parse_ranks(bad)


def test_cli_status_and_trace(daemon, tmp_path, capsys):
    ranks = Ranks(daemon.agent_addrs[0], ranks=(0, 1))
    try:
        wait_for(lambda: len(daemon.store.ranks) == 2 and min(r.last_step for r in daemon.store.ranks.values()) > 3)
        assert main(["status", "--url", daemon.http_url, "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert sorted(r["rank"] for r in status["ranks"]) == [0, 1] and status["alerts"] == []
        assert all(r["last_step"] > 3 for r in status["ranks"])
        out = tmp_path / "merged.json"
        assert (
            main(
                [
                    "trace",
                    "--url",
                    daemon.http_url,
                    "--ranks",
                    "0-1",
                    "--steps",
                    "2",
                    "--no-profiler",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        capsys.readouterr()
    finally:
        ranks.close()
    assert check_chrome_trace(json.load(open(out))).keys() == {0, 1}
    assert main(["trace", "--url", daemon.http_url, "--ranks", "9", "--steps", "2"]) == 2
    assert "no connected rank" in capsys.readouterr().err


@pytest.mark.parametrize(
    "body", [{"steps": "3"}, {"steps": 0}, {"steps": 2, "timeout": "x"}, {"steps": 2, "ranks": "0-3"}, [1, 2]]
)
def test_bad_trace_requests_are_400_and_change_nothing(daemon, body):
    import urllib.error

    ranks = Ranks(daemon.agent_addrs[0], ranks=(0,))
    try:
        wait_for(lambda: daemon.store.ranks.get(0) and daemon.store.ranks[0].last_step > 1)
        with pytest.raises(urllib.error.HTTPError) as err:
            get_json(daemon.http_url + "/api/trace", body)
        assert err.value.code == 400
        assert daemon.traces.jobs == {} and ranks.monitors[0]._pending is None
    finally:
        ranks.close()


def test_a_rank_that_disconnects_does_not_hold_up_the_trace(daemon):
    ranks = Ranks(daemon.agent_addrs[0], ranks=(0, 1))
    try:
        wait_for(lambda: len(daemon.store.ranks) == 2 and min(r.last_step for r in daemon.store.ranks.values()) > 2)
        job = get_json(daemon.http_url + "/api/trace", {"steps": 2, "start_step": 10**6, "profiler": False})
        ranks.close()  # both agents go away before reaching the start step
        job = finished(daemon, job["id"])
    finally:
        ranks.close()
    assert job["state"] == "failed" and job["expected"] == []
    assert job["errors"]["0"] == job["errors"]["1"] == "the rank disconnected before its trace arrived"
