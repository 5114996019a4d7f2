"""Schedules on disk: msgpack (in ms-layout's versioned envelope), CSV (one row per rank, as
PyTorch's pipelining and torchtitan store custom schedules) and the text form.

Files are written with ``ms_layout.files.atomic_write`` (a temporary name renamed into place), so
a crash never leaves half a file where a good one was. Files read are capped in size
(MS_PIPELINE_MAX_FILE_BYTES) and the actions they hold are counted before they are parsed.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Sequence
from pathlib import Path

from ms_layout import LayoutError
from ms_layout import dumps as _layout_dumps
from ms_layout import loads as _layout_loads
from ms_layout.files import FileError, atomic_write, read_capped
from ms_layout.limits import Limit
from ms_layout.serialization import register

from .errors import ScheduleError
from .ir import MAX_SCHEDULE_SIZE, Action, Schedule, check_action_count

MAX_FILE_BYTES = Limit("MS_PIPELINE_MAX_FILE_BYTES", 32 << 20, "bytes")
"""Size of one schedule file read (the largest schedule allowed is a few MB as text)."""

register("Schedule", Schedule, Schedule.to_dict, Schedule.from_dict)

# PyTorch's letters: I is the input gradient (our B), B the full backward (our BW).
_TORCH_KINDS = {"F": "F", "I": "B", "W": "W", "B": "BW"}
_TORCH_ATOM = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|I|W|B)(\d+)")
_TORCH_UNSUPPORTED = ("UNSHARD", "RESHARD", "REDUCE_GRAD")


def dumps(schedule: Schedule) -> bytes:
    """msgpack bytes in ms-layout's versioned envelope (kind ``Schedule``)."""
    return _layout_dumps(schedule)


def loads(blob: bytes) -> Schedule:
    """Inverse of :func:`dumps`; foreign or damaged bytes raise ScheduleError."""
    try:
        return _layout_loads(blob, expect="Schedule")
    except LayoutError as exc:
        if isinstance(exc, ScheduleError):
            raise
        raise ScheduleError(str(exc)) from None


def to_csv(schedule: Schedule) -> str:
    """One row per rank, one action per cell (no header, as PyTorch's ``_dump_csv``)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for acts in schedule.actions:
        writer.writerow([str(a) for a in acts])
    return out.getvalue()


def _torch_token(token: str) -> str:
    if any(word in token for word in _TORCH_UNSUPPORTED):
        raise ScheduleError(f"PyTorch action {token!r} (FSDP/grad-reduce) has no ms-pipeline equivalent")
    return _TORCH_ATOM.sub(lambda m: f"{m.group(1)}{_TORCH_KINDS.get(m.group(2), m.group(2))}{m.group(3)}", token)


def from_csv(
    text: str,
    *,
    name: str = "custom",
    num_microbatches: int | None = None,
    stage_to_rank: Sequence[int] | None = None,
    dialect: str = "ms",
) -> Schedule:
    """Read a CSV written by :func:`to_csv` (``dialect="ms"``) or by PyTorch (``dialect="torch"``,
    where ``I`` is dx and ``B`` the full backward). Empty cells (PyTorch's idle slots) are skipped.
    The placement and sizes are inferred from the actions unless given."""
    if dialect not in ("ms", "torch"):
        raise ScheduleError(f"dialect must be 'ms' or 'torch', got {dialect!r}")
    rows = []
    try:
        for row in csv.reader(io.StringIO(text)):
            rows.append([c.strip() for c in row if c.strip()])
    except csv.Error as exc:  # a NUL byte, a field over the csv module's size limit
        raise ScheduleError(f"the CSV cannot be read: {exc}") from None
    MAX_SCHEDULE_SIZE.check(len(rows), "CSV rows (ranks)", ScheduleError)
    check_action_count(sum(len(cells) for cells in rows), "the CSV")
    ranks: list[tuple[Action, ...]] = []
    for cells in rows:
        if dialect == "torch":
            cells = [_torch_token(c) for c in cells]
        ranks.append(tuple(Action.parse(c) for c in cells))
    if not ranks:
        raise ScheduleError("the CSV holds no rows (one row per rank is expected)")
    placement, micro = _infer_shape(ranks)
    if stage_to_rank is not None:
        placement = tuple(stage_to_rank)
    return Schedule(name, len(placement), num_microbatches or micro, placement, tuple(ranks))


def _infer_shape(ranks: Sequence[Sequence[Action]]) -> tuple[tuple[int, ...], int]:
    """Placement from where each stage's computations run; sizes from the largest indices."""
    where: dict[int, int] = {}
    micro = 0
    for rank, acts in enumerate(ranks):
        for action in acts:
            for part in action.parts or (action,):
                micro = max(micro, part.microbatch + 1)
                if not part.is_compute:
                    continue
                if where.setdefault(part.stage, rank) != rank:
                    raise ScheduleError(
                        f"stage {part.stage} computes on rank {where[part.stage]} and on rank {rank} ({part})"
                    )
    if not where:
        raise ScheduleError("the CSV holds no computations, so the stage placement cannot be inferred")
    stages = max(where) + 1
    missing = [s for s in range(stages) if s not in where]
    if missing:
        raise ScheduleError(f"stages {missing} never compute; pass stage_to_rank to place them")
    return tuple(where[s] for s in range(stages)), micro


def save(schedule: Schedule, path: str | os.PathLike) -> Path:
    """Write by suffix: ``.msgpack`` (or ``.mpk``), ``.csv`` or ``.txt`` (the text form)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".msgpack", ".mpk"):
        data = dumps(schedule)
    elif suffix == ".csv":
        data = to_csv(schedule).encode()
    elif suffix == ".txt":
        data = schedule.to_text().encode()
    else:
        raise ScheduleError(f"cannot tell the format of {str(path)!r}; use .msgpack, .csv or .txt")
    atomic_write(path, data)
    return path


def _decode(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScheduleError(f"not UTF-8 text (byte {exc.start})") from None


def load(path: str | os.PathLike, **csv_options) -> Schedule:
    """Read a file written by :func:`save` (CSV options as in :func:`from_csv`); a missing,
    unreadable, oversized or malformed file raises ScheduleError naming it."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".msgpack", ".mpk", ".csv", ".txt"):
        raise ScheduleError(f"cannot tell the format of {str(path)!r}; use .msgpack, .csv or .txt")
    try:
        data = read_capped(path, MAX_FILE_BYTES.value, "schedule file")
    except FileError as exc:
        raise ScheduleError(str(exc)) from None
    try:
        if suffix in (".msgpack", ".mpk"):
            return loads(data)
        text = _decode(path, data)
        return from_csv(text, **csv_options) if suffix == ".csv" else Schedule.from_text(text)
    except ScheduleError as exc:
        raise ScheduleError(f"schedule file {str(path)!r}: {exc}") from None
