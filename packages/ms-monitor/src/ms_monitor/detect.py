"""Real-time degradation detectors over step times (pure Python: the windows are short).

Three detectors, each robust to the odd slow step that every busy machine produces:

* **slow rank** (across ranks, per step): a rank whose *busy* time (step time minus time spent in
  communication ranges) is well above its peers'. Busy time matters because in synchronous data
  parallelism a straggler makes every rank's *step* time grow (the others wait in the all-reduce),
  while only the straggler's busy time grows. A rank is slow in a step when its busy time exceeds
  the median of the other ranks by ``slow_ratio`` *and* by ``slow_z`` robust standard deviations
  (1.4826 x MAD) of the others. Two tests raise the alert, both built to ignore a rank the host
  deschedules for a moment (on a loaded machine one rank's busy time can be 3-6x its peers' for
  3-5 steps in a row, measured on 4 ranks over 2 cores; with 2 ranks at a run queue of 6-8 on 2
  cores, 1.3-2.8x for up to 8), which mostly its duration tells from a straggler: ``slow_steps``
  (10) slow steps in a row whose excess over the peers' median adds up to
  ``slow_excess_seconds`` (a big straggler, raised fast), or, over the last ``slow_window`` steps, a
  share ``slow_window_fraction`` of steps at ``slow_window_ratio`` x the peers' median or more, with
  steady ratios (``slow_window_spread``): a small one. ``straggler.py`` says why that test, and what
  it costs.
* **regression** (per rank, against its own past): the median of the last ``recent_steps`` step
  times against the median of the ``baseline_steps`` steps after warm-up.
* **jitter** (per rank): the spread of consecutive differences, ``1.4826 * median(|x_i - x_i-1|) /
  sqrt(2)``, relative to the median step time over ``jitter_window`` steps. Differences make the
  measure blind to a single level shift (that is a regression, not jitter).

Each alert is raised once, after its condition held for a few evaluations in a row (like a
Prometheus rule's ``for:``), and resolved the same way with a lower threshold (hysteresis), so a
signal hovering at a threshold does not flood the alert list.
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Callable

from .errors import MonitorError
from .straggler import RatioWindow

MAD_TO_SIGMA = 1.4826
KINDS = ("slow_rank", "regression", "jitter")


@dataclass(frozen=True)
class DetectorConfig:
    """Thresholds of the three detectors."""

    slow_ratio: float = 1.3
    """a rank is slow in a step when its busy time is at least this multiple of the peers' median"""
    slow_z: float = 4.0
    """... and exceeds that median by this many robust standard deviations of the peers"""
    slow_steps: int = 10
    """consecutive slow steps that raise a slow-rank alert (a descheduling burst lasted 3-5 steps on 4
    ranks at load 10, and up to 8 on 2 ranks at a run queue of 6-8 on 2 cores: was 6 until those runs)"""
    slow_excess_seconds: float = 0.5
    """... once the rank's busy time over its peers' median, summed over those steps, reaches this"""
    slow_window: int = 15
    """steps of the persistent-straggler test (``straggler.py``), which also raises it; 0 turns it off"""
    slow_window_ratio: float = 1.07
    """... raised when the rank's busy time was at least this multiple of its peers' median ..."""
    slow_window_fraction: float = 0.85
    """... in at least this share of the window's steps"""
    slow_window_spread: float = 1.5
    """... and those ratios are steady: the window's median over its lower quartile is at most this"""
    warmup_steps: int = 3
    """first steps of each rank that no detector looks at (graph compilation, cache warm-up)"""
    baseline_steps: int = 20
    """steps after warm-up whose median is a rank's baseline step time"""
    recent_steps: int = 5
    """steps whose median is compared with the baseline"""
    regress_ratio: float = 1.3
    """recent median / baseline median at which a regression is raised"""
    hold_steps: int = 5
    """consecutive evaluations over (under) a regression or jitter threshold that raise (resolve) it"""
    sustain_seconds: float = 10.0
    """wall time a regression or jitter condition must also last before it raises: a burst of load
    on the host slows every rank for a moment, a regression stays"""
    jitter_window: int = 30
    """steps over which jitter is measured"""
    jitter_cv: float = 0.35
    """robust step-to-step spread relative to the median step time that counts as jitter"""

    def __post_init__(self) -> None:
        for name in ("slow_ratio", "regress_ratio"):
            if not getattr(self, name) > 1.0:
                raise MonitorError(f"DetectorConfig.{name}={getattr(self, name)!r} must be above 1")
        for name in ("slow_steps", "hold_steps", "baseline_steps", "recent_steps", "jitter_window"):
            if not int(getattr(self, name)) >= 1:
                raise MonitorError(f"DetectorConfig.{name}={getattr(self, name)!r} must be at least 1")
        if (
            self.warmup_steps < 0
            or self.slow_z < 0
            or self.slow_excess_seconds < 0
            or self.jitter_cv <= 0
            or self.sustain_seconds < 0
        ):
            raise MonitorError(f"DetectorConfig has a negative threshold: {self}")
        if self.slow_window != int(self.slow_window) or not (self.slow_window == 0 or self.slow_window >= 4):
            raise MonitorError(f"DetectorConfig.slow_window={self.slow_window!r} must be 0 (off) or an integer >= 4")
        for name in ("slow_window_ratio", "slow_window_spread"):
            if not getattr(self, name) > 1.0:
                raise MonitorError(f"DetectorConfig.{name}={getattr(self, name)!r} must be above 1")
        if not 0.5 < self.slow_window_fraction <= 1.0:
            raise MonitorError(
                f"DetectorConfig.slow_window_fraction={self.slow_window_fraction!r} must be in (0.5, 1]:"
                " more than half the window, or half a window of noise and bursts would raise"
            )


@dataclass
class Alert:
    """One detected degradation of one rank."""

    rank: int
    """the rank it concerns"""
    kind: str
    """slow_rank, regression or jitter"""
    step: int
    """the step at which it was raised"""
    value: float
    """the measured quantity (seconds, or a ratio for jitter)"""
    reference: float
    """what it was compared with (peers' median, baseline, threshold)"""
    message: str
    """one line for people"""
    time: float = field(default_factory=time.time)
    """wall time of the onset"""
    active: bool = True
    """False once resolved"""
    resolved_step: int | None = None
    """the step at which it was resolved"""

    def to_dict(self) -> dict:
        return asdict(self)


# The windows here are short (tens of values): sorting a Python list is several times faster than
# numpy's median on arrays this small, and the daemon runs these for every sample it receives.
def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n, mid = len(ordered), len(ordered) // 2
    return float(ordered[mid]) if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def robust_stats(values: Sequence[float]) -> tuple[float, float]:
    """Median and robust standard deviation (1.4826 x MAD)."""
    med = median(values)
    return med, MAD_TO_SIGMA * median([abs(v - med) for v in values])


#: from this many ranks on, one rank's own value barely moves the spread: every rank's z test uses
#: the robust standard deviation of all ranks (one sort per step instead of one per rank); the
#: median of its peers is still exact (read off the same sort), since the windowed test counts steps
#: a few percent over it and a straggler in the upper half moves the median of all ranks up
LEAVE_ONE_OUT_BELOW = 8


def peer_stats(busy: dict[int, float]) -> dict[int, tuple[float, float]]:
    """Rank -> median and robust standard deviation of its peers' busy times in one step."""
    if len(busy) < 2:
        return {}
    ranks = list(busy)
    values = [float(busy[r]) for r in ranks]
    if len(values) < LEAVE_ONE_OUT_BELOW:
        return {rank: robust_stats(values[:i] + values[i + 1 :]) for i, rank in enumerate(ranks)}
    sigma = robust_stats(values)[1]
    order = sorted(range(len(values)), key=values.__getitem__)
    ordered = [values[i] for i in order]
    n = len(values) - 1  # peers

    def peers_median(pos: int) -> float:  # median of `ordered` without the value at `pos`
        lo, hi = (n - 1) // 2, n // 2
        lo, hi = lo + (lo >= pos), hi + (hi >= pos)
        return (ordered[lo] + ordered[hi]) / 2.0

    return {ranks[i]: (peers_median(pos), sigma) for pos, i in enumerate(order)}


def slow_ranks(
    busy: dict[int, float], cfg: DetectorConfig, stats: dict[int, tuple[float, float]] | None = None
) -> dict[int, float]:
    """Ranks slow in one step -> the median busy time of their peers."""
    stats = peer_stats(busy) if stats is None else stats
    out = {}
    for rank, (med, sigma) in stats.items():
        x = float(busy[rank])
        z_ok = len(stats) < 4 or x - med > cfg.slow_z * sigma
        if x > cfg.slow_ratio * med and z_ok:
            out[rank] = med
    return out


def step_jitter(values: Sequence[float]) -> float:
    """Robust step-to-step spread relative to the median (see the module docstring)."""
    if len(values) < 3:
        return 0.0
    med = median(values)
    if med <= 0:
        return 0.0
    diffs = [abs(b - a) for a, b in zip(values[:-1], values[1:])]
    return MAD_TO_SIGMA * median(diffs) / math.sqrt(2.0) / med


class _RankState:
    def __init__(self, cfg: DetectorConfig):
        self.seen = 0
        self.baseline_buf: list[float] = []
        self.baseline: float | None = None
        self.recent: deque[float] = deque(maxlen=max(cfg.recent_steps, cfg.jitter_window))
        self.runs: dict[str, list[int]] = {}
        self.since: dict[str, float | None] = {}
        self.slow_excess = 0.0  # busy seconds over the peers' median in the current run of slow steps
        self.ratios = RatioWindow(cfg.slow_window)  # busy / peers' median, for the persistent test
        self.active: dict[str, Alert] = {}


class Detector:
    """Feed it per-rank step times and per-step busy times; it returns alert onsets and resolutions."""

    def __init__(self, config: DetectorConfig | None = None):
        self.config = config or DetectorConfig()
        self._ranks: dict[int, _RankState] = {}

    def _state(self, rank: int) -> _RankState:
        if rank not in self._ranks:
            self._ranks[rank] = _RankState(self.config)
        return self._ranks[rank]

    def reset(self, rank: int) -> None:
        """Forget a rank's history (it restarted)."""
        self._ranks.pop(rank, None)

    def active(self) -> list[Alert]:
        return [a for st in self._ranks.values() for a in st.active.values()]

    def _raise(self, st: _RankState, alert: Alert) -> list[Alert]:
        if alert.kind in st.active:
            return []
        st.active[alert.kind] = alert
        return [alert]

    def _resolve(self, st: _RankState, kind: str, step: int) -> list[Alert]:
        alert = st.active.pop(kind, None)
        if alert is None:
            return []
        alert.active = False
        alert.resolved_step = step
        return [alert]

    def _judge(
        self,
        st: _RankState,
        kind: str,
        step: int,
        bad: bool,
        good: bool,
        make: Callable[[], Alert],
        hold: int,
        now: float | None = None,
        sustain: float = 0.0,
        resolve_hold: int | None = None,
        enough: bool = True,
    ) -> list[Alert]:
        """Raise after ``hold`` bad evaluations in a row that also span ``sustain`` seconds of wall
        time (when ``now`` is known), and only while ``enough`` holds; resolve after ``resolve_hold``
        (default ``hold``) good ones. In between (the hysteresis band) both runs restart, so a signal
        at the threshold stays put."""
        runs = st.runs.setdefault(kind, [0, 0])
        runs[0], runs[1] = (runs[0] + 1, 0) if bad else (0, runs[1] + 1) if good else (0, 0)
        if runs[0] == 1:
            st.since[kind] = now
        began = st.since.get(kind)
        lasted = now is None or began is None or now - began >= sustain
        if runs[0] >= hold and lasted and enough:
            return self._raise(st, make())
        if runs[1] >= (resolve_hold or hold):
            return self._resolve(st, kind, step)
        return []

    def update_rank(self, rank: int, step: int, step_time: float, now: float | None = None) -> list[Alert]:
        """One step of one rank (``now``: its wall time, for ``sustain_seconds``): regression and jitter."""
        cfg, st = self.config, self._state(rank)
        st.seen += 1
        if st.seen <= cfg.warmup_steps:
            return []
        st.recent.append(step_time)
        if st.baseline is None:
            st.baseline_buf.append(step_time)
            if len(st.baseline_buf) >= cfg.baseline_steps:
                st.baseline = median(st.baseline_buf)
            return []
        base = st.baseline
        recent = list(st.recent)
        med = median(recent[-cfg.recent_steps :])

        def regression() -> Alert:
            msg = f"rank {rank} step time {med * 1e3:.1f} ms is {med / base:.2f}x its baseline"
            return Alert(rank, "regression", step, med, base, msg)

        high, low = cfg.regress_ratio * base, (1 + (cfg.regress_ratio - 1) / 2) * base
        out = self._judge(
            st, "regression", step, med > high, med < low, regression, cfg.hold_steps, now, cfg.sustain_seconds
        )
        if len(recent) >= cfg.jitter_window:
            jit = step_jitter(recent[-cfg.jitter_window :])

            def jitter() -> Alert:
                msg = f"rank {rank} step-to-step jitter {jit:.2f} of the median step time"
                return Alert(rank, "jitter", step, jit, cfg.jitter_cv, msg)

            out += self._judge(
                st,
                "jitter",
                step,
                jit > cfg.jitter_cv,
                jit < 0.7 * cfg.jitter_cv,
                jitter,
                cfg.hold_steps,
                now,
                cfg.sustain_seconds,
            )
        return out

    def update_step(self, step: int, busy: dict[int, float]) -> list[Alert]:
        """One step of all ranks (rank -> busy seconds): the slow-rank detector."""
        cfg = self.config
        eligible = {r: t for r, t in busy.items() if self._state(r).seen > cfg.warmup_steps}
        stats = peer_stats(eligible)
        slow = slow_ranks(eligible, cfg, stats)
        out: list[Alert] = []
        for rank, x in eligible.items():
            peers, st = stats[rank][0] if stats else 0.0, self._state(rank)
            med = slow.get(rank, peers)
            st.slow_excess = st.slow_excess + x - med if rank in slow else 0.0
            persistent = False
            if cfg.slow_window and peers > 0:
                st.ratios.push(x / peers)
                persistent = st.ratios.persistent(
                    cfg.slow_window_ratio, cfg.slow_window_fraction, cfg.slow_window_spread
                )

            def make(rank: int = rank, x: float = x, med: float = med, w: RatioWindow | None = None) -> Alert:
                ratio = x / med if med > 0 else math.inf
                msg = f"rank {rank} busy {x * 1e3:.1f} ms vs peers' median {med * 1e3:.1f} ms ({ratio:.2f}x)"
                if w is not None:
                    share = w.fraction_at_least(cfg.slow_window_ratio)
                    msg += f"; >= {cfg.slow_window_ratio:g}x its peers in {share:.0%} of the last {len(w.ratios)} steps"
                return Alert(rank, "slow_rank", step, x, med, msg)

            # raise fast (a straggler holds up every rank), resolve after hold_steps normal steps; the
            # windowed test already spans slow_window steps, so it raises at once
            resolve = max(cfg.slow_steps, cfg.hold_steps)
            out += self._judge(
                st,
                "slow_rank",
                step,
                rank in slow or persistent,
                rank not in slow and not persistent,
                functools.partial(make, w=st.ratios if persistent else None),
                1 if persistent else cfg.slow_steps,
                resolve_hold=resolve,
                enough=persistent or st.slow_excess >= cfg.slow_excess_seconds,
            )
        return out
