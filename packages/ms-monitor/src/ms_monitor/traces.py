"""Trace jobs on the daemon: command the ranks, gather their files, merge them into one trace.

A job targets ranks through three kinds of connection:

* ms-monitor agents get a ``trace`` command and later upload their files (``tfile``/``tdone``);
* node daemons relaying to this one (``relay``) get the same command with the rank list, run it as
  their own job and forward their agents' files up;
* MindSpore's own hook (``dyno``, the IPCMonitor proxy) gets a msMonitor config string
  (``PROFILE_START_STEP``, ``ACTIVITIES_ITERATIONS``, ``ACTIVITIES_LOG_FILE``...) that MindSpore's
  ``DynamicProfilerMonitor`` turns into a profiler run; it writes under the log directory on this
  node (``rank<R>_start<S>_stop<E>/*_ascend_ms``), which the daemon reads itself once the files
  stop changing. MindSpore polls with one process per node and every rank of the node reads the
  config, so a job for some ranks names them in it (``MS_MONITOR_RANKS``) and each rank's gate
  (``dyno.install_rank_gate``) drops a config that is not for it; the output of a rank without the
  gate that captured anyway is left out of the merge, with a note in the job's errors.

All methods run on the daemon's event loop.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ms_layout.files import atomic_write, clean_stale, read_capped, write_manifest
from ms_layout.limits import Limit

from .clock import Offset
from .dyno import RANKS_KEY, format_ranks
from .errors import MonitorError
from .trace_merge import events_from_cpu_timestamps, events_from_trace_view, merge

log = logging.getLogger("ms_monitor.daemon")

MAX_JOB_BYTES = Limit("MS_MONITOR_MAX_TRACE_BYTES", 512 * 1024 * 1024, "bytes of trace data in one job")
MAX_JOBS = 50
MAX_STEP = 2**53
_JOB_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")  # a folder name: no "..", no hidden names
#: seconds of a dyno poll cycle assumed when choosing a start step (MindSpore's default poll_interval is 2)
DYNO_POLL = 3.0
#: seconds ahead of the ranks' newest step at which an agent trace starts (commands arrive within ~0.1 s)
AGENT_LEAD = 0.25
_RANK_DIR = re.compile(r"rank(-?\d+)_start(\d+)_stop(\d+)$")


@dataclass
class TraceJob:
    """One on-demand capture across ranks."""

    id: str
    """job id (also the folder name)"""
    start: int
    """first captured step"""
    steps: int
    """number of captured steps"""
    ranks: list[int] | None
    """ranks asked for (None: every rank)"""
    out_dir: str
    """where the merged trace and the dyno log directory go"""
    deadline: float
    """monotonic time after which the job finishes with what it has"""
    expected: set[int] = field(default_factory=set)
    """agent ranks (direct or behind relays) that were sent the command"""
    missing: list[int] = field(default_factory=list)
    """requested ranks that no connection serves"""
    dyno_ranks: list[int] = field(default_factory=list)
    """ranks of the dyno connections that got the config"""
    dyno_select: list[int] | None = None
    """ranks the dyno config is for (None: every rank of the nodes)"""
    done: dict[int, dict] = field(default_factory=dict)
    """rank -> its tdone message"""
    files: dict[int, dict[str, bytearray]] = field(default_factory=dict)
    """rank -> file name -> bytes"""
    upstream: bool = False
    """a relay's job: files go up to the aggregator, nothing is merged here"""
    state: str = "running"
    """running, done or failed"""
    path: str | None = None
    """the merged Chrome trace, once done"""
    errors: dict[str, str] = field(default_factory=dict)
    """rank (as text) -> what went wrong"""
    dyno_seen: dict[str, tuple] = field(default_factory=dict)
    """dyno files -> (size, mtime) at the previous look, to tell when they stop changing"""
    dyno_stable_since: float | None = None
    """when the dyno files last changed"""
    dyno_gathered: bool = False
    """whether the dyno files have been read"""
    bytes: int = 0
    """trace bytes received so far"""
    next_seq: dict[tuple, int] = field(default_factory=dict)
    """(rank, file name) -> the chunk number expected next"""

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "state": self.state,
            "start_step": self.start,
            "steps": self.steps,
            "ranks": self.ranks,
            "expected": sorted(self.expected),
            "done": sorted(self.done),
            "missing": self.missing,
            "dyno_ranks": self.dyno_ranks,
            "dyno_select": self.dyno_select,
            "errors": self.errors,
            "path": self.path,
            "sources": {str(r): d.get("sources", []) for r, d in self.done.items()},
            "notes": {str(r): d["note"] for r, d in self.done.items() if d.get("note")},
        }


def dyno_config(start: int, steps: int, log_dir: str, analyse: bool, ranks: list[int] | None = None) -> str:
    """The msMonitor ``nputrace`` config string that MindSpore's dyno path understands; with
    ``ranks``, a ``MS_MONITOR_RANKS`` line that only those ranks act on (``dyno.install_rank_gate``)."""
    lines = {
        "PROFILE_START_STEP": start,
        "ACTIVITIES_ITERATIONS": steps,
        "ACTIVITIES_LOG_FILE": log_dir,
        "PROFILE_ACTIVITIES": "CPU",
        "PROFILE_PROFILER_LEVEL": "Level0",
        "PROFILE_ANALYSE": "true" if analyse else "false",
        "PROFILE_EXPORT_TYPE": "Text",
    }
    if ranks is not None:
        lines[RANKS_KEY] = format_ranks(ranks)
    return "\n".join(f"{k}={v}" for k, v in lines.items())


def choose_start(last_steps: list[int], step_times: list[float], lead_seconds: float, min_lead: int = 2) -> int:
    """A step far enough ahead that every rank will see the command before reaching it."""
    if not last_steps:
        raise MonitorError("no rank has reported a step yet: give --start-step")
    st = [t for t in step_times if t and t > 0]
    per = max(st) if st else 1.0
    return max(last_steps) + max(min_lead, math.ceil(lead_seconds / per) + 1)


def start_step(ranks: dict[int, dict], agent_ranks: set[int], dyno_ranks: list[int]) -> int:
    """The first step of a trace of these agent and dyno ranks, from their rank summaries (``ranks``)."""
    starts = []
    if agent_ranks:
        rows = [ranks[r] for r in agent_ranks if r in ranks]
        times = [r.get("step_time_median") for r in rows]
        starts.append(choose_start([r["last_step"] for r in rows], times, AGENT_LEAD))
    if dyno_ranks:
        rows = [ranks[r] for r in dyno_ranks if r in ranks and ranks[r]["last_step"] >= 0]
        per_step = [r.get("seconds_per_step") for r in rows]
        starts.append(choose_start([r["last_step"] for r in rows], per_step, DYNO_POLL, min_lead=3))
    return max(starts)


MERGED = "merged_trace.json"


def write_merged(out_dir: str, doc: dict, extra: dict) -> None:
    """The merged trace and then its manifest (sizes, sha256), each written atomically: a folder
    whose manifest verifies (``ms_layout.files.verify_manifest``) holds a whole trace."""
    clean_stale(out_dir)
    atomic_write(os.path.join(out_dir, MERGED), json.dumps(doc).encode())
    write_manifest(out_dir, [MERGED], {"file": MERGED, **extra})


class TraceManager:
    """The daemon's trace jobs; ``forward`` sends a message up to the aggregator (relays only);
    ``offset_of(rank)`` is the rank's clock offset against this daemon (``clock.py``), or None."""

    def __init__(
        self,
        root: str,
        forward: Callable[[dict], None] | None = None,
        offset_of: Callable[[int], Offset | None] | None = None,
    ):
        self.root = root
        self.forward = forward
        self.offset_of = offset_of or (lambda rank: None)
        self.jobs: dict[str, TraceJob] = {}
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # half-written traces of a daemon that was killed
            if os.path.isdir(os.path.join(root, name)):
                clean_stale(os.path.join(root, name))

    def new_job(
        self,
        start: int,
        steps: int,
        ranks: list[int] | None,
        timeout: float,
        job_id: str | None = None,
        upstream: bool = False,
    ) -> TraceJob:
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 100000:
            raise MonitorError(f"steps={steps!r} must be an integer in 1..100000")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= MAX_STEP:
            raise MonitorError(f"start_step={start!r} must be an integer in 0..{MAX_STEP}")
        job_id = job_id or time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id) or job_id in self.jobs:
            raise MonitorError(f"trace id {job_id!r} is malformed or already used")
        out_dir = os.path.join(self.root, job_id)
        os.makedirs(out_dir, exist_ok=True)
        job = TraceJob(job_id, start, steps, ranks, out_dir, time.monotonic() + timeout, upstream=upstream)
        self.jobs[job_id] = job
        while len(self.jobs) > MAX_JOBS:
            self.jobs.pop(next(iter(self.jobs)))
        return job

    def on_tfile(self, msg: dict) -> None:
        job = self.jobs.get(msg["id"])
        if job is None or job.state != "running":
            return
        job.bytes += len(msg["data"])
        if job.bytes > MAX_JOB_BYTES.value:
            job.errors[str(msg["rank"])] = (
                f"trace data above {MAX_JOB_BYTES.value} bytes (raise it with {MAX_JOB_BYTES.env}=N); dropped"
            )
            return
        files = job.files.setdefault(msg["rank"], {})
        buf = files.setdefault(msg["name"], bytearray())
        key = (msg["rank"], msg["name"])
        if msg["seq"] != job.next_seq.get(key, 0):  # chunks of one file arrive in order on one connection
            job.errors[str(msg["rank"])] = f"{msg['name']}: chunk {msg['seq']} out of order; file dropped"
            files.pop(msg["name"], None)
            return
        job.next_seq[key] = msg["seq"] + 1
        buf.extend(msg["data"])
        if job.upstream and self.forward:
            self.forward(msg)

    def on_tdone(self, msg: dict) -> None:
        job = self.jobs.get(msg["id"])
        if job is None or job.state != "running":
            return
        job.done[msg["rank"]] = msg
        if msg.get("error"):
            job.errors[str(msg["rank"])] = msg["error"]
        if job.upstream and self.forward:
            self.forward(self._with_clock(msg))
        self.check(job)

    def ranks_lost(self, ranks: set[int]) -> None:
        """Connections of these ranks closed: running jobs stop waiting for their files."""
        for job in self.jobs.values():
            lost = (job.expected & ranks) - set(job.done)
            if job.state == "running" and lost:
                for rank in lost:
                    job.errors[str(rank)] = "the rank disconnected before its trace arrived"
                job.expected -= lost
                self.check(job)

    def check(self, job: TraceJob) -> None:
        """Finish the job when every expected rank is in, or at its deadline."""
        if job.state != "running":
            return
        dyno_ready = not job.dyno_ranks or self._gather_dyno(job)
        timed_out = time.monotonic() > job.deadline
        if (job.expected <= set(job.done) and dyno_ready) or timed_out:
            if timed_out:
                for rank in sorted(job.expected - set(job.done)):
                    job.errors.setdefault(str(rank), "no trace arrived before the deadline")
                if job.dyno_ranks and not dyno_ready:
                    self._gather_dyno(job, final=True)
            self._finish(job)

    def tick(self) -> None:
        for job in list(self.jobs.values()):
            self.check(job)

    def _gather_dyno(self, job: TraceJob, final: bool = False) -> bool:
        """Read MindSpore's dyno-path output once it has stopped changing for 2 seconds."""
        if job.dyno_gathered:
            return True
        log_dir = os.path.join(job.out_dir, "dyno")
        patterns = ("**/ASCEND_PROFILER_OUTPUT/trace_view.json", "**/FRAMEWORK/cpu_op_execute_timestamp_*.txt")
        found = sorted(p for pat in patterns for p in glob.glob(os.path.join(log_dir, pat), recursive=True))
        seen = {p: (os.path.getsize(p), os.path.getmtime(p)) for p in found if os.path.exists(p)}
        now = time.monotonic()
        if seen != job.dyno_seen or not seen:
            job.dyno_seen, job.dyno_stable_since = seen, now
            if not final:
                return False
        elif now - (job.dyno_stable_since or now) < 2.0 and not final:
            return False
        gathered: dict[int, dict[str, bytes]] = {}
        for path in seen:
            m = _RANK_DIR.match(os.path.relpath(path, log_dir).split(os.sep)[0])
            if m and job.dyno_select is not None and int(m.group(1)) not in job.dyno_select:
                job.errors[m.group(1)] = (
                    f"rank {m.group(1)} captured although the trace was for ranks {format_ranks(job.dyno_select)}: "
                    "its process lacks ms-monitor's rank gate (import IPCMonitor in the script); left out"
                )
                continue
            if m:
                data = read_capped(path, MAX_JOB_BYTES.value, "dyno trace file")
                gathered.setdefault(int(m.group(1)), {})[os.path.basename(path)] = data
        for rank, files in gathered.items():
            job.files.setdefault(rank, {}).update({n: bytearray(d) for n, d in files.items()})
            job.done.setdefault(rank, {"rank": rank, "sources": []})["sources"].extend(sorted(files))
            if job.upstream and self.forward:  # a relay hands the node's dyno files up as agents would
                for name, data in files.items():
                    self._forward_file(job.id, rank, name, data)
                self.forward(
                    self._with_clock(
                        {
                            "t": "tdone",
                            "id": job.id,
                            "rank": rank,
                            "first": job.start,
                            "last": job.start + job.steps - 1,
                            "sources": sorted(files),
                        }
                    )
                )
        job.dyno_gathered = True
        return True

    def _with_clock(self, msg: dict) -> dict:
        """A relay's tdone carries the rank's clock offset against the relay, for the aggregator to add to its own."""
        off = self.offset_of(msg["rank"])
        return msg if off is None else {**msg, "clk": off.offset, "clke": off.error}

    def _forward_file(self, job_id: str, rank: int, name: str, data: bytes) -> None:
        assert self.forward is not None
        chunks = [data[i : i + 1024 * 1024] for i in range(0, len(data), 1024 * 1024)] or [b""]
        for seq, chunk in enumerate(chunks):
            self.forward(
                {
                    "t": "tfile",
                    "id": job_id,
                    "rank": rank,
                    "name": name,
                    "seq": seq,
                    "last": seq == len(chunks) - 1,
                    "data": chunk,
                }
            )

    def _rank_events(self, rank: int, files: dict[str, bytearray]) -> list[tuple[str, list[dict]]]:
        out = []
        analysed = "trace_view.json" in files  # holds the same ops as the raw files, and more
        for name in sorted(files):
            if analysed and name.startswith("cpu_op_execute_timestamp"):
                continue
            data = bytes(files[name])
            try:
                if name == "trace_view.json":
                    out.append(("mindspore", events_from_trace_view(data, f"rank {rank} {name}")))
                elif name.startswith("cpu_op_execute_timestamp"):
                    out.append(
                        ("mindspore-framework", events_from_cpu_timestamps(data.decode(), f"rank {rank} {name}"))
                    )
                elif name == "agent_ranges.json":
                    out.append(("ms-monitor", events_from_trace_view(data, f"rank {rank} {name}")))
            except (MonitorError, UnicodeDecodeError) as exc:
                log.warning("ms-monitor: skipping %s of rank %d: %s", name, rank, exc)
        return out

    def _finish(self, job: TraceJob) -> None:
        if job.upstream:
            job.state = "done"
            return
        per_rank = {rank: self._rank_events(rank, files) for rank, files in job.files.items()}
        per_rank = {r: evs for r, evs in per_rank.items() if evs}
        if not per_rank:
            job.state = "failed"
            job.errors.setdefault("all", "no rank sent any trace data")
            return
        clocks = {rank: self.offset_of(rank) for rank in per_rank}
        doc = merge(
            per_rank,
            {
                "ms_monitor_trace_id": job.id,
                "start_step": job.start,
                "steps": job.steps,
                "errors": job.errors,
                # what the merge aligned each lane by; null: not measured, left on its own clock
                "clock": {str(r): None if o is None else o.as_dict() for r, o in clocks.items()},
            },
            offsets={r: o.offset for r, o in clocks.items() if o is not None},
        )
        write_merged(job.out_dir, doc, {"ranks": sorted(per_rank), "trace": job.summary()})
        job.path, job.state = os.path.join(job.out_dir, MERGED), "done"
        log.info("ms-monitor: trace %s merged for ranks %s -> %s", job.id, sorted(per_rank), job.path)
