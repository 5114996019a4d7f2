"""Exports of the daemon: Prometheus text, JSON lines, TensorBoard scalars.

The Prometheus exposition is written by hand (it is a small text format, and the core package
stays numpy + msgpack); the tests parse it with ``prometheus_client``'s parser. TensorBoard event
files are written with tensorboardX (the ``tensorboard`` extra), one run per rank.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from .detect import KINDS
from .errors import MonitorError
from .store import Store

log = logging.getLogger("ms_monitor.daemon")

# (metric, help, type, key in a rank summary)
GAUGES = (
    ("ms_monitor_last_step", "Newest step reported by the rank", "last_step"),
    ("ms_monitor_step_time_seconds", "Duration of the rank's newest step", "step_time"),
    ("ms_monitor_step_time_median_seconds", "Median step duration over the rolling window", "step_time_median"),
    ("ms_monitor_comm_time_seconds", "Time in communication ranges during the newest step", "comm_time"),
    ("ms_monitor_tokens_per_second", "Tokens per second over the newest steps", "tokens_per_second"),
    ("ms_monitor_samples_per_second", "Samples per second over the newest steps", "samples_per_second"),
    ("ms_monitor_host_memory_bytes", "Resident host memory of the rank's process", "host_memory"),
    ("ms_monitor_device_memory_bytes", "Device memory held by the framework's allocator", "device_memory"),
    ("ms_monitor_connected", "1 while the rank's agent is connected", "connected"),
)
COUNTERS = (
    ("ms_monitor_samples_received", "Samples the daemon received from the rank", "received"),
    ("ms_monitor_agent_dropped_samples", "Samples the agent dropped (queue full or daemon gone)", "agent_dropped"),
)


def _label(value: Any) -> str:
    return str(value).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _num(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    value = float(value)
    return "NaN" if math.isnan(value) else repr(value)


def prometheus_text(store: Store) -> str:
    """The /metrics page (text exposition format 0.0.4)."""
    ranks, active, received, invalid = store.snapshot()
    lines: list[str] = []

    def family(name: str, help_: str, kind: str, rows: list[tuple[dict, Any]]) -> None:
        # a counter's samples, HELP and TYPE all carry the _total suffix (what prometheus_client writes too)
        sample = f"{name}_total" if kind == "counter" else name
        lines.append(f"# HELP {sample} {help_}")
        lines.append(f"# TYPE {sample} {kind}")
        for labels, value in rows:
            text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            lines.append(f"{sample}{{{text}}} {_num(value)}" if text else f"{sample} {_num(value)}")

    def rank_labels(r: dict) -> dict:
        return {"rank": r["rank"], "host": r.get("host", "")}

    for name, help_, key in GAUGES:
        family(name, help_, "gauge", [(rank_labels(r), r[key]) for r in ranks if r.get(key) is not None])
    for name, help_, key in COUNTERS:
        family(name, help_, "counter", [(rank_labels(r), r[key]) for r in ranks])
    phase_rows = [({**rank_labels(r), "phase": p}, t) for r in ranks for p, t in sorted(r.get("phases", {}).items())]
    family("ms_monitor_phase_time_seconds", "Time in each named range during the newest step", "gauge", phase_rows)
    per_kind = {k: 0 for k in KINDS}
    for a in active:
        per_kind[a.kind] = per_kind.get(a.kind, 0) + 1
    family("ms_monitor_alerts_active", "Alerts active now", "gauge", [({"kind": k}, n) for k, n in per_kind.items()])
    totals = {k: 0 for k in KINDS} | store.alert_counts()
    family(
        "ms_monitor_alerts",
        "Alerts raised since the daemon started",
        "counter",
        [({"kind": k}, n) for k, n in totals.items()],
    )
    family(
        "ms_monitor_rank_alert_active",
        "1 while an alert of this kind is active for the rank",
        "gauge",
        [({"rank": a.rank, "kind": a.kind}, 1) for a in active],
    )
    family("ms_monitor_daemon_samples_received", "Samples received by this daemon", "counter", [({}, received)])
    family("ms_monitor_daemon_invalid_messages", "Messages rejected by schema validation", "counter", [({}, invalid)])
    return "\n".join(lines) + "\n"


class JsonlWriter:
    """Appends one JSON object per line; rotates to ``<path>.1`` past ``max_bytes``."""

    def __init__(self, path: str, max_bytes: int = 256 * 1024 * 1024):
        if max_bytes <= 0:
            raise MonitorError(f"jsonl max_bytes={max_bytes} must be positive")
        self.path, self.max_bytes = path, max_bytes
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")

    def write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        if self._f.tell() > self.max_bytes:
            self._f.close()
            os.replace(self.path, self.path + ".1")
            self._f = open(self.path, "a", encoding="utf-8")

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardWriter:
    """Scalars per rank (run ``rank<N>``): step time, busy and comm time, phases, throughput, memory."""

    def __init__(self, logdir: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise MonitorError("TensorBoard export needs tensorboardX: pip install 'ms-monitor[tensorboard]'") from None
        self._cls = SummaryWriter
        self.logdir = logdir
        self._writers: dict[int, Any] = {}

    def write(self, sample: dict) -> None:
        rank, step = sample["r"], sample["s"]
        if rank not in self._writers:
            self._writers[rank] = self._cls(os.path.join(self.logdir, f"rank{rank}"), flush_secs=5)
        w = self._writers[rank]
        ct = sample.get("ct", 0.0)
        w.add_scalar("step_time_ms", sample["dt"] * 1e3, step)
        w.add_scalar("busy_time_ms", (sample["dt"] - ct) * 1e3, step)
        w.add_scalar("comm_time_ms", ct * 1e3, step)
        for name, t in sample.get("ph", {}).items():
            w.add_scalar(f"phase/{name}_ms", t * 1e3, step)
        for key, tag in (("tok", "tokens_per_second"), ("smp", "samples_per_second")):
            if sample.get(key) is not None and sample["dt"] > 0:
                w.add_scalar(tag, sample[key] / sample["dt"], step)
        for key, tag in (("hm", "host_memory_mb"), ("dm", "device_memory_mb")):
            if sample.get(key) is not None:
                w.add_scalar(tag, sample[key] / 2**20, step)

    def flush(self) -> None:
        for w in self._writers.values():
            w.flush()

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
