"""The simulator: run a schedule against a cost model and measure makespan, bubbles and memory.

The cost model is sail-sg's ``GraphConfig`` (Zero Bubble paper, Section 3): per stage, the time of
F, B and W; a latency per transfer between ranks; and the activation memory F allocates, B frees
and W frees. B frees only part of it: W still needs each layer's input to form ``dW = g^T x``.
The authors' profile (8 stages x 32 microbatches, ``auto_schedule.py`` of zero-bubble-v0.1.0) has
F +3720, B -2048, W -1672 (MB): :meth:`CostModel.zb_profile`.

Two bubble rates are reported, because the literature uses both:

* ``bubble_rate``: idle time over all ranks divided by ranks x makespan. With equal costs this is
  (p-1)/(m+p-1) for 1F1B and (p-1)/(3m+p-1) for ZB-H1, the formulas of the papers' text.
* ``bubble_rate_zb``: the Zero Bubble authors' scheduler definition (sail-sg ``zbv.py``,
  ``try_v_schedule``/``create_schedule``): a rank's bubble is its idle time between the start of
  its first action and the end of its last one, and the rate is max over ranks of
  bubble / (work + bubble). The start-up wait before a rank's first forward is not counted, which
  is why ZeroBubbleV scores 0 at equal costs under it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Union

from .deps import play
from .errors import ScheduleError
from .ir import Action, Kind, Schedule

PerStage = Union[float, Sequence[float]]

# The authors' measured costs (F, B, W, comm) and memory deltas, normalised to F = 1.
_ZB_F, _ZB_B, _ZB_W, _ZB_COMM = 29850.0, 29767.0, 18868.0, 466.0
_ZB_MEM_F, _ZB_MEM_B, _ZB_MEM_W = 3720.0, -2048.0, -1672.0


@dataclass(frozen=True)
class CostModel:
    """Times and memory of one stage's passes for one microbatch; scalars apply to every stage."""

    f: PerStage = 1.0
    """Forward time (T_F)."""
    b: PerStage = 1.0
    """Input-gradient time (T_B)."""
    w: PerStage = 1.0
    """Weight-gradient time (T_W)."""
    bw: PerStage | None = None
    """Fused backward time (T_BW); None: b + w. A runtime that computes dx and dW in one pass can
    be cheaper than the two apart (one graph, the values still in cache)."""
    comm: float = 0.0
    """Latency of one transfer between two ranks (neighbouring stages on one rank pay nothing)."""
    mem_f: PerStage = 1.0
    """Activation memory one F allocates."""
    mem_b: PerStage = -0.5
    """Memory one B frees (negative): what only dx needed."""
    mem_w: PerStage = -0.5
    """Memory one W frees (negative): the layer inputs W kept; mem_f + mem_b + mem_w must be 0."""
    overlap: float = 0.0
    """Share of the shorter half of an OVERLAP_F_B pair hidden under the longer (0: run one after the other)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "bw":
                continue
            items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
            for v in items:
                # NaN or inf would simulate to a meaningless makespan rather than fail
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                    raise ScheduleError(f"cost {f.name}={v!r:.50} must be a finite number")
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, f.name, tuple(float(v) for v in value))
        for name in ("f", "b", "w", "comm") + (("bw",) if self.bw is not None else ()):
            if any(v < 0 for v in self._values(name)):
                raise ScheduleError(f"cost {name}={getattr(self, name)} must not be negative")
        if not 0.0 <= self.overlap <= 1.0:
            raise ScheduleError(f"overlap={self.overlap} must be within [0, 1]")
        n = max(
            (len(getattr(self, k)) for k in ("mem_f", "mem_b", "mem_w") if isinstance(getattr(self, k), tuple)),
            default=1,
        )
        for s in range(n):
            total = self.at("mem_f", s) + self.at("mem_b", s) + self.at("mem_w", s)
            if abs(total) > 1e-9 * max(1.0, abs(self.at("mem_f", s))):
                raise ScheduleError(
                    f"stage {s}: mem_f + mem_b + mem_w = {total:g}, but what F allocates B and W must free (sum 0)"
                )

    def _values(self, name: str) -> tuple[float, ...]:
        v = getattr(self, name)
        return v if isinstance(v, tuple) else (float(v),)

    def at(self, name: str, stage: int) -> float:
        """The value of field ``name`` for ``stage``."""
        v = getattr(self, name)
        if isinstance(v, tuple):
            if stage >= len(v):
                raise ScheduleError(f"cost {name} has {len(v)} per-stage values; stage {stage} has none")
            return v[stage]
        return float(v)

    def duration(self, action: Action) -> float:
        """Run time of a computation or an overlapped pair."""
        if action.parts is not None:
            a, b = (self.duration(p) for p in action.parts)
            return a + b - self.overlap * min(a, b)
        s, kind = action.stage, action.kind
        return {
            Kind.F: lambda: self.at("f", s),
            Kind.B: lambda: self.at("b", s),
            Kind.W: lambda: self.at("w", s),
            Kind.BW: lambda: self.at("b", s) + self.at("w", s) if self.bw is None else self.at("bw", s),
        }[kind]()

    def memory(self, part: Action) -> float:
        """Change of activation memory caused by one computation."""
        s = part.stage
        return {
            Kind.F: self.at("mem_f", s),
            Kind.B: self.at("mem_b", s),
            Kind.W: self.at("mem_w", s),
            Kind.BW: self.at("mem_b", s) + self.at("mem_w", s),
        }[part.kind]

    def split(self, chunks: int) -> CostModel:
        """The same model cut into ``chunks`` times more stages: times and memory per stage shrink
        by that factor, the transfer latency does not. Used to compare a schedule with 2 chunks per
        rank (ZeroBubbleV) against one with 1 on the same model."""
        if chunks == 1:
            return self
        values = {}
        for name in ("f", "b", "w", "bw", "mem_f", "mem_b", "mem_w"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, tuple):
                raise ScheduleError(f"cannot split per-stage costs ({name}={v}); give costs for every stage instead")
            values[name] = v / chunks
        return CostModel(comm=self.comm, overlap=self.overlap, **values)

    @classmethod
    def from_events(cls, events: Sequence[Event], num_stages: int, *, comm: float = 0.0) -> CostModel:
        """Per-stage costs measured by real steps: the mean F, B, W and BW of each stage over the
        computations in ``events`` (a pair's halves count as theirs; transfers are skipped). Every
        stage needs F, B and W timed (run a schedule with B and W apart); BW is the fused pass's
        time where one ran, B + W elsewhere. The mean, not the median: a makespan adds durations,
        slow tail included."""
        mean = mean_durations(events)
        missing = [f"{s}{k.value}" for s in range(num_stages) for k in (Kind.F, Kind.B, Kind.W) if (s, k) not in mean]
        if missing:
            raise ScheduleError(
                f"no timed {', '.join(missing[:6])} among the events: every stage needs F, B and W measured"
                " (a schedule that runs B and W apart)"
            )
        times = {k: [mean[(s, k)] for s in range(num_stages)] for k in (Kind.F, Kind.B, Kind.W)}
        bw = [mean.get((s, Kind.BW), times[Kind.B][s] + times[Kind.W][s]) for s in range(num_stages)]
        return cls(f=times[Kind.F], b=times[Kind.B], w=times[Kind.W], bw=bw, comm=comm)

    @classmethod
    def zb_profile(cls) -> CostModel:
        """The Zero Bubble authors' measured profile: T_B = 0.997 T_F, T_W = 0.632 T_F, comm 0.016 T_F;
        B frees 55% of F's activations and W the remaining 45%."""
        return cls(
            f=1.0,
            b=_ZB_B / _ZB_F,
            w=_ZB_W / _ZB_F,
            comm=_ZB_COMM / _ZB_F,
            mem_f=1.0,
            mem_b=_ZB_MEM_B / _ZB_MEM_F,
            mem_w=_ZB_MEM_W / _ZB_MEM_F,
        )

    @classmethod
    def parse(cls, text: str, base: CostModel | None = None) -> CostModel:
        """From ``"f=1,b=1,w=0.63,comm=0"``: the named fields replace those of ``base`` (the
        defaults if None). A lone ``mem_f`` rescales base's ``mem_b``/``mem_w`` to keep the sum 0."""
        base = base or cls()
        names = [f.name for f in fields(cls)]
        values = {name: getattr(base, name) for name in names}
        given = {}
        for item in filter(None, (t.strip() for t in text.split(","))):
            key, _, raw = item.partition("=")
            key = key.strip()
            if key not in names:
                raise ScheduleError(f"unknown cost {key[:40]!r} in {text[:100]!r}; known: {', '.join(names)}")
            try:
                given[key] = float(raw)
            except ValueError:
                raise ScheduleError(f"cost {key}={raw.strip()[:40]!r} is not a number") from None
            if not math.isfinite(given[key]):
                raise ScheduleError(f"cost {key}={raw.strip()[:40]!r} must be a finite number")
        if "mem_f" in given and "mem_b" not in given and "mem_w" not in given:
            scale = given["mem_f"] / float(base.mem_f) if base.mem_f else 0.0
            values["mem_b"], values["mem_w"] = float(base.mem_b) * scale, float(base.mem_w) * scale
        values.update(given)
        return cls(**values)


@dataclass(frozen=True)
class Event:
    """One action on one rank's timeline (simulated or measured)."""

    rank: int
    """Rank that ran it."""
    action: Action
    """What ran."""
    start: float
    """Start time (simulator units, or seconds for a real run)."""
    end: float
    """End time."""


@dataclass(frozen=True)
class Bubbles:
    """Idle time of a timeline, under both definitions (see the module docstring)."""

    makespan: float
    """End of the last action minus start of the first."""
    busy: tuple[float, ...]
    """Time each rank spent computing."""
    bubble_rate: float
    """Idle over ranks x makespan."""
    bubble_rate_zb: float
    """The Zero Bubble authors' rate: max over ranks of in-span idle / (work + in-span idle)."""

    @classmethod
    def of(cls, events: Sequence[Event], num_ranks: int) -> Bubbles:
        """Measure a timeline (simulated or from a real run's trace)."""
        if not events:
            raise ScheduleError("an empty timeline has no bubbles to measure")
        t0 = min(e.start for e in events)
        makespan = max(e.end for e in events) - t0
        by_rank: dict[int, list[Event]] = {}
        for e in events:  # grouped once, in timeline order (filtering per rank was quadratic)
            by_rank.setdefault(e.rank, []).append(e)
        busy, worst = [], 0.0
        for r in range(num_ranks):
            mine = by_rank.get(r, [])
            work = sum(e.end - e.start for e in mine)
            busy.append(work)
            if mine:
                span = max(e.end for e in mine) - min(e.start for e in mine)
                gap = max(0.0, span - work)
                worst = max(worst, gap / (work + gap) if work + gap > 0 else 0.0)
        idle = num_ranks * makespan - sum(busy)
        rate = idle / (num_ranks * makespan) if makespan > 0 else 0.0
        return cls(makespan, tuple(busy), max(0.0, rate), worst)


@dataclass(frozen=True)
class SimResult:
    """What the simulator measured for one schedule under one cost model."""

    schedule: str
    """Name of the schedule."""
    makespan: float
    """Time from the first action to the last."""
    bubble_rate: float
    """Idle over ranks x makespan."""
    bubble_rate_zb: float
    """The Zero Bubble authors' definition (see the module docstring)."""
    busy: tuple[float, ...]
    """Compute time per rank."""
    peak_activation: tuple[float, ...]
    """Largest activation memory alive on each rank (units of ``mem_f``)."""
    timeline: tuple[Event, ...]
    """Every computation with its start and end."""

    def to_dict(self, timeline: bool = False) -> dict:
        """Plain data for ``--json``; the timeline only on request."""
        out = {
            "schedule": self.schedule,
            "makespan": self.makespan,
            "bubble_rate": self.bubble_rate,
            "bubble_rate_zb": self.bubble_rate_zb,
            "busy": list(self.busy),
            "peak_activation": list(self.peak_activation),
        }
        if timeline:
            out["timeline"] = [
                {"rank": e.rank, "action": str(e.action), "start": e.start, "end": e.end} for e in self.timeline
            ]
        return out


def mean_durations(events: Sequence[Event]) -> dict[tuple[int, Kind], float]:
    """(stage, kind) -> the mean duration of that computation over ``events`` (a 1B1F pair's
    event counts for each of its halves, as measured around the pair; transfers are skipped)."""
    durations: dict[tuple[int, Kind], list[float]] = {}
    for e in events:
        for part in e.action.computes():
            durations.setdefault((part.stage, part.kind), []).append(e.end - e.start)
    return {k: sum(v) / len(v) for k, v in durations.items()}


def peak_activation(schedule: Schedule, costs: CostModel) -> tuple[float, ...]:
    """Peak activation memory per rank. Each rank runs in order, so the running sum of memory
    deltas along its list is its memory; in a pair the forward half is counted first."""
    peaks = []
    for acts in schedule.actions:
        mem = peak = 0.0
        for action in acts:
            for part in action.computes():
                mem += costs.memory(part)
                peak = max(peak, mem)
        peaks.append(peak)
    return tuple(peaks)


def simulate(schedule: Schedule, costs: CostModel | None = None) -> SimResult:
    """Run ``schedule`` (lowered or not) under ``costs`` (per stage; unit costs by default)."""
    costs = costs or CostModel()
    for name in ("f", "b", "w", "mem_f", "mem_b", "mem_w"):
        v = getattr(costs, name)
        if isinstance(v, tuple) and len(v) != schedule.num_stages:
            raise ScheduleError(f"cost {name} has {len(v)} values for a schedule of {schedule.num_stages} stages")
    compute = schedule.compute_only()
    played = play(compute, costs.duration, lambda dep, part: costs.comm)
    if played.stuck:
        first = played.stuck[0]
        raise ScheduleError(
            f"schedule {schedule.name} deadlocks: rank {first.rank} step {first.step}: {first.action} waits for"
            f" {', '.join(first.waiting_for)} (run validate() for the full report)"
        )
    events = tuple(
        Event(r, a, played.start[r][i], played.end[r][i])
        for r, acts in enumerate(compute.actions)
        for i, a in enumerate(acts)
    )
    bubbles = Bubbles.of(events, schedule.num_ranks)
    return SimResult(
        schedule.name,
        bubbles.makespan,
        bubbles.bubble_rate,
        bubbles.bubble_rate_zb,
        bubbles.busy,
        peak_activation(compute, costs),
        events,
    )
