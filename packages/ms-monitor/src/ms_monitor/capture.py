"""On-demand capture on the agent side: MindSpore's profiler for N steps, plus the agent's ranges.

The daemon's ``trace`` command names a first step and a number of steps. At the boundary before
that step the agent starts ``mindspore.profiler.profile`` (CPU activities, plus NPU on Ascend;
analysis in a separate process so the training step is not held up) and records its own ranges as
trace events; after the last step it stops the profiler. A background thread then waits for
MindSpore's files and sends them to the daemon in chunks over the agent's connection, followed by a
``tdone`` message naming what was sent. Failures of the profiler are reported in ``tdone`` and
never reach the training loop; the agent's own events are always sent, so the merged trace has a
lane for every rank even where MindSpore wrote nothing (a process without MindSpore, a profiler
already in use, a CPU mode without analysis).
"""

from __future__ import annotations

import glob
import json
import logging
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from . import wire

log = logging.getLogger("ms_monitor.agent")

MAX_FILE = 64 * 1024 * 1024
#: how long to wait for MindSpore's (asynchronous) analysis to write trace_view.json
ANALYSIS_WAIT = 120.0


def default_trace_root() -> str:
    return os.path.join(tempfile.gettempdir(), f"ms-monitor-traces-{os.getuid()}")


def _start_mindspore_profiler(out_dir: str, steps: int, analyse: bool):
    """As MindSpore's own DynamicProfilerMonitor does: a schedule of ``steps`` active steps (which also
    puts step markers in the trace), started now, saved by the ``step()`` call after the last step."""
    import mindspore as ms
    from mindspore.profiler import ProfilerActivity, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU]
    if str(ms.get_context("device_target")).lower() == "ascend":
        activities.append(ProfilerActivity.NPU)
    prof = ms.profiler.profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=0, active=steps, repeat=1, skip_first=0),
        on_trace_ready=tensorboard_trace_handler(out_dir, analyse_flag=analyse, async_mode=True),
        start_profile=False,
    )
    prof.start()
    return prof


def _finish_mindspore_profiler(prof) -> None:
    """The last ``step()`` (which saves the trace and starts the analysis) and ``stop()``; the
    asynchronous analysis must start as a forked process.

    MindSpore 2.10 starts the analysis with ``multiprocessing.Process``, i.e. the default context.
    In a process that was itself started with "spawn" (torch/ms-layout launchers do that) the
    default is "spawn" too, and the fresh interpreter fails with "Logger not initialized" (measured).
    Forking, as a normally started Linux process does, works; the default is restored right after.
    """
    method = multiprocessing.get_start_method(allow_none=True)
    if method in (None, "fork") or not sys.platform.startswith("linux"):
        prof.step()
        prof.stop()
        return
    multiprocessing.set_start_method("fork", force=True)
    try:
        prof.step()
        prof.stop()
    finally:
        multiprocessing.set_start_method(method, force=True)


def _stable(path: str, wait: float) -> bool:
    """True once ``path`` exists with a size that stays the same for ``wait`` seconds."""
    if not os.path.exists(path):
        return False
    size = os.path.getsize(path)
    time.sleep(wait)
    return size > 0 and os.path.getsize(path) == size


def collect_mindspore_files(out_dir: str, analyse: bool, timeout: float = ANALYSIS_WAIT) -> list[tuple[str, str]]:
    """(name, path) of the trace files MindSpore wrote under ``out_dir``: trace_view.json if the
    analysis produced it within ``timeout``, else the raw CPU op timestamp files."""
    deadline = time.monotonic() + timeout
    pattern = os.path.join(out_dir, "**", "ASCEND_PROFILER_OUTPUT", "trace_view.json")
    while analyse and time.monotonic() < deadline:
        found = glob.glob(pattern, recursive=True)
        if found and _stable(found[0], 0.3):
            try:
                json.loads(Path(found[0]).read_bytes())
                return [("trace_view.json", found[0])]
            except ValueError:
                pass  # still being written
        time.sleep(0.2)
    raw = sorted(glob.glob(os.path.join(out_dir, "**", "FRAMEWORK", "cpu_op_execute_timestamp_*.txt"), recursive=True))
    return [(os.path.basename(p), p) for p in raw if _stable(p, 0.1)]


class Capture:
    """One trace of one rank; created by the Monitor at a step boundary."""

    def __init__(self, cmd: dict, rank: int, send: Callable[[dict], None], root: str | None = None):
        self.id = cmd["id"]
        self.steps = cmd["steps"]
        self.use_profiler = cmd["profiler"]
        self.analyse = cmd.get("analyse", True)
        self.rank = rank
        self.send = send
        self.dir = os.path.join(root or default_trace_root(), self.id, f"rank{rank}")
        self.events: list[dict] = []
        self.first = self.last = -1
        self.error: str | None = None
        self.note: str | None = None
        self._prof = None
        self.done = threading.Event()

    def begin(self, step: int) -> None:
        """Called at the boundary before ``step``, the first captured step."""
        self.first, self.last = step, step + self.steps - 1
        if self.use_profiler and "mindspore" in sys.modules:
            try:
                os.makedirs(self.dir, exist_ok=True)
                self._prof = _start_mindspore_profiler(self.dir, self.steps, self.analyse)
            except Exception as exc:  # a profiler already running, no permission, ...
                self.error = f"MindSpore profiler did not start: {type(exc).__name__}: {exc}"
                log.warning("ms-monitor: %s", self.error)
        elif self.use_profiler:
            self.note = "MindSpore is not loaded in this process: agent ranges only"

    def add(self, name: str, cat: str, start_ns: int, dur_s: float, step: int, tid: int = 0) -> None:
        self.events.append(
            {
                "ph": "X",
                "name": name,
                "cat": cat,
                "ts": start_ns / 1e3,
                "dur": dur_s * 1e6,
                "pid": "ms-monitor",
                "tid": tid,
                "args": {"step": step},
            }
        )

    def end_step(self, step: int) -> bool:
        """Called after each captured step; True when the capture is over (the upload has started)."""
        if step < self.last:
            if self._prof is not None:
                try:
                    self._prof.step()
                except Exception as exc:
                    self.error = f"MindSpore profiler step failed: {type(exc).__name__}: {exc}"
            return False
        if self._prof is not None:
            try:
                _finish_mindspore_profiler(self._prof)
            except Exception as exc:
                self.error = f"MindSpore profiler did not stop cleanly: {type(exc).__name__}: {exc}"
        self.last = step
        threading.Thread(target=self._upload, name="ms-monitor-trace-upload", daemon=True).start()
        return True

    def _upload(self) -> None:
        sources = []
        try:
            files = collect_mindspore_files(self.dir, self.analyse) if self._prof is not None else []
            if self._prof is not None and not files and self.error is None:
                self.error = f"MindSpore wrote no trace files under {self.dir}"
            meta = [
                {"ph": "M", "name": "process_name", "pid": "ms-monitor", "args": {"name": "ms-monitor agent"}},
                {"ph": "M", "name": "thread_name", "pid": "ms-monitor", "tid": 0, "args": {"name": "ranges"}},
                {"ph": "M", "name": "thread_name", "pid": "ms-monitor", "tid": 1, "args": {"name": "steps"}},
            ]
            blobs = [("agent_ranges.json", json.dumps(meta + self.events).encode())]
            for name, path in files:
                if os.path.getsize(path) > MAX_FILE:
                    self.error = f"{path} is larger than {MAX_FILE} bytes; not sent"
                    continue
                blobs.append((name, Path(path).read_bytes()))
            for name, data in blobs:
                self._send_file(name, data)
                sources.append(name)
        except Exception as exc:  # report, never raise in a background thread
            self.error = f"trace upload failed: {type(exc).__name__}: {exc}"
        msg = {
            "t": "tdone",
            "id": self.id,
            "rank": self.rank,
            "first": self.first,
            "last": self.last,
            "sources": sources,
        }
        if self.error:
            msg["error"] = self.error[:4000]
        if self.note:
            msg["note"] = self.note[:4000]
        self.send(msg)
        self.done.set()

    def _send_file(self, name: str, data: bytes) -> None:
        chunks = [data[i : i + wire.CHUNK] for i in range(0, len(data), wire.CHUNK)] or [b""]
        for seq, chunk in enumerate(chunks):
            self.send(
                {
                    "t": "tfile",
                    "id": self.id,
                    "rank": self.rank,
                    "name": name,
                    "seq": seq,
                    "last": seq == len(chunks) - 1,
                    "data": chunk,
                }
            )
