"""Merging per-rank traces: MindSpore's trace_view.json (string numbers), its raw CPU op file, our ranges."""

import json

import pytest

from ms_monitor import MonitorError, check_chrome_trace, merge
from ms_monitor.trace_merge import events_from_cpu_timestamps, events_from_trace_view

# The shape MindSpore 2.10 writes on CPU (as measured): a JSON list, M metadata, X events with string ts/dur.
TRACE_VIEW = [
    {"ph": "M", "name": "process_name", "pid": 2, "tid": 0, "args": {"name": "CPU OP"}},
    {"ph": "M", "name": "thread_name", "pid": 2, "tid": 0, "args": {"name": "Thread 0"}},
    {
        "ph": "X",
        "name": "Default/MatMul-op0",
        "pid": 2,
        "tid": 0,
        "ts": "1796039105143047.318",
        "dur": "148.820",
        "cat": "",
        "args": {"type": "HostCpuOps"},
    },
    {"ph": "M", "name": "process_name", "pid": 3, "tid": 0, "args": {"name": "Scope Layer"}},
    {"ph": "X", "name": "Default", "pid": 3, "tid": 0, "ts": "1796039105143047.318", "dur": "19387.969", "cat": ""},
    {"ph": "s", "name": "flow", "pid": 2, "tid": 0, "ts": "1796039105143047.318", "id": 1},
]
CPU_TS = (
    "Default/MatMul-op0;HostCpuOps;1796039105143047281,0.14882,0 1796039105183992295,0.152075,0 \n"
    "Default/BiasAdd-op0;HostCpuOps;1796039105143319424,0.076753,1 \n"
)
AGENT = [
    {"ph": "M", "name": "process_name", "pid": "ms-monitor", "args": {"name": "ms-monitor agent"}},
    {
        "ph": "X",
        "name": "forward",
        "cat": "phase",
        "ts": 1796039105143000.0,
        "dur": 10000.0,
        "pid": "ms-monitor",
        "tid": 0,
        "args": {"step": 7},
    },
]


def test_trace_view_numbers_are_parsed_and_flows_dropped():
    events = events_from_trace_view(json.dumps(TRACE_VIEW).encode())
    xs = [e for e in events if e["ph"] == "X"]
    assert [e["ts"] for e in xs] == [1796039105143047.318] * 2
    assert xs[0]["dur"] == pytest.approx(148.82)
    assert not [e for e in events if e["ph"] == "s"]
    wrapped = events_from_trace_view(json.dumps({"traceEvents": TRACE_VIEW}).encode())
    assert len(wrapped) == len(events)


def test_cpu_timestamp_file_becomes_x_events():
    events = events_from_cpu_timestamps(CPU_TS)
    assert [(e["name"], e["ts"], e["dur"], e["tid"]) for e in events] == [
        ("Default/MatMul-op0", 1796039105143047.281, pytest.approx(148.82), 0),
        ("Default/MatMul-op0", 1796039105183992.295, pytest.approx(152.075), 0),
        ("Default/BiasAdd-op0", 1796039105143319.424, pytest.approx(76.753), 1),
    ]
    with pytest.raises(MonitorError):
        events_from_cpu_timestamps("op;type;12345")


def test_merge_gives_one_lane_per_rank_with_named_threads():
    per_rank = {
        0: [("mindspore", events_from_trace_view(json.dumps(TRACE_VIEW).encode())), ("ms-monitor", AGENT)],
        1: [("mindspore-framework", events_from_cpu_timestamps(CPU_TS)), ("ms-monitor", AGENT)],
    }
    doc = json.loads(json.dumps(merge(per_rank, {"start_step": 7})))
    lanes = check_chrome_trace(doc)
    assert lanes == {0: 3, 1: 4}
    names = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    threads = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name" and e["pid"] == 0}
    assert threads == {
        "mindspore: CPU OP / Thread 0",
        "mindspore: Scope Layer / thread 0",
        "ms-monitor: ms-monitor agent / thread 0",
    }
    assert doc["otherData"]["sources"] == {
        "0": {"mindspore": 2, "ms-monitor": 1},
        "1": {"mindspore-framework": 3, "ms-monitor": 1},
    }


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"traceEvents": [{"ph": "X", "pid": "a", "ts": 1, "dur": 1}]},
        {"traceEvents": [{"ph": "X", "pid": 0, "ts": "x", "dur": 1}]},
        {"traceEvents": [{"ph": "X", "pid": 0, "ts": 1}]},
    ],
)
def test_check_chrome_trace_refuses_malformed(doc):
    with pytest.raises(MonitorError):
        check_chrome_trace(doc)


def test_not_json_is_refused():
    with pytest.raises(MonitorError, match="not JSON"):
        events_from_trace_view(b"{oops")
