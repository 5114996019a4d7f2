"""The daemon's store (alignment, restarts, series) and its exports (Prometheus, JSON lines, TensorBoard)."""

import glob
import json
import struct

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ms_monitor import MonitorError
from ms_monitor.exporters import JsonlWriter, TensorBoardWriter, prometheus_text
from ms_monitor.store import Store


def s(rank, step, dt=0.05, ct=0.01, **kw):
    return {"r": rank, "s": step, "ts": 1.7e9 + step, "dt": dt, "ct": ct, **kw}


def test_slow_rank_waits_for_all_live_ranks_of_a_step():
    store = Store()
    for r in range(4):
        store.connected(r, {"host": "h", "role": "agent"})
    alerts = []
    for step in range(1, 16):
        for r in range(4):
            busy_extra = 0.3 if (r == 1 and step >= 6) else 0.0  # 0.5 s of excess within 2 steps
            alerts += store.add([s(r, step, dt=0.05 + busy_extra, ct=0.01)])
    slow = [a for a in alerts if a["kind"] == "slow_rank"]
    assert [(a["event"], a["rank"], a["step"]) for a in slow] == [("raised", 1, 15)]  # its 10th slow step
    status = store.status()
    assert [r["last_step"] for r in status["ranks"]] == [15] * 4
    assert status["alerts"][0]["rank"] == 1 and status["alerts"][0]["kind"] == "slow_rank"


def test_alert_raised_and_resolved_in_one_batch_is_kept_with_both_events():
    store = Store()
    batch = [
        s(r, step, dt=0.05 + (0.3 if r == 1 and 5 <= step <= 16 else 0.0)) for step in range(1, 30) for r in (0, 1, 2)
    ]
    events = store.add(batch)
    # raised on the 10th slow step (14), resolved on the 10th normal one (26): slow_steps both ways
    slow = [(e["event"], e["active"], e["step"]) for e in events if e["kind"] == "slow_rank"]
    assert slow == [("raised", True, 14), ("resolved", False, 14)]
    assert [(a["kind"], a["active"], a["resolved_step"]) for a in store.status()["alerts"]] == [
        ("slow_rank", False, 26)
    ]


def test_restarted_rank_starts_a_new_window():
    store = Store()
    store.add([s(0, step) for step in range(1, 50)])
    store.add([s(0, 1), s(0, 2)])
    assert [p.step for p in store.ranks[0].window] == [1, 2]


def test_series_matrix_has_none_where_a_rank_is_missing():
    store = Store()
    store.add([s(0, 1), s(0, 2), s(1, 2, dt=0.1, ct=0.02)])
    series = store.series()
    assert series["ranks"] == [0, 1] and series["steps"] == [1, 2]
    assert series["step_time"] == [[0.05, 0.05], [None, 0.1]]
    assert series["busy_time"][1][1] == pytest.approx(0.08)


def test_prometheus_text_parses_and_matches_the_store():
    store = Store()
    store.connected(0, {"host": 'we"ird\nhost', "role": "agent"})
    store.add([s(0, step, tok=1000, smp=8, hm=2**30, ph={"forward": 0.02, "backward": 0.025}) for step in (1, 2, 3)])
    families = {f.name: f for f in text_string_to_metric_families(prometheus_text(store))}
    value = {f: {tuple(sorted(x.labels.items())): x.value for x in families[f].samples} for f in families}
    labels = (("host", 'we"ird\nhost'), ("rank", "0"))
    assert value["ms_monitor_last_step"][labels] == 3
    assert value["ms_monitor_step_time_seconds"][labels] == 0.05
    assert value["ms_monitor_tokens_per_second"][labels] == pytest.approx(1000 / 0.05)
    assert value["ms_monitor_host_memory_bytes"][labels] == 2**30
    assert value["ms_monitor_phase_time_seconds"][(*labels[:1], ("phase", "forward"), labels[1])] == 0.02
    assert families["ms_monitor_samples_received"].type == "counter"
    assert value["ms_monitor_samples_received"][labels] == 3
    assert value["ms_monitor_alerts_active"][(("kind", "slow_rank"),)] == 0


def test_jsonl_rotates_without_losing_lines(tmp_path):
    path = str(tmp_path / "m.jsonl")
    w = JsonlWriter(path, max_bytes=300)
    for i in range(20):
        w.write({"i": i, "pad": "x" * 20})
    w.close()
    lines = [json.loads(x) for f in (path + ".1", path) for x in open(f)]
    assert [x["i"] for x in lines][-5:] == [15, 16, 17, 18, 19]
    assert all(x["pad"] == "x" * 20 for x in lines)
    with pytest.raises(MonitorError):
        JsonlWriter(path, max_bytes=0)


def read_tfrecords(path):
    """Minimal TFRecord reader (length, crc, data, crc) for the event files, independent of tensorboardX."""
    from tensorboardX.proto.event_pb2 import Event

    out = []
    with open(path, "rb") as f:
        while header := f.read(12):
            (length,) = struct.unpack("<Q", header[:8])
            data = f.read(length)
            f.read(4)
            ev = Event.FromString(data)
            for v in ev.summary.value:
                out.append((v.tag, ev.step, v.simple_value))
    return out


def test_tensorboard_scalars_per_rank(tmp_path):
    w = TensorBoardWriter(str(tmp_path))
    for step in (1, 2):
        w.write(s(0, step, dt=0.05, ct=0.01, tok=500, ph={"forward": 0.02}))
        w.write(s(3, step, dt=0.1, ct=0.0))
    w.close()
    rank0 = read_tfrecords(glob.glob(str(tmp_path / "rank0" / "events.*"))[0])
    got = {(tag, step): v for tag, step, v in rank0}
    assert got[("step_time_ms", 2)] == pytest.approx(50.0)
    assert got[("busy_time_ms", 1)] == pytest.approx(40.0)
    assert got[("phase/forward_ms", 1)] == pytest.approx(20.0)
    assert got[("tokens_per_second", 1)] == pytest.approx(10000.0)
    assert glob.glob(str(tmp_path / "rank3" / "events.*"))
