"""Stale shared-memory segments of killed jobs: found by who still maps them, and removed.

MindSpore's hook (``DynamicProfilerMonitor`` with ``MSMONITOR_USE_DAEMON=1``) keeps its config in
``/dev/shm/DynamicProfileShm<YYYYmmddHH>``: the first rank of a node to start creates it and forks
the node's config poller, the others attach. A job killed with ``kill -9`` never unlinks it, and
a job started in the same hour then attaches to the leftover, so no rank forks a poller and the
job cannot be traced (MindSpore only logs "please remove" when the file is over 15 minutes old).

The name is MindSpore's, so it cannot carry its creator's pid; instead a segment counts as stale
when no live process maps it or holds it open (``/proc/<pid>/maps`` and ``/proc/<pid>/fd``): a
killed creator's mapping is gone with it, and a live job always has its segment mapped. Only
segments owned by this user and older than ``MIN_AGE`` seconds (a segment is created, sized and
mapped within microseconds) are removed. The daemon sweeps when it starts and every few seconds.
Without root, processes of other users cannot be inspected; their mappings of this user's
segments (mode 0600: only root could make one) are not seen.
"""

from __future__ import annotations

import glob
import logging
import os
import time

log = logging.getLogger("ms_monitor.shm")

SHM_DIR = "/dev/shm"
#: name prefixes of the segments looked after
PREFIXES = ("DynamicProfileShm",)
#: seconds a segment must have existed (and not been written) before it may be removed
MIN_AGE = 2.0


def _mapped_by(pid: str, paths: set[str]) -> set[str]:
    """Which of ``paths`` process ``pid`` maps or holds open (empty if it is gone or unreadable)."""
    found: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            for line in f:
                if b"/" in line:
                    name = line[line.index(b"/") :].rstrip(b"\n").decode(errors="replace")
                    name = name.removesuffix(" (deleted)")
                    if name in paths:
                        found.add(name)
    except OSError:
        pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target in paths:
                found.add(target)
    except OSError:
        pass
    return found


#: path -> the pid last seen using it: checked first, so a sweep during a live job reads one process
_holders: dict[str, str] = {}


def in_use(paths: set[str]) -> set[str]:
    """Which of ``paths`` some live process (this one included) maps or holds open."""
    used: set[str] = set()
    for path in paths:
        pid = _holders.get(path)
        if pid is not None and path in _mapped_by(pid, {path}):
            used.add(path)
    for pid in os.listdir("/proc"):
        if used == paths:
            break
        if pid.isdigit():
            for path in _mapped_by(pid, paths - used):
                used.add(path)
                _holders[path] = pid
    for path in set(_holders) - used:
        del _holders[path]
    return used


def stale_segments(
    prefixes: tuple[str, ...] | None = None, shm_dir: str | None = None, min_age: float | None = None
) -> list[str]:
    """Segments of this user under ``shm_dir`` named with one of ``prefixes`` that no live process uses."""
    prefixes = PREFIXES if prefixes is None else prefixes
    shm_dir = SHM_DIR if shm_dir is None else shm_dir
    min_age = MIN_AGE if min_age is None else min_age
    now = time.time()
    candidates = set()
    for prefix in prefixes:
        for path in glob.glob(os.path.join(glob.escape(shm_dir), glob.escape(prefix) + "*")):
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if st.st_uid == os.getuid() and os.path.isfile(path) and now - max(st.st_mtime, st.st_ctime) >= min_age:
                candidates.add(path)
    if not candidates:
        return []
    return sorted(candidates - in_use(candidates))


def clean_stale_segments(
    prefixes: tuple[str, ...] | None = None, shm_dir: str | None = None, min_age: float | None = None
) -> list[str]:
    """Remove the stale segments (see the module docstring); returns the paths removed."""
    removed = []
    for path in stale_segments(prefixes, shm_dir, min_age):
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("ms-monitor: could not remove the stale segment %s: %s", path, exc)
            continue
        removed.append(path)
        log.warning("ms-monitor: removed %s, left by a job that was killed (no live process maps it)", path)
    return removed
