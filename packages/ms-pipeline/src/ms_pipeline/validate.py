"""The validator: a schedule is accepted only if it computes every (stage, microbatch) exactly
once, in an order that meets every dependency, on the rank that holds the stage, and its lowering
to sends and receives runs to the end in a step simulation.

Errors name the broken action, its rank and step, and print a step x rank grid with the broken
cell marked, as PyTorch's ``_validate_schedule`` does.
"""

from __future__ import annotations

from .deps import locate, needs, play
from .errors import ScheduleError
from .grid import format_grid
from .ir import BACKWARD_KINDS, Kind, Schedule
from .lower import step_simulate


def _fail(schedule: Schedule, message: str, marks: set[tuple[int, int]]) -> ScheduleError:
    return ScheduleError(f"{message}\n{format_grid(schedule, marks)}")


def _check_placement(schedule: Schedule) -> None:
    for rank, step, action in schedule.iter_actions():
        for part in action.parts or (action,):
            holder = schedule.stage_to_rank[part.stage]
            if holder != rank:
                raise _fail(
                    schedule,
                    f"rank {rank} step {step}: {part} runs on rank {rank}, but stage {part.stage} is on rank {holder}",
                    {(rank, step)},
                )


def _check_pairs(schedule: Schedule) -> None:
    for rank, step, action in schedule.iter_actions():
        if action.parts is None:
            continue
        fwd, bwd = action.parts
        if fwd.stage == bwd.stage and fwd.microbatch == bwd.microbatch:
            raise _fail(
                schedule, f"rank {rank} step {step}: {action} pairs a backward with its own forward", {(rank, step)}
            )


def _check_counts(schedule: Schedule) -> None:
    """Every stage and microbatch: one F, and either one BW or one B and one W."""
    where = locate(schedule)
    for (stage, kind, mb), places in where.items():
        if len(places) > 1:
            steps = ", ".join(f"rank {r} step {s}" for r, s in places)
            raise _fail(schedule, f"{stage}{kind.value}{mb} appears {len(places)} times ({steps})", set(places[1:]))
    for stage in range(schedule.num_stages):
        for mb in range(schedule.num_microbatches):
            problem = _count_problem(stage, mb, where)
            if problem is not None:
                message, kind = problem
                marks = set(where.get((stage, kind, mb), [])) if kind else set()
                raise _fail(schedule, message, marks)


def _count_problem(stage: int, mb: int, where: dict) -> tuple[str, Kind | None] | None:
    """What is wrong with the computations of one (stage, microbatch), and which kind to mark."""
    has = {k for k in (Kind.F, Kind.B, Kind.W, Kind.BW) if (stage, k, mb) in where}
    s, m = stage, mb
    if Kind.F not in has:
        return f"{s}F{m} is missing: stage {s} microbatch {m} never runs its forward", None
    if Kind.BW in has and Kind.B in has:
        return f"{s}B{m} and {s}BW{m} both compute the input gradient of stage {s} microbatch {m}", Kind.B
    if Kind.W in has and Kind.BW in has:
        return f"{s}W{m} computes weight gradients that {s}BW{m} already computed", Kind.W
    if Kind.W in has and Kind.B not in has:
        return f"{s}W{m} has no {s}B{m} (W needs the gradients B captures)", Kind.W
    if not has & BACKWARD_KINDS:
        return f"{s}B{m} is missing: stage {s} microbatch {m} never runs a backward (B or BW)", None
    if Kind.B in has and Kind.W not in has:
        return f"{s}W{m} is missing: {s}B{m} is never followed by its weight pass", Kind.B
    return None


def _check_local_order(schedule: Schedule) -> None:
    """A dependency on the same rank must come earlier in that rank's list."""
    where = locate(schedule)
    for rank, step, action in schedule.iter_actions():
        for part in action.computes():
            for stage, mb, kinds in needs(part, schedule.num_stages):
                for kind in kinds:
                    for dep_rank, dep_step in where.get((stage, kind, mb), []):
                        if dep_rank == rank and dep_step > step:
                            raise _fail(
                                schedule,
                                f"rank {rank} step {step}: {action} needs {stage}{kind.value}{mb},"
                                f" which rank {rank} runs later (step {dep_step})",
                                {(rank, step)},
                            )


def _check_progress(schedule: Schedule) -> None:
    played = play(schedule, duration=lambda a: 1.0, latency=lambda d, p: 0.0)
    if played.stuck:
        lines = [f"deadlock: every rank waits in schedule {schedule.name}"]
        for s in played.stuck:
            lines.append(f"  rank {s.rank} step {s.step}: {s.action} waits for {', '.join(s.waiting_for)}")
        raise _fail(schedule, "\n".join(lines), {(s.rank, s.step) for s in played.stuck})


def validate(schedule: Schedule) -> Schedule:
    """Check ``schedule`` and return it unchanged; raises ScheduleError naming the first broken
    action, with a step x rank grid that marks it. Its computations are checked (placement,
    counts, local order, progress); a lowered schedule's sends and receives are also run in the
    step simulation. Validation never lowers: ``validate(lower(schedule))`` checks the lists a
    runtime executes (:func:`~ms_pipeline.lower.lower` inserts transfers only where the computations
    need them, so a schedule whose computations pass cannot fail on its lowering's)."""
    compute = schedule.compute_only()
    _check_placement(schedule)
    _check_pairs(compute)
    _check_counts(compute)
    _check_local_order(compute)
    _check_progress(compute)
    if schedule.is_lowered:
        step_simulate(schedule)
    return schedule


def is_valid(schedule: Schedule) -> bool:
    """True if :func:`validate` accepts ``schedule``."""
    try:
        validate(schedule)
    except ScheduleError:
        return False
    return True


__all__ = ["format_grid", "is_valid", "validate"]  # format_grid lives in .grid; kept here for callers
