"""The step x rank grid that validation errors print (as PyTorch's ``_validate_schedule`` does)."""

from __future__ import annotations

from .ir import Schedule

_WINDOW = 6  # grid rows shown on each side of a marked step


def format_grid(schedule: Schedule, marks: set[tuple[int, int]] = frozenset(), window: int | None = _WINDOW) -> str:
    """Steps as rows, ranks as columns; cells in ``marks`` ((rank, step)) are flagged ``>>``.
    With marks, only ``window`` rows around them are shown."""
    steps = max((len(a) for a in schedule.actions), default=0)
    rows = range(steps)
    if marks and window is not None:
        lo = max(0, min(s for _, s in marks) - window)
        hi = min(steps, max(s for _, s in marks) + window + 1)
        rows = range(lo, hi)

    def cell(r: int, s: int) -> str:
        text = str(schedule.actions[r][s]) if s < len(schedule.actions[r]) else ""
        return (">>" if (r, s) in marks else "") + text

    width = max(
        [len(f"rank {r}") for r in range(schedule.num_ranks)]
        + [len(cell(r, s)) for s in rows for r in range(schedule.num_ranks)]
    )
    header = "step  " + "  ".join(f"rank {r}".ljust(width) for r in range(schedule.num_ranks))
    lines = [header]
    if rows.start > 0:
        lines.append("  ...")
    for s in rows:
        row = f"{s:>4}  " + "  ".join(cell(r, s).ljust(width) for r in range(schedule.num_ranks))
        if any((r, s) in marks for r in range(schedule.num_ranks)):
            row = row.rstrip() + "  <-- ERROR HERE"
        lines.append(row.rstrip())
    if rows.stop < steps:
        lines.append("  ...")
    return "\n".join(lines)
