"""Per-rank trace files -> one Chrome trace (Perfetto opens it too) with one lane (pid) per rank.

Three sources, in the order a rank's trace is built from:

* ``trace_view.json``: MindSpore's analysed trace (``ASCEND_PROFILER_OUTPUT``), a JSON list of
  Chrome events with ``ts``/``dur`` as strings of microseconds (as measured in MindSpore 2.10 on CPU).
* ``cpu_op_execute_timestamp_<n>.txt``: MindSpore's raw CPU framework file, written even when the
  profiler runs without analysis: one line per op, ``name;type;start_ns,dur_ms,tid start_ns,...``.
* ``agent_ranges.json``: the ms-monitor agent's own ranges and step spans, so a merged trace is
  never empty, even where MindSpore wrote nothing.

All three use wall-clock microseconds, so lanes of ranks on one host line up. Across hosts,
``merge`` takes each rank's clock offset against the daemon (``clock.py``: rank clock minus
daemon clock, measured by ping/pong) and shifts the rank's events by minus that offset, so every
lane is on the daemon's clock; the offsets applied are recorded in ``otherData.clock_offsets_us``.
Only complete (``X``), begin/end, instant and counter events
are kept; the original processes/threads of a rank become named threads of its lane.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import MonitorError

KEEP_PHASES = frozenset("XBEiIC")
MAX_EVENTS_PER_RANK = 2_000_000


def _num(value: Any, what: str) -> float:
    if isinstance(value, bool):
        raise MonitorError(f"{what}={value!r} is not a number")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise MonitorError(f"{what}={value!r} is not a number") from None
    if not math.isfinite(out):
        raise MonitorError(f"{what}={value!r} is not finite")
    return out


def _load_json_events(data: bytes, source: str) -> list[dict]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MonitorError(f"{source} is not JSON: {exc}") from None
    except RecursionError:
        raise MonitorError(f"{source} nests its JSON too deeply") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise MonitorError(f"{source} holds no list of trace events")
    return [e for e in events if isinstance(e, dict)]


def events_from_trace_view(data: bytes, source: str = "trace_view.json") -> list[dict]:
    """Chrome events of a trace_view.json (list form or ``{"traceEvents": [...]}``), numbers parsed."""
    return _normalize(_load_json_events(data, source), source)


def events_from_cpu_timestamps(text: str, source: str = "cpu_op_execute_timestamp") -> list[dict]:
    """Chrome ``X`` events from MindSpore's ``cpu_op_execute_timestamp_<n>.txt``."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.strip().split(";")
        if len(parts) < 3 or not parts[0]:
            continue
        name, op_type = parts[0], parts[1]
        for item in parts[2].split():
            fields = item.split(",")
            if len(fields) < 2:
                raise MonitorError(f"{source} line {lineno}: {item!r} is not start_ns,dur_ms[,tid]")
            start_ns = _num(fields[0], f"{source} line {lineno} start")
            dur_ms = _num(fields[1], f"{source} line {lineno} duration")
            tid = int(_num(fields[2], f"{source} line {lineno} thread")) if len(fields) > 2 else 0
            out.append(
                {
                    "ph": "X",
                    "name": name,
                    "cat": op_type,
                    "ts": start_ns / 1e3,
                    "dur": dur_ms * 1e3,
                    "pid": "CPU OP",
                    "tid": tid,
                    "args": {"type": op_type},
                }
            )
    return out


def _ident(value: Any) -> Any:
    """A pid or tid as a lane key: a number or text as it is, anything else (a list, a map) as text."""
    plain = value is None or (isinstance(value, (int, str)) and not isinstance(value, bool))
    return value if plain else str(value)


def _normalize(events: list[dict], source: str) -> list[dict]:
    out = []
    for i, e in enumerate(events):
        ph = e.get("ph")
        if not isinstance(ph, str):
            continue
        e = {**e, "pid": _ident(e.get("pid")), "tid": _ident(e.get("tid"))}
        if ph == "M":
            if isinstance(e.get("args", {}), dict):
                out.append(e)
            continue
        if ph not in KEEP_PHASES:
            continue
        ev = dict(e)
        ev["ts"] = _num(e.get("ts"), f"{source} event {i} ts")
        if "dur" in e:
            ev["dur"] = max(_num(e["dur"], f"{source} event {i} dur"), 0.0)
        ev["name"] = str(e.get("name", ""))
        out.append(ev)
    return out


class _Lane:
    """Renumbers the (process, thread) pairs of a rank's sources into threads of its lane."""

    def __init__(self, rank: int):
        self.rank = rank
        self.tids: dict[tuple, int] = {}
        self.names: dict[tuple, str] = {}
        self.events: list[dict] = []

    def add(self, source: str, events: list[dict]) -> int:
        proc_names = {
            e.get("pid"): e.get("args", {}).get("name")
            for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"
        }
        thread_names = {
            (e.get("pid"), e.get("tid")): e.get("args", {}).get("name")
            for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"
        }
        kept = 0
        for e in events:
            if e.get("ph") == "M":
                continue
            key = (source, e.get("pid"), e.get("tid"))
            if key not in self.tids:
                self.tids[key] = len(self.tids)
                proc = proc_names.get(e.get("pid")) or e.get("pid")
                thread = thread_names.get((e.get("pid"), e.get("tid"))) or f"thread {e.get('tid')}"
                self.names[key] = f"{source}: {proc} / {thread}"
            ev = dict(e, pid=self.rank, tid=self.tids[key])
            self.events.append(ev)
            kept += 1
            if len(self.events) > MAX_EVENTS_PER_RANK:
                raise MonitorError(f"rank {self.rank} has more than {MAX_EVENTS_PER_RANK} trace events")
        return kept

    def metadata(self, label: str) -> list[dict]:
        meta = [
            {"ph": "M", "name": "process_name", "pid": self.rank, "tid": 0, "args": {"name": label}},
            {"ph": "M", "name": "process_sort_index", "pid": self.rank, "tid": 0, "args": {"sort_index": self.rank}},
        ]
        for key, tid in self.tids.items():
            meta.append(
                {"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid, "args": {"name": self.names[key]}}
            )
            meta.append(
                {"ph": "M", "name": "thread_sort_index", "pid": self.rank, "tid": tid, "args": {"sort_index": tid}}
            )
        return meta


def merge(
    per_rank: dict[int, list[tuple[str, list[dict]]]],
    metadata: dict | None = None,
    offsets: dict[int, float] | None = None,
) -> dict:
    """``{rank: [(source, events), ...]}`` -> one Chrome trace document with a lane per rank.

    ``offsets``: seconds, each rank's clock minus the reference clock; its events are moved by
    minus that much (ranks not named stay as they are)."""
    offsets = offsets or {}
    events: list[dict] = []
    sources: dict[str, dict[str, int]] = {}
    applied: dict[str, float] = {}
    for rank in sorted(per_rank):
        lane = _Lane(rank)
        sources[str(rank)] = {src: lane.add(src, evs) for src, evs in per_rank[rank]}
        shift = _num(offsets.get(rank, 0.0), f"clock offset of rank {rank}") * 1e6
        if rank in offsets:
            applied[str(rank)] = round(shift, 3)
        if shift:
            for e in lane.events:
                e["ts"] -= shift
        events += lane.metadata(f"rank {rank}") + lane.events
    meta = dict(metadata or {})
    meta["sources"] = sources
    meta["clock_offsets_us"] = applied
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def check_chrome_trace(doc: Any) -> dict[int, int]:
    """Validate a merged trace; returns events per lane (pid). Raises MonitorError if malformed."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise MonitorError("a Chrome trace needs a 'traceEvents' list")
    lanes: dict[int, int] = {}
    for i, e in enumerate(doc["traceEvents"]):
        if not isinstance(e, dict) or "ph" not in e or not isinstance(e.get("pid"), int):
            raise MonitorError(f"trace event {i} lacks 'ph' or an integer 'pid': {e!r}")
        if e["ph"] == "M":
            continue
        _num(e.get("ts"), f"event {i} ts")
        if e["ph"] == "X":
            _num(e.get("dur"), f"event {i} dur")
        lanes[e["pid"]] = lanes.get(e["pid"], 0) + 1
    return lanes
