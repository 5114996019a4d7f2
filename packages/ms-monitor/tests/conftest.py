"""Shared helpers: an in-process daemon and ranks stepping in threads."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
import urllib.request

import pytest

from ms_monitor import Daemon, DaemonConfig, Monitor
from ms_monitor.auth import STATE_DIR_ENV, token_for_url


@pytest.fixture(autouse=True)
def state_dir(tmp_path_factory, monkeypatch):
    """Daemons write their made tokens here, not in ~/.cache (the CLI in the tests reads them here too)."""
    path = tmp_path_factory.mktemp("state")
    monkeypatch.setenv(STATE_DIR_ENV, str(path))
    monkeypatch.delenv("MS_MONITOR_TOKEN", raising=False)
    return path


def wait_for(cond, timeout=20.0, what="condition"):
    """Poll until cond() is truthy (a liveness wait, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def get_json(url, body=None, token=None, auto_token=True):
    """GET (or POST `body`) as the CLI does: with `token`, else the daemon's token file for a POST."""
    headers = {"Content-Type": "application/json"}
    if token is None and auto_token and body is not None:
        token = token_for_url(url)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=15) as resp:
        return json.loads(resp.read())


def raw_http(port, request, raw=False, timeout=15):
    """Send raw request bytes to 127.0.0.1:port; (status, JSON body or None), or the body bytes if raw."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if raw:
        return body
    return int(head.split(b" ", 2)[1]), (json.loads(body) if body else None)


@pytest.fixture
def sock_dir():
    # Unix socket paths are limited to ~100 bytes: pytest's tmp_path can be too long.
    with tempfile.TemporaryDirectory(prefix="msmon") as d:
        yield d


@pytest.fixture
def daemon(tmp_path, sock_dir):
    d = Daemon(
        DaemonConfig(port=None, unix=os.path.join(sock_dir, "d.sock"), http_port=0, trace_dir=str(tmp_path / "traces"))
    )
    d.start_in_thread()
    yield d
    d.stop()


class Ranks:
    """Monitors of several ranks stepping in background threads (ranges: forward, allreduce)."""

    def __init__(self, addr, ranks=(0, 1), step_s=0.005, slow=None, sync=False, **kw):
        self.monitors = [Monitor(rank=r, world_size=len(ranks), addr=addr, **kw) for r in ranks]
        self.step_s, self.slow = step_s, slow or {}
        # sync: a barrier in the "allreduce" range, so ranks step together as in data parallelism
        self.barrier = threading.Barrier(len(ranks)) if sync else None
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(m,), daemon=True) for m in self.monitors]
        for t in self.threads:
            t.start()

    def _loop(self, mon):
        while not self._stop.is_set():
            with mon.step(tokens=128):
                with mon.range("forward"):
                    time.sleep(self.step_s + self.slow.get(mon.rank, 0.0))
                with mon.range("allreduce", kind="comm"):
                    time.sleep(0.001)
                    if self.barrier is not None:
                        try:
                            self.barrier.wait(timeout=5)
                        except threading.BrokenBarrierError:
                            return

    def close(self):
        self._stop.set()
        if self.barrier is not None:
            self.barrier.abort()
        for t in self.threads:
            t.join(5)
        for m in self.monitors:
            m.close()
