"""What to dump: msprobe's config.json fields as a typed dataclass.

`load_config(path)` reads msprobe's config.json (common keys plus the sub-dict of the task);
`DumpConfig(...)` takes the same fields as keyword arguments. Keys of msprobe tasks that ms-probe
does not run (overflow_check, free_benchmark, ...) are refused with a message rather than ignored.
"""

from __future__ import annotations

import builtins
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ms_layout.files import FileError, read_json

from .errors import ProbeError

log = logging.getLogger("ms_probe")

TASKS = ("statistics", "tensor", "structure")
LEVELS = ("L0", "L1", "mix")
DATA_MODES = ("all", "forward", "backward", "input", "output")
SUMMARY_MODES = ("statistics", "md5")
JIT_MODES = ("boundary", "graph", "pynative")
_IGNORED_KEYS = ("extra_info", "precision", "is_deterministic", "enable_dataloader", "acl_config")


def parse_int_list(value: Any, what: str) -> list[int]:
    """[1, "4-6"] -> [1, 4, 5, 6]; [] or None means all."""
    if value is None:
        return []
    if isinstance(value, (int, str)):
        value = [value]
    out: list[int] = []
    for v in value:
        if isinstance(v, bool):
            raise ProbeError(f"{what}: {v!r} is not an int or an 'a-b' range")
        if isinstance(v, int):
            if v < 0:
                raise ProbeError(f"{what}: {v} is negative")
            out.append(v)
            continue
        if isinstance(v, str):
            parts = v.split("-")
            try:
                if len(parts) == 1:
                    out.append(int(parts[0]))
                    continue
                if len(parts) == 2:
                    lo, hi = int(parts[0]), int(parts[1])
                    if 0 <= lo <= hi:
                        out.extend(range(lo, hi + 1))
                        continue
            except ValueError:
                pass
        raise ProbeError(f"{what}: {v!r} is not an int or an 'a-b' range with a <= b")
    return sorted(set(out))


@dataclass
class DumpConfig:
    """One dump: where, what, which steps and ranks (msprobe's config.json fields)."""

    dump_path: str
    """Root folder; each step and rank gets `step{N}/rank{R}/` below it."""
    task: str = "statistics"
    """"statistics" (Max/Min/Mean/Norm per tensor), "tensor" (statistics plus .npy files) or
    "structure" (module tree and stacks only)."""
    level: str = "L0"
    """"L0" modules, "L1" API calls, "mix" both."""
    step: list[int] = field(default_factory=builtins.list)
    """Steps to dump (ints or "a-b" ranges); empty: every step."""
    rank: list[int] = field(default_factory=builtins.list)
    """Ranks that dump; empty: every rank."""
    scope: list[str] = field(default_factory=builtins.list)
    """Empty, or [first item, last item]: dump from the first item's start to the last item's end."""
    list: list[str] = field(default_factory=builtins.list)
    """Item names or substrings; when given, only matching items (and, in mix, APIs inside matching
    modules) are dumped."""
    data_mode: list[str] = field(default_factory=lambda: ["all"])
    """Any of all/forward/backward/input/output."""
    summary_mode: str = "statistics"
    """"statistics" or "md5" (adds a CRC-32 of each tensor's bytes)."""
    tensor_list: list[str] = field(default_factory=builtins.list)
    """Statistics task, but real tensors for items matching these names or substrings."""
    async_dump: bool = False
    """Statistics task: compute the statistics in a thread beside the step (:mod:`.stats_worker`),
    not before the hook returns; the step waits for them before its JSON files are written."""
    jit: str = "pynative"
    """MindSpore only. "pynative": dumped steps run jit functions eagerly (MS_JIT=0, PyNative context)
    so that every Cell inside them is dumped; "boundary": jit code stays compiled and Cells with a jit
    construct are dumped at their boundary only (a whole step under jit cannot be dumped this way);
    "graph": the step stays compiled, with identity probes compiled into it on every Cell (compile it
    between start() and stop(), e.g. with PrecisionDebugger.jit(step))."""

    def __post_init__(self) -> None:
        if not self.dump_path or not isinstance(self.dump_path, (str, os.PathLike)):
            raise ProbeError(f"dump_path {self.dump_path!r} must be a non-empty path")
        self.dump_path = os.fspath(self.dump_path)
        self._check("task", self.task, TASKS)
        self._check("level", self.level, LEVELS)
        self._check("summary_mode", self.summary_mode, SUMMARY_MODES)
        self._check("jit", self.jit, JIT_MODES)
        if not isinstance(self.async_dump, bool):
            raise ProbeError(f"async_dump={self.async_dump!r} must be true or false")
        self.step = parse_int_list(self.step, "step")
        self.rank = parse_int_list(self.rank, "rank")
        self.data_mode = [self.data_mode] if isinstance(self.data_mode, str) else list(self.data_mode or ["all"])
        for mode in self.data_mode:
            self._check("data_mode", mode, DATA_MODES)
        self.scope = list(self.scope or [])
        if self.scope and len(self.scope) != 2:
            raise ProbeError(f"scope {self.scope!r} must be empty or [first item, last item]")
        self.list = [str(s) for s in (self.list or [])]
        self.tensor_list = [str(s) for s in (self.tensor_list or [])]

    @staticmethod
    def _check(key: str, value: Any, allowed: tuple[str, ...]) -> None:
        if value not in allowed:
            raise ProbeError(f"{key}={value!r} is not supported; expected one of {list(allowed)}")

    def wants(self, direction: str, part: str) -> bool:
        """Whether data_mode keeps `part` ("input"/"output") of a `direction` ("forward"/"backward") item."""
        modes = set(self.data_mode)
        if "all" in modes:
            return True
        if modes & {"forward", "backward"} and direction not in modes:
            return False
        if modes & {"input", "output"} and part not in modes:
            return False
        return True

    def to_dict(self) -> dict[str, Any]:
        """The config as msprobe's config.json layout."""
        d = asdict(self)
        sub = {k: d.pop(k) for k in ("scope", "list", "data_mode", "summary_mode", "tensor_list")}
        d[self.task if self.task in ("statistics", "tensor") else "statistics"] = sub
        return d


def config_from_dict(raw: dict[str, Any], **overrides: Any) -> DumpConfig:
    """A DumpConfig from msprobe's config.json dict; keyword overrides win (None means not given)."""
    if not isinstance(raw, dict):
        raise ProbeError(f"config must be a JSON object, got {type(raw).__name__}")
    task = overrides.get("task") or raw.get("task", "statistics")
    if task not in TASKS:
        raise ProbeError(f"task={task!r} is not supported by ms-probe; expected one of {list(TASKS)}")
    sub = raw.get(task if task != "structure" else "statistics") or {}
    if not isinstance(sub, dict):
        raise ProbeError(f"config key {task!r} must be an object, got {sub!r}")
    for key in _IGNORED_KEYS:
        if key in raw:
            log.info("ms-probe: config key %r is accepted and has no effect here", key)
    known = {"task", "dump_path", "rank", "step", "level", "jit", "async_dump", "statistics", "tensor", *_IGNORED_KEYS}
    unknown = sorted(set(raw) - known - {"acc_check", "run_ut", "overflow_check", "free_benchmark", "grad_probe"})
    if unknown:
        raise ProbeError(f"unknown config keys {unknown}")
    fields = {
        "dump_path": raw.get("dump_path"),
        "task": task,
        "level": raw.get("level", "L0"),
        "step": raw.get("step", []),
        "rank": raw.get("rank", []),
        "jit": raw.get("jit", "pynative"),
        "async_dump": raw.get("async_dump", False),
        "scope": sub.get("scope", []),
        "list": sub.get("list", []),
        "data_mode": sub.get("data_mode", ["all"]),
        "summary_mode": sub.get("summary_mode", "statistics"),
        "tensor_list": sub.get("tensor_list", []),
    }
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if not fields["dump_path"]:
        raise ProbeError("config has no dump_path")
    return DumpConfig(**fields)


def load_config(path: str | os.PathLike, **overrides: Any) -> DumpConfig:
    """Read msprobe's config.json."""
    try:
        raw = read_json(path, "config file", 1 << 20)
    except FileError as e:  # read_json also turns deep nesting into a FileError
        raise ProbeError(str(e)) from None
    return config_from_dict(raw, **overrides)
