"""The daemon's memory: a rolling window of samples per rank, step alignment across ranks, alerts.

Thread-safe: the daemon's event loop writes, the HTTP threads read snapshots. Samples of the same
step from different ranks are collected until every live rank has reported it or moved past it
(its sample was dropped), then the slow-rank detector sees the whole step at once. Ranks need not
run in lockstep: a rank that lags holds its steps back until it gets there.

At most ``max_ranks`` ranks are tracked: a new rank beyond that takes the place of the rank that
disconnected longest ago, and is refused (its samples dropped and counted in ``refused``) while
every tracked rank is connected, so a client inventing rank numbers cannot grow the daemon.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .detect import Alert, Detector, DetectorConfig

#: a rank that sent nothing for this long no longer holds back the step alignment
LIVE_SECONDS = 10.0
#: at most this many steps wait for lagging ranks; beyond it the oldest are evaluated as they are
MAX_PENDING = 2048
MAX_ALERTS = 1000


class Point(NamedTuple):
    """One step of one rank, as kept in the window."""

    step: int
    ts: float
    dt: float
    ct: float
    tok: int | None
    smp: int | None
    hm: int | None
    dm: int | None
    phases: dict


@dataclass
class RankInfo:
    """What the daemon knows about one rank."""

    rank: int
    """global rank"""
    host: str = ""
    """host name the agent reported"""
    pid: int = 0
    """process id of the agent"""
    role: str = "agent"
    """agent, dyno (MindSpore's own hook) or relay (samples forwarded by a node daemon)"""
    connected: bool = False
    """whether a connection of this rank is open now"""
    last_seen: float = 0.0
    """wall time of the newest sample or status"""
    last_step: int = -1
    """newest step reported"""
    received: int = 0
    """samples received"""
    agent_dropped: int = 0
    """samples the agent reports it dropped (queue full or daemon gone)"""
    profiler_status: int | None = None
    """MindSpore's dynamic profiler status (-1 uninitialized, 0 idle, 1 running, 2 ready), dyno only"""
    window: deque = field(default_factory=lambda: deque(maxlen=600))
    """the newest points, oldest first"""
    progress: deque = field(default_factory=lambda: deque(maxlen=10))
    """(wall time, step) of the newest dyno status reports, for a step rate without samples"""

    def summary(self) -> dict[str, Any]:
        pts = list(self.window)
        out: dict[str, Any] = {
            "rank": self.rank,
            "last_step": self.last_step,
            "host": self.host,
            "pid": self.pid,
            "role": self.role,
            "connected": self.connected,
            "last_seen": self.last_seen,
            "received": self.received,
            "agent_dropped": self.agent_dropped,
        }
        if self.profiler_status is not None:
            out["profiler_status"] = self.profiler_status
        if len(self.progress) >= 2:
            (t0, s0), (t1, s1) = self.progress[0], self.progress[-1]
            if s1 > s0:
                out["seconds_per_step"] = (t1 - t0) / (s1 - s0)
        if pts:
            dts = np.array([p.dt for p in pts])
            last = pts[-1]
            out.update(
                step_time=last.dt,
                step_time_median=float(np.median(dts)),
                comm_time=last.ct,
                phases=dict(last.phases),
                host_memory=last.hm,
                device_memory=last.dm,
                tokens_per_second=_rate(pts, "tok"),
                samples_per_second=_rate(pts, "smp"),
            )
        return out


def _rate(points: list[Point], attr: str) -> float | None:
    pairs = [(getattr(p, attr), p.dt) for p in points[-50:] if getattr(p, attr) is not None]
    total = sum(dt for _, dt in pairs)
    return None if not pairs or total <= 0 else sum(n for n, _ in pairs) / total


class Store:
    """Rolling windows, step alignment and alerts; all methods are safe from any thread."""

    def __init__(self, window: int = 600, detector: DetectorConfig | None = None, max_ranks: int = 4096):
        self.window = window
        self.max_ranks = max_ranks
        self.detector = Detector(detector)
        self.ranks: dict[int, RankInfo] = {}
        self._idle: dict[int, None] = {}  # disconnected ranks, longest disconnected first
        self.refused = 0
        self.evicted = 0
        self.alerts: deque[Alert] = deque(maxlen=MAX_ALERTS)
        self.received = 0
        self.invalid = 0
        self._pending: dict[int, dict[int, float]] = {}
        self._lock = threading.Lock()

    def _rank(self, rank: int) -> RankInfo | None:
        """The rank's record, made if there is room (see the module docstring); None if refused."""
        info = self.ranks.get(rank)
        if info is not None:
            return info
        if len(self.ranks) >= self.max_ranks:
            if not self._idle:
                self.refused += 1
                return None
            gone = next(iter(self._idle))
            del self._idle[gone], self.ranks[gone]
            self.detector.reset(gone)
            for got in self._pending.values():
                got.pop(gone, None)
            self.evicted += 1
        info = self.ranks[rank] = RankInfo(rank, window=deque(maxlen=self.window))
        self._idle[rank] = None  # until a connection says it is up
        return info

    def has_room(self, rank: int) -> bool:
        """Whether a sample or a connection of `rank` would be taken now."""
        with self._lock:
            return rank in self.ranks or len(self.ranks) < self.max_ranks or bool(self._idle)

    def connected(self, rank: int, hello: dict, up: bool = True) -> bool:
        """A connection of `rank` opened (or closed, `up` False); False if the rank was refused."""
        with self._lock:
            info = self._rank(rank) if up else self.ranks.get(rank)
            if info is None:
                return False
            info.connected = up
            self._idle.pop(rank, None)
            if not up:
                self._idle[rank] = None
            if up:
                info.host = hello.get("host", info.host)
                info.pid = hello.get("pid", info.pid)
                info.role = hello.get("role", info.role)
                info.last_seen = time.time()
            return True

    def count_invalid(self) -> None:
        with self._lock:
            self.invalid += 1

    def _record(self, alerts: list[Alert], events: list[dict]) -> None:
        # Snapshot each onset/resolution as it happens: one batch can raise and resolve the same alert.
        for a in alerts:
            events.append({"event": "raised" if a.active else "resolved", **a.to_dict()})
            if a.active:
                self.alerts.append(a)

    def add(self, samples: list[dict], role: str | None = None) -> list[dict]:
        """Validated wire samples in; alert events out (``event``: raised or resolved, plus the alert)."""
        events: list[dict] = []
        with self._lock:
            now = time.time()
            for s in samples:
                info = self._rank(s["r"])
                if info is None:
                    continue
                if role is not None and not info.connected:
                    info.role = role
                if s["s"] < info.last_step - 1:  # the rank restarted: a new job or a new process
                    info.window.clear()
                    self.detector.reset(s["r"])
                info.last_step, info.last_seen = s["s"], now
                info.received += 1
                info.agent_dropped = max(info.agent_dropped, s.get("dr", 0))
                ct = s.get("ct", 0.0)
                info.window.append(
                    Point(
                        s["s"],
                        s["ts"],
                        s["dt"],
                        ct,
                        s.get("tok"),
                        s.get("smp"),
                        s.get("hm"),
                        s.get("dm"),
                        s.get("ph", {}),
                    )
                )
                self.received += 1
                self._record(self.detector.update_rank(s["r"], s["s"], s["dt"], s["ts"]), events)
                self._pending.setdefault(s["s"], {})[s["r"]] = max(s["dt"] - ct, 0.0)
            self._align(now, events)
        return events

    def _align(self, now: float, events: list[dict]) -> None:
        live = {r for r, i in self.ranks.items() if now - i.last_seen < LIVE_SECONDS and i.role != "dyno"}
        overflow = len(self._pending) - MAX_PENDING
        for i, step in enumerate(sorted(self._pending)):
            got = self._pending[step]
            if i < overflow or all(r in got or self.ranks[r].last_step > step for r in live):
                self._record(self.detector.update_step(step, got), events)
                del self._pending[step]

    def dyno_status(self, msg: dict) -> None:
        """A status report of MindSpore's dynamic profiler (through the IPCMonitor proxy)."""
        with self._lock:
            info = self._rank(msg["rank"])
            if info is None:
                return
            if info.role != "agent" or not info.window:
                info.role = "dyno"
            info.profiler_status = msg["status"]
            info.last_step = max(info.last_step, msg["cur"])
            info.last_seen = time.time()
            if msg["cur"] >= 0:
                info.progress.append((info.last_seen, msg["cur"]))

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "ranks": [self.ranks[r].summary() for r in sorted(self.ranks)],
                "alerts": [a.to_dict() for a in self.alerts],
                "active_alerts": [a.to_dict() for a in self.detector.active()],
                "received": self.received,
                "invalid": self.invalid,
                "refused": self.refused,
                "evicted": self.evicted,
                "max_ranks": self.max_ranks,
            }

    def series(self, last: int = 200) -> dict[str, Any]:
        """Per-rank step times over the newest ``last`` steps, and the ranks x steps matrices."""
        with self._lock:
            ranks = sorted(r for r, i in self.ranks.items() if i.window)
            # the newest `last` steps of each rank, so a rank that lags behind still shows
            steps = sorted({p.step for r in ranks for p in list(self.ranks[r].window)[-last:]})[-3 * last :]
            index = {s: j for j, s in enumerate(steps)}
            dt = [[None] * len(steps) for _ in ranks]
            busy = [[None] * len(steps) for _ in ranks]
            for i, r in enumerate(ranks):
                for p in self.ranks[r].window:
                    j = index.get(p.step)
                    if j is not None:
                        dt[i][j], busy[i][j] = p.dt, max(p.dt - p.ct, 0.0)
            return {
                "ranks": ranks,
                "steps": steps,
                "step_time": dt,
                "busy_time": busy,
                # active alerts first, then the newest resolved ones
                "alerts": [a.to_dict() for a in self.detector.active()]
                + [a.to_dict() for a in list(self.alerts)[-50:] if not a.active],
                "time": time.time(),
            }

    def snapshot(self) -> tuple[list[dict], list[Alert], int, int]:
        """Summaries, active alerts, received and invalid counters (for the exporters)."""
        with self._lock:
            return (
                [self.ranks[r].summary() for r in sorted(self.ranks)],
                list(self.detector.active()),
                self.received,
                self.invalid,
            )

    def alert_counts(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = {}
            for a in self.alerts:
                out[a.kind] = out.get(a.kind, 0) + 1
            return out
