"""The in-process agent: step and range timing for any training loop, shipped to the node daemon.

    monitor = Monitor(tokens_per_step=4096)
    for batch in data:
        with monitor.step():
            with monitor.range("forward"):
                loss = ...
            with monitor.range("allreduce", kind="comm"):
                ...

Per step the training thread does two ``perf_counter`` calls per range, a dict update, and one
append to a bounded deque; packing, memory readings and I/O happen on the shipper thread (see
``shipper.py``). A step never blocks on the daemon and never sees an exception from the monitor.
Ranges may nest; each range adds its own wall time to its name. ``kind="comm"`` ranges also add
to the step's communication time, which the daemon subtracts to get the busy time its slow-rank
detector compares across ranks.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import time
from typing import Any, Callable

from . import wire
from .capture import Capture
from .errors import MonitorError
from .shipper import Shipper

log = logging.getLogger("ms_monitor.agent")

RANK_VARS = ("RANK", "RANK_ID", "MS_NODE_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
WORLD_VARS = ("WORLD_SIZE", "RANK_SIZE", "MS_WORKER_NUM", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
RANGE_KINDS = ("phase", "comm")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def env_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        raw = os.environ.get(name)
        if raw is not None and raw.strip().lstrip("-").isdigit():
            return int(raw)
    return default


def host_memory() -> int | None:
    """Resident set size of this process in bytes (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def mindspore_device_memory() -> int | None:
    """Bytes MindSpore's allocator holds on the device; None on CPU (where it reports 0) or without MindSpore."""

    ms = sys.modules.get("mindspore")
    if ms is None:
        return None
    try:
        if str(ms.get_context("device_target")).upper() == "CPU":
            return None
        return int(ms.runtime.memory_allocated())
    except Exception:
        return None


class _Range:
    __slots__ = ("comm", "mon", "name", "t0", "w0")

    def __init__(self, mon: Monitor, name: str, comm: bool):
        self.mon, self.name, self.comm, self.w0 = mon, name, comm, None

    def __enter__(self) -> _Range:
        # wall-clock start only while a capture runs: trace events need it, plain timing does not
        self.w0 = time.time_ns() if self.mon._capture is not None else None
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        dt = time.perf_counter() - self.t0
        mon = self.mon
        mon._phases[self.name] = mon._phases.get(self.name, 0.0) + dt
        if self.comm:
            mon._comm += dt
        cap = mon._capture
        if cap is not None and self.w0 is not None:
            cap.add(self.name, "comm" if self.comm else "phase", self.w0, dt, mon.step_num)


class _Step:
    __slots__ = ("mon", "samples", "tokens")

    def __init__(self, mon: Monitor, tokens: int | None, samples: int | None):
        self.mon, self.tokens, self.samples = mon, tokens, samples

    def __enter__(self) -> _Step:
        self.mon.begin_step()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mon.end_step(self.tokens, self.samples)


class Monitor:
    """Times steps and named ranges of one rank and ships them to the node daemon."""

    def __init__(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        addr: str | None = None,
        *,
        job: str = "",
        tokens_per_step: int | None = None,
        samples_per_step: int | None = None,
        queue_size: int = 4096,
        flush_interval: float = 0.1,
        device_memory: Callable[[], int | None] | None = None,
        trace_root: str | None = None,
        enabled: bool = True,
    ):
        self.rank = env_int(RANK_VARS, 0) if rank is None else int(rank)
        self.world_size = env_int(WORLD_VARS, 1) if world_size is None else int(world_size)
        if self.rank < 0 or self.world_size < 1:
            raise MonitorError(f"rank={self.rank} and world_size={self.world_size} must be >= 0 and >= 1")
        for name, value in (("tokens_per_step", tokens_per_step), ("samples_per_step", samples_per_step)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise MonitorError(f"{name}={value!r} must be a non-negative integer")
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.trace_root = trace_root
        self._device_memory = device_memory or mindspore_device_memory
        self.step_num = 0
        self._t0: float | None = None
        self._w0 = 0
        self._phases: dict[str, float] = {}
        self._comm = 0.0
        self._capture: Capture | None = None
        self._pending: dict | None = None
        self._mem: dict = {}
        self._mem_at = -1e9
        self.captures: list[Capture] = []
        self.shipper: Shipper | None = None
        if "mindspore" in sys.modules:  # MindSpore's own hook in this process honours --ranks
            from .dyno import install_rank_gate

            install_rank_gate()
        if enabled:
            hello = {
                "role": "agent",
                "rank": self.rank,
                "world": self.world_size,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "job": job[:256],
            }
            self.shipper = Shipper(
                hello,
                addr,
                on_command=self._on_command,
                queue_size=queue_size,
                flush_interval=flush_interval,
                pack=self._pack,
                extra=self._extra,
            )
            # ship the last steps when the script ends without close() (the thread is a daemon thread)
            atexit.register(self.close, 1.0)

    # -- public API ----------------------------------------------------------------------------
    def step(self, tokens: int | None = None, samples: int | None = None) -> _Step:
        """Context manager around one training step."""
        return _Step(self, tokens, samples)

    def range(self, name: str, kind: str = "phase") -> _Range:
        """Context manager around a named part of the step; ``kind="comm"`` for communication."""
        if kind not in RANGE_KINDS:
            raise MonitorError(f"range kind {kind!r} must be one of {RANGE_KINDS}")
        return _Range(self, name, kind == "comm")

    def comm(self, name: str = "comm") -> _Range:
        return _Range(self, name, True)

    def begin_step(self, step: int | None = None) -> None:
        """Start timing a step (``step`` given by a framework callback, else counted from 1)."""
        self.step_num = self.step_num + 1 if step is None else int(step)
        self._phases, self._comm = {}, 0.0
        pending = self._pending
        if pending is not None and self._capture is None and self.step_num >= pending["start"]:
            self._pending = None
            try:  # a capture must never break the step
                self._capture = Capture(pending, self.rank, self._send_control, self.trace_root)
                self._capture.begin(self.step_num)
                self.captures.append(self._capture)
            except Exception:
                log.exception("ms-monitor: capture did not start")
                self._capture = None
        if self._capture is not None:
            self._w0 = time.time_ns()
        self._t0 = time.perf_counter()

    def end_step(self, tokens: int | None = None, samples: int | None = None) -> None:
        """Finish the step begun by ``begin_step`` and queue its sample."""
        if self._t0 is None:
            return
        dt = time.perf_counter() - self._t0
        self._t0 = None
        tokens = self.tokens_per_step if tokens is None else tokens
        samples = self.samples_per_step if samples is None else samples
        if self.shipper is not None:
            self.shipper.put((self.step_num, time.time(), dt, self._comm, self._phases, tokens, samples))
        cap = self._capture
        if cap is not None:
            cap.add(f"step {self.step_num}", "step", self._w0, dt, self.step_num, tid=1)
            try:
                if cap.end_step(self.step_num):
                    self._capture = None
            except Exception:  # the capture must never break the step
                log.exception("ms-monitor: capture failed")
                self._capture = None

    def stats(self) -> dict[str, Any]:
        s = self.shipper
        return {
            "rank": self.rank,
            "step": self.step_num,
            "sent": s.sent if s else 0,
            "dropped": s.dropped if s else 0,
            "connects": s.connects if s else 0,
            "connected": s.connected if s else False,
        }

    def close(self, timeout: float = 2.0) -> None:
        if self.shipper is not None:
            self.shipper.close(timeout)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- shipper thread side ---------------------------------------------------------------------
    def _pack(self, item: tuple) -> dict:
        """A wire sample that passes the daemon's schema by construction (the shipper sends it
        without validating it again): user-given values are checked here, off the training thread."""
        step, ts, dt, comm, phases, tokens, samples = item
        step = min(max(step, -1), wire.MAX_STEP)
        out: dict[str, Any] = {"r": self.rank, "s": step, "ts": ts, "dt": dt, "ct": comm}
        if phases:
            out["ph"] = {
                str(k)[: wire.MAX_NAME]: v for k, v in list(phases.items())[: wire.MAX_PHASES] if 0.0 <= v <= 1e7
            }
        for key, value in (("tok", tokens), ("smp", samples)):
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= wire.MAX_STEP:
                out[key] = value
        return out

    def _extra(self) -> dict:
        """Memory readings, at most once a second (reading /proc costs tens of microseconds)."""
        now = time.monotonic()
        if now - self._mem_at < 1.0:
            return self._mem
        out = {}
        hm = host_memory()
        if hm is not None:
            out["hm"] = hm
        try:
            dm = self._device_memory()
        except Exception:
            dm = None
        if isinstance(dm, int) and dm >= 0:
            out["dm"] = dm
        self._mem, self._mem_at = out, now
        return out

    def _send_control(self, msg: dict) -> None:
        if self.shipper is not None:
            self.shipper.send_control(msg)

    def _on_command(self, msg: dict) -> None:
        if msg["t"] == "trace":
            log.info("ms-monitor: rank %d will trace %d steps from step %d", self.rank, msg["steps"], msg["start"])
            self._pending = msg
