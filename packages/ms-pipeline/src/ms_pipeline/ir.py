"""A pipeline schedule as data: action kinds, actions, and one ordered action list per rank.

The text form follows PyTorch's pipelining IR, ``{stage}{kind}{microbatch}`` (``0F3``, ``7B0``,
``3SEND_F1``), with one difference in letters that matters when reading PyTorch CSVs: here ``B``
is the input-gradient pass (dx, PyTorch's ``I``) and ``BW`` the fused backward (PyTorch's ``B``),
the names the Zero Bubble paper uses (Qi et al., arXiv 2401.10241). An overlapped pair, one
forward run together with one backward (the "1B1F" steady phase of DualPipeV and MindSpore's
``pp_1f1b_overlap``), is written ``(0F7;7B3)OVERLAP_F_B``.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum

from ms_layout.limits import Limit

from .errors import ScheduleError

MAX_SCHEDULE_SIZE = Limit("MS_PIPELINE_MAX_SCHEDULE_SIZE", 1 << 14, "stage x microbatch pairs")
"""Stages x microbatches of one schedule (a stage is a chunk: ZeroBubbleV has 2 per rank). Building,
validating and simulating take about 30 us per action, and a pair has 2 or 3 actions (up to 7
lowered), so the default (e.g. 128 ranks x 128 microbatches of ZeroBubbleV) stays within a few
seconds; ``simulate --stages 1000 --microbatches 1000`` ran for minutes."""
ACTIONS_PER_PAIR = 8
"""Actions a schedule may hold per stage x microbatch pair: F, B, W and four transfers when lowered."""


def check_schedule_size(num_stages: int, num_microbatches: int, what: str = "schedule") -> None:
    """Refuse a schedule of more stage x microbatch pairs than MS_PIPELINE_MAX_SCHEDULE_SIZE,
    before anything is built."""
    MAX_SCHEDULE_SIZE.check(
        num_stages * num_microbatches,
        f"{what} size {num_stages} stages x {num_microbatches} microbatches",
        ScheduleError,
    )


def check_action_count(count: int, what: str = "schedule") -> None:
    """Refuse more actions than ACTIONS_PER_PAIR per allowed pair (counted before parsing them)."""
    bound = ACTIONS_PER_PAIR * MAX_SCHEDULE_SIZE.value
    if count > bound:
        raise ScheduleError(
            f"{what} holds {count} actions, over the limit of {bound} ({ACTIONS_PER_PAIR} per stage x microbatch"
            f" pair; raise it with {MAX_SCHEDULE_SIZE.env}=N)"
        )


class Kind(str, Enum):
    """What an action does; the value is its spelling in the text form."""

    F = "F"  # forward of one stage for one microbatch
    B = "B"  # input gradient only (dx); the weight gradient is left for a later W
    W = "W"  # weight gradient (dw), deferred on the activations and grads B saved
    BW = "BW"  # fused backward: dx and dw together, as 1F1B and GPipe run it
    SEND_F = "SEND_F"  # send a stage's output activation to the next stage's rank
    RECV_F = "RECV_F"  # receive a stage's input activation from the previous stage's rank
    SEND_B = "SEND_B"  # send a stage's input gradient to the previous stage's rank
    RECV_B = "RECV_B"  # receive a stage's output gradient from the next stage's rank
    OVERLAP_F_B = "OVERLAP_F_B"  # one forward and one backward run together (1B1F)


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.W, Kind.BW})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
BACKWARD_KINDS = frozenset({Kind.B, Kind.BW})  # the kinds that produce a stage's input gradient

# Longest spellings first, so that "BW" is not read as "B" followed by junk.
_KIND_RE = "|".join(sorted((k.value for k in Kind if k is not Kind.OVERLAP_F_B), key=len, reverse=True))
_ATOM = rf"(\d+)({_KIND_RE})(\d+)"
_ATOM_RE = re.compile(rf"^{_ATOM}$")
_PAIR_RE = re.compile(rf"^\(({_ATOM});({_ATOM})\)(?:OVERLAP_F_B)?$")
_NAME_RE = re.compile(r"^[\w.+-]{1,200}$")
_MAX_ACTION_CHARS = 80


@dataclass(frozen=True)
class Action:
    """One step of one rank: a computation, a transfer, or an overlapped forward/backward pair."""

    stage: int
    """Pipeline stage the action belongs to (-1 for an overlapped pair, whose halves carry theirs)."""
    kind: Kind
    """What the action does."""
    microbatch: int
    """Microbatch index (-1 for an overlapped pair)."""
    parts: tuple[Action, Action] | None = field(default=None, compare=True)
    """For OVERLAP_F_B only: the forward half and the backward half (B or BW), in that order."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", Kind(self.kind))
        except ValueError:
            raise ScheduleError(
                f"unknown action kind {self.kind!r}; expected one of {[k.value for k in Kind]}"
            ) from None
        if self.kind is Kind.OVERLAP_F_B:
            self._check_pair()
            return
        if self.parts is not None:
            raise ScheduleError(f"only an OVERLAP_F_B action has parts, not a {self.kind.value}")
        for what, value in (("stage", self.stage), ("microbatch", self.microbatch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ScheduleError(f"action {self.kind.value}: {what} must be an int >= 0, got {value!r}")

    def _check_pair(self) -> None:
        parts = self.parts
        if not isinstance(parts, tuple) or len(parts) != 2 or not all(isinstance(p, Action) for p in parts):
            raise ScheduleError(f"OVERLAP_F_B needs parts=(forward, backward), got {parts!r}")
        fwd, bwd = parts
        if fwd.kind is not Kind.F or bwd.kind not in BACKWARD_KINDS:
            raise ScheduleError(f"OVERLAP_F_B pairs an F with a B or BW, got ({fwd};{bwd})")
        if (self.stage, self.microbatch) != (-1, -1):
            raise ScheduleError("an OVERLAP_F_B action has stage=-1 and microbatch=-1; its parts carry theirs")

    @classmethod
    def overlap(cls, forward: Action, backward: Action) -> Action:
        """The 1B1F pair: ``forward`` (an F) and ``backward`` (a B or BW) run together."""
        return cls(-1, Kind.OVERLAP_F_B, -1, (forward, backward))

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the text form: ``0F3``, ``7BW0``, ``3SEND_F1`` or ``(0F7;7B3)OVERLAP_F_B``."""
        if not isinstance(text, str):
            raise ScheduleError(f"an action is a string such as '0F3', got {text!r:.50}")
        text = text.strip()
        if len(text) > _MAX_ACTION_CHARS:  # also keeps int() far from Python's 4300-digit limit
            raise ScheduleError(f"action {text[:40]!r}... is {len(text)} characters long; actions are short like 0F3")
        m = _ATOM_RE.match(text)
        if m:
            return cls(int(m.group(1)), Kind(m.group(2)), int(m.group(3)))
        m = _PAIR_RE.match(text)
        if m:
            return cls.overlap(cls.parse(m.group(1)), cls.parse(m.group(5)))
        raise ScheduleError(
            f"cannot read action {text!r}; expected {{stage}}{{kind}}{{microbatch}} such as 0F3, 7B0, 7W0, 2BW1,"
            " 3SEND_F1, or (0F7;7B3)OVERLAP_F_B"
        )

    def __str__(self) -> str:
        if self.parts is not None:
            return f"({self.parts[0]};{self.parts[1]})OVERLAP_F_B"
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @property
    def is_compute(self) -> bool:
        """True for F, B, W, BW and overlapped pairs; False for sends and receives."""
        return self.kind not in COMM_KINDS

    def computes(self) -> tuple[Action, ...]:
        """The computations this action performs: its halves for a pair, itself otherwise."""
        if self.parts is not None:
            return self.parts
        return (self,) if self.kind in COMPUTE_KINDS else ()


def format_actions(actions: Iterable[Action]) -> str:
    """One rank's actions as a line of text: ``0F0 0F1 0B0 0W0``."""
    return " ".join(str(a) for a in actions)


def parse_actions(text: str) -> tuple[Action, ...]:
    """Inverse of :func:`format_actions`."""
    return tuple(Action.parse(tok) for tok in text.split())


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists for a pipeline of ``num_stages`` stages and
    ``num_microbatches`` microbatches. A pure description: build it, print it, validate it,
    simulate it, draw it, serialize it, then hand it to the runtime."""

    name: str
    """Short name of the schedule family (``1f1b``, ``zbv``, ...), one word."""
    num_stages: int
    """Number of pipeline stages (model chunks); may exceed the number of ranks."""
    num_microbatches: int
    """Number of microbatches per step."""
    stage_to_rank: tuple[int, ...]
    """Rank that holds each stage (``stage_to_rank[s]``)."""
    actions: tuple[tuple[Action, ...], ...]
    """``actions[rank]``: what that rank runs, in order."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ScheduleError(f"schedule name must be one word of letters, digits, '.+-_', got {self.name!r:.100}")
        for what, value in (("num_stages", self.num_stages), ("num_microbatches", self.num_microbatches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{what} must be an int >= 1, got {value!r:.50}")
        check_schedule_size(self.num_stages, self.num_microbatches)
        for what, value in (("stage_to_rank", self.stage_to_rank), ("actions", self.actions)):
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
                raise ScheduleError(f"{what} must be a sequence, got {value!r:.100}")
        placement = tuple(self.stage_to_rank)
        bad = [r for r in placement if isinstance(r, bool) or not hasattr(r, "__index__")]
        if bad:
            raise ScheduleError(f"stage_to_rank holds {bad[0]!r:.50}; ranks must be ints")
        object.__setattr__(self, "stage_to_rank", tuple(operator.index(r) for r in placement))
        if len(self.stage_to_rank) != self.num_stages:
            raise ScheduleError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries for {self.num_stages} stages:"
                f" {self.stage_to_rank!r:.200}"
            )
        ranks = tuple(self.actions)
        MAX_SCHEDULE_SIZE.check(len(ranks), "schedule ranks", ScheduleError)
        for rank, acts in enumerate(ranks):
            if isinstance(acts, (str, bytes)) or not isinstance(acts, Iterable):
                raise ScheduleError(f"actions of rank {rank} must be a sequence, got {acts!r:.100}")
        object.__setattr__(self, "actions", tuple(tuple(acts) for acts in ranks))
        check_action_count(sum(len(acts) for acts in self.actions))
        bad = [r for r in self.stage_to_rank if not 0 <= r < self.num_ranks]
        if bad:
            raise ScheduleError(
                f"stage_to_rank {self.stage_to_rank!r:.200} names ranks {bad} outside 0..{self.num_ranks - 1}"
            )
        for rank, acts in enumerate(self.actions):
            for step, action in enumerate(acts):
                self._check_action(rank, step, action)

    def _check_action(self, rank: int, step: int, action: Action) -> None:
        if not isinstance(action, Action):
            raise ScheduleError(f"rank {rank} step {step}: expected an Action, got {action!r:.100}")
        for part in action.parts or (action,):
            if part.stage >= self.num_stages or part.microbatch >= self.num_microbatches:
                raise ScheduleError(
                    f"rank {rank} step {step}: action {part} is outside {self.num_stages} stages x"
                    f" {self.num_microbatches} microbatches"
                )

    # ------------------------------------------------------------ queries
    @property
    def num_ranks(self) -> int:
        """Number of ranks (the length of ``actions``)."""
        return len(self.actions)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Stages held by ``rank``, ascending."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    @property
    def stages_per_rank(self) -> int:
        """Largest number of stages any rank holds (2 for ZeroBubbleV, v for interleaved)."""
        counts = [0] * self.num_ranks  # one pass: stages_of for every rank was quadratic in the ranks
        for r in self.stage_to_rank:
            counts[r] += 1
        return max(counts, default=0)

    @property
    def is_lowered(self) -> bool:
        """True when sends and receives have been inserted (see :func:`ms_pipeline.lower.lower`)."""
        return any(a.kind in COMM_KINDS for rank in self.actions for a in rank)

    def compute_only(self) -> Schedule:
        """The same schedule with sends and receives removed."""
        return Schedule(
            self.name,
            self.num_stages,
            self.num_microbatches,
            self.stage_to_rank,
            tuple(tuple(a for a in rank if a.is_compute) for rank in self.actions),
        )

    def iter_actions(self) -> Iterator[tuple[int, int, Action]]:
        """Every (rank, step, action)."""
        for rank, acts in enumerate(self.actions):
            for step, action in enumerate(acts):
                yield rank, step, action

    # ------------------------------------------------------------ text form
    def header(self) -> str:
        placement = ",".join(map(str, self.stage_to_rank))
        return (
            f"schedule {self.name}: stages={self.num_stages} microbatches={self.num_microbatches} placement={placement}"
        )

    def to_text(self) -> str:
        """A header line, then one line per rank: ``rank 0: 0F0 0F1 0B0 0W0 ...``."""
        width = len(str(self.num_ranks - 1))
        rows = [f"rank {r:>{width}}: {format_actions(acts)}" for r, acts in enumerate(self.actions)]
        return "\n".join([self.header(), *rows]) + "\n"

    def __str__(self) -> str:
        return self.to_text()

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Inverse of :meth:`to_text`."""
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        m = re.match(
            r"^schedule ([\w.+-]{1,200}): stages=(\d{1,18}) microbatches=(\d{1,18}) placement=([\d,]+)$",
            lines[0] if lines else "",
        )
        if not m:
            raise ScheduleError(
                f"first line must be 'schedule NAME: stages=S microbatches=M placement=r,r,...', got {lines[:1]!r:.200}"
            )
        check_schedule_size(int(m.group(2)), int(m.group(3)))
        MAX_SCHEDULE_SIZE.check(len(lines) - 1, "schedule ranks", ScheduleError)
        check_action_count(sum(len(line.partition(":")[2].split()) for line in lines[1:]))
        ranks: list[tuple[Action, ...]] = []
        for i, line in enumerate(lines[1:]):
            rm = re.match(r"^rank\s+(\d{1,18}):(.*)$", line)
            if not rm or int(rm.group(1)) != i:
                raise ScheduleError(f"line {i + 2} must start with 'rank {i}:', got {line[:40]!r}")
            ranks.append(parse_actions(rm.group(2)))
        try:
            placement = tuple(int(x) for x in m.group(4).split(","))
        except ValueError:
            raise ScheduleError(f"placement {m.group(4)[:100]!r} must be ranks joined by commas") from None
        return cls(m.group(1), int(m.group(2)), int(m.group(3)), placement, tuple(ranks))

    # ------------------------------------------------------------ plain data
    def to_dict(self) -> dict:
        """Plain data for msgpack/JSON; actions keep their text form."""
        return {
            "schema": 1,
            "name": self.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "stage_to_rank": list(self.stage_to_rank),
            "actions": [[str(a) for a in acts] for acts in self.actions],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        """Inverse of :meth:`to_dict`."""
        if not isinstance(data, dict):
            raise ScheduleError(f"a schedule dict is expected, got {type(data).__name__}")
        schema = data.get("schema")
        if schema != 1 or isinstance(schema, bool):
            raise ScheduleError(f"schedule data has schema {schema!r:.50}; this reader knows schema 1")
        missing = [k for k in ("name", "num_stages", "num_microbatches", "stage_to_rank", "actions") if k not in data]
        if missing:
            raise ScheduleError(f"schedule data is missing {missing}")
        rows = data["actions"]
        if not isinstance(rows, list) or not all(isinstance(acts, list) for acts in rows):
            raise ScheduleError(f"schedule actions must be a list of lists of action strings, got {rows!r:.100}")
        MAX_SCHEDULE_SIZE.check(len(rows), "schedule ranks", ScheduleError)
        check_action_count(sum(len(acts) for acts in rows))
        for acts in rows:
            for a in acts:
                if not isinstance(a, str):
                    raise ScheduleError(f"schedule action {a!r:.50} is not a string such as '0F3'")
        if not isinstance(data["stage_to_rank"], list):
            raise ScheduleError(f"stage_to_rank must be a list of ranks, got {data['stage_to_rank']!r:.100}")
        actions = tuple(tuple(Action.parse(a) for a in acts) for acts in rows)
        return cls(data["name"], data["num_stages"], data["num_microbatches"], tuple(data["stage_to_rank"]), actions)
