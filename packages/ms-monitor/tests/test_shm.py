"""Stale shared-memory segments: a kill -9'd holder's segment goes at the next sweep, a live one's stays."""

import os
import subprocess
import sys
import textwrap
import uuid

import pytest
from conftest import wait_for

from ms_monitor import Daemon, DaemonConfig, shm

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.path.isdir("/proc"), reason="Linux only")

# as MindSpore's creating rank does: create the segment, map it, keep it mapped (no resource tracker)
HOLDER = textwrap.dedent(
    """
    import mmap, os, sys, time
    fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    buf = mmap.mmap(fd, 4096)
    os.close(fd)
    buf[:5] = b"hello"
    print("ready", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def segments():
    """Two segments under a prefix of this test only, each held by a process: (prefix, [(path, proc)])."""
    prefix = f"msmon-test-{uuid.uuid4().hex[:8]}-"
    held = []
    try:
        for name in ("killed", "live"):
            path = os.path.join("/dev/shm", prefix + name)
            proc = subprocess.Popen([sys.executable, "-c", HOLDER, path], stdout=subprocess.PIPE, text=True)
            assert proc.stdout.readline().strip() == "ready"
            held.append((path, proc))
        yield prefix, held
    finally:
        for path, proc in held:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if os.path.exists(path):
                os.unlink(path)


def test_a_killed_holders_segment_is_stale_and_a_live_ones_is_not(segments):
    prefix, [(killed, kproc), (live, _)] = segments
    assert shm.stale_segments((prefix,), min_age=0) == []  # both mapped
    kproc.kill()  # SIGKILL: no cleanup runs
    kproc.wait()
    assert os.path.exists(killed)
    assert shm.stale_segments((prefix,), min_age=3600) == []  # too young to judge
    assert shm.clean_stale_segments((prefix,), min_age=0) == [killed]
    assert not os.path.exists(killed) and os.path.exists(live)
    assert shm.clean_stale_segments((prefix,), min_age=0) == []  # the live one stays, sweep after sweep
    assert os.path.exists(live)


def test_the_daemon_removes_a_killed_jobs_segment_when_it_starts_and_while_it_runs(segments, tmp_path, monkeypatch):
    prefix, [(killed, kproc), (live, lproc)] = segments
    monkeypatch.setattr(shm, "PREFIXES", (prefix,))
    monkeypatch.setattr(shm, "MIN_AGE", 0.0)
    kproc.kill()
    kproc.wait()
    d = Daemon(DaemonConfig(port=0, http_port=None, trace_dir=str(tmp_path / "t")))
    d.start_in_thread()
    try:
        assert not os.path.exists(killed)  # removed before the daemon took its first agent
        assert os.path.exists(live)
        lproc.kill()  # the live job is killed while the daemon runs: the next sweep removes its segment
        lproc.wait()
        wait_for(lambda: not os.path.exists(live), timeout=10, what="the periodic sweep")
    finally:
        d.stop()


def test_keep_stale_shm_turns_the_sweep_off(segments, tmp_path, monkeypatch):
    prefix, [(killed, kproc), _] = segments
    monkeypatch.setattr(shm, "PREFIXES", (prefix,))
    monkeypatch.setattr(shm, "MIN_AGE", 0.0)
    kproc.kill()
    kproc.wait()
    d = Daemon(DaemonConfig(port=0, http_port=None, trace_dir=str(tmp_path / "t"), clean_shm=False))
    d.start_in_thread()
    d.stop()
    assert os.path.exists(killed)
