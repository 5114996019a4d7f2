"""Pictures of a timeline: a PNG (matplotlib) coloured by action kind, and a Chrome trace
(``chrome://tracing`` or https://ui.perfetto.dev) -- from the simulator or from a real run.

Colours follow the Zero Bubble paper's figures: F blue, B (dx) green, W (dw) orange, a fused
backward purple; the second chunk of a rank (ZeroBubbleV's way back up, interleaved's later
chunks) is drawn lighter. An overlapped 1B1F pair is one bar split in two.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from ms_layout.files import FileError, atomic_path, atomic_write, read_json

from .errors import ScheduleError
from .ir import Action, Kind, Schedule
from .serialize import MAX_FILE_BYTES
from .simulate import CostModel, Event, SimResult, simulate

COLORS = {Kind.F: "#3b75af", Kind.B: "#519e3e", Kind.W: "#ef8636", Kind.BW: "#8d69b8"}
_WAIT = "#eeeeee"  # a measured wait for a receive (real runs only)


def _shade(color: str, chunk: int) -> tuple[float, float, float]:
    """Lighter for later chunks, so the two arms of a V are told apart."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    mix = min(0.55, 0.45 * chunk)
    return (r + (1 - r) * mix, g + (1 - g) * mix, b + (1 - b) * mix)


def _events(source: Schedule | SimResult | Sequence[Event], costs: CostModel | None) -> tuple[Sequence[Event], str]:
    if isinstance(source, Schedule):
        result = simulate(source, costs)
        return result.timeline, source.name
    if isinstance(source, SimResult):
        return source.timeline, source.schedule
    return list(source), ""


def draw_png(
    source: Schedule | SimResult | Sequence[Event],
    path: str | os.PathLike,
    *,
    costs: CostModel | None = None,
    title: str | None = None,
    stage_to_rank: Sequence[int] | None = None,
    label: bool = True,
    xlabel: str = "time",
) -> Path:
    """Draw a timeline to ``path`` (PNG). ``source`` is a schedule (simulated with ``costs``), a
    simulation result, or measured events. ``stage_to_rank`` tells chunks apart for shading
    (taken from the schedule when one is given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events, name = _events(source, costs)
    if not events:
        raise ScheduleError("nothing to draw: the timeline is empty")
    if isinstance(source, Schedule):
        stage_to_rank = source.stage_to_rank
    chunk_of = _chunks(stage_to_rank)
    ranks = max(e.rank for e in events) + 1
    t0 = min(e.start for e in events)
    span = max(e.end for e in events) - t0
    fig, ax = plt.subplots(figsize=(min(24, 4 + len(events) / ranks * 0.35), 0.5 * ranks + 1.2))
    for e in events:
        _bar(ax, e, t0, chunk_of, label and span > 0)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel(xlabel)
    if title is None and isinstance(source, (Schedule, SimResult)):
        result = source if isinstance(source, SimResult) else simulate(source, costs)
        title = f"{name}: makespan {result.makespan:.4g}, bubble rate {result.bubble_rate:.1%}"
    ax.set_title(title or name, loc="left", fontsize=10)
    names = {Kind.F: "F", Kind.B: "B (dx)", Kind.W: "W (dw)", Kind.BW: "BW (fused)"}
    present = [k for k in COLORS if any(p.kind is k for e in events for p in e.action.parts or (e.action,))]
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in present]
    labels = [names[k] for k in present]
    if any(chunk_of.get(p.stage, 0) for e in events for p in e.action.parts or (e.action,)):
        handles.append(plt.Rectangle((0, 0), 1, 1, color=_shade(COLORS[Kind.F], 1)))
        labels.append("lighter: 2nd chunk")
    if any(e.action.kind in (Kind.RECV_F, Kind.RECV_B) for e in events):
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor=_WAIT, hatch="///", edgecolor="#999999"))
        labels.append("waiting for a receive")
    ax.legend(
        handles, labels, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(labels), fontsize=8, frameon=False
    )
    fig.tight_layout()
    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")  # the temporary name has no suffix to tell the format
    finally:
        plt.close(fig)
    return path


def _chunks(stage_to_rank: Sequence[int] | None) -> dict[int, int]:
    """stage -> its index among its rank's stages (0 for the first chunk)."""
    if stage_to_rank is None:
        return {}
    seen: dict[int, int] = {}
    out = {}
    for stage, rank in enumerate(stage_to_rank):
        out[stage] = seen.get(rank, 0)
        seen[rank] = out[stage] + 1
    return out


def _bar(ax, event: Event, t0: float, chunk_of: dict[int, int], label: bool) -> None:
    if event.action.kind in (Kind.RECV_F, Kind.RECV_B):
        width = event.end - event.start
        ax.barh(event.rank, width, left=event.start - t0, height=0.5, color=_WAIT, hatch="///", edgecolor="#999999")
        return
    parts = event.action.parts or (event.action,)
    width = (event.end - event.start) / len(parts)
    for i, part in enumerate(parts):
        color = _shade(COLORS.get(part.kind, "#999999"), chunk_of.get(part.stage, 0))
        left = event.start - t0 + i * width
        ax.barh(event.rank, width, left=left, height=0.8, color=color, edgecolor="white", linewidth=0.5)
        if label:
            ax.text(left + width / 2, event.rank, str(part.microbatch), ha="center", va="center", fontsize=6)


def chrome_trace(events: Sequence[Event], *, us_per_unit: float = 1000.0, name: str = "pipeline") -> dict:
    """Chrome trace JSON (the "X" complete-event format): one row (tid) per rank. Simulator time
    units become ``us_per_unit`` microseconds (1 unit = 1 ms by default); for a real run measured
    in seconds pass ``us_per_unit=1e6``."""
    t0 = min((e.start for e in events), default=0.0)
    trace = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": name}}]
    for rank in sorted({e.rank for e in events}):
        trace.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
    for e in events:
        trace.append(
            {
                "ph": "X",
                "name": str(e.action),
                "cat": e.action.kind.value,
                "pid": 0,
                "tid": e.rank,
                "ts": (e.start - t0) * us_per_unit,
                "dur": (e.end - e.start) * us_per_unit,
                "args": {"stage": e.action.stage, "microbatch": e.action.microbatch},
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike, events: Sequence[Event], **options) -> Path:
    """Write :func:`chrome_trace` to ``path`` (atomically)."""
    path = Path(path)
    atomic_write(path, json.dumps(chrome_trace(events, **options)))
    return path


def read_chrome_trace(path: str | os.PathLike, *, us_per_unit: float = 1000.0) -> list[Event]:
    """Events back from a trace written by :func:`write_chrome_trace` (start times from 0); a
    missing or malformed trace raises ScheduleError naming it."""
    try:
        data = read_json(path, "Chrome trace", MAX_FILE_BYTES.value)
    except FileError as exc:
        raise ScheduleError(str(exc)) from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise ScheduleError(f"Chrome trace {os.fspath(path)!r} has no traceEvents list")
    out = []
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        ts, dur, tid, name = ev.get("ts"), ev.get("dur"), ev.get("tid"), ev.get("name")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (ts, dur, tid)):
            raise ScheduleError(f"Chrome trace {os.fspath(path)!r}: event {ev!r:.100} needs numeric ts, dur and tid")
        start = ts / us_per_unit
        out.append(Event(int(tid), Action.parse(name), start, start + dur / us_per_unit))
    return out
