"""The agent side of the connection: a background thread that ships samples and takes commands.

The training thread only appends to a bounded deque (an atomic operation under the GIL, no lock,
no wake-up): when the deque is full the sample is dropped and counted. The shipper thread wakes
every ``flush_interval`` seconds (0.1), packs what is queued into one batch frame, sends it, and reads
any command the daemon sent. When the daemon is slow or gone, samples wait in the deque until it
is full and are then dropped; the thread reconnects with exponential backoff, so a restarted
daemon gets samples again within a few seconds. Nothing here raises into the caller.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections import deque
from typing import Any, Callable

from . import wire
from .errors import WireError

log = logging.getLogger("ms_monitor.agent")

DEFAULT_ADDR = "tcp:127.0.0.1:7781"
ADDR_ENV = "MS_MONITOR_ADDR"
TOKEN_ENV = "MS_MONITOR_TOKEN"
#: control messages (trace uploads, status) waiting while disconnected; beyond this they are dropped
MAX_CONTROL = 512


def connect(addr: str, timeout: float) -> socket.socket:
    """A connected stream socket to ``unix:/path`` or ``tcp:host:port``."""
    kind, where = wire.parse_address(addr)
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in where[0] else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout)
    try:
        sock.connect(where)
    except OSError:
        sock.close()
        raise
    return sock


def read_frame(sock: socket.socket) -> dict:
    """One whole frame from a blocking socket (with its timeout)."""
    header = _read_exact(sock, wire.HEADER.size)
    return wire.decode(_read_exact(sock, wire.frame_length(header)))


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the daemon closed the connection")
        buf += chunk
    return bytes(buf)


class Shipper:
    """Background connection to the node daemon; see the module docstring."""

    def __init__(
        self,
        hello: dict,
        addr: str | None = None,
        on_command: Callable[[dict], None] | None = None,
        queue_size: int = 4096,
        flush_interval: float = 0.1,
        pack: Callable[[Any], dict] | None = None,
        extra: Callable[[], dict] | None = None,
    ):
        self.addr = addr or os.environ.get(ADDR_ENV) or DEFAULT_ADDR
        wire.parse_address(self.addr)  # fail early on a malformed address
        self.hello = {"t": "hello", "v": wire.PROTOCOL_VERSION, "clk": True, **hello}
        token = os.environ.get(TOKEN_ENV)
        if token and "token" not in self.hello:
            self.hello["token"] = token
        self.on_command = on_command
        self.queue_size = queue_size
        self.flush_interval = flush_interval
        self._pack = pack or (lambda item: item)
        self._extra = extra
        self._samples: deque = deque()
        self._control: deque = deque()
        self.dropped = 0
        self.sent = 0
        self.connects = 0
        self.connected = False
        self._sock: socket.socket | None = None
        self._reader = wire.FrameReader()
        self._stop = threading.Event()
        self._backoff = 0.2
        self._next_try = 0.0
        self._thread = threading.Thread(target=self._run, name="ms-monitor-shipper", daemon=True)
        self._thread.start()

    # -- called from the training thread: never blocks, never raises ------------------------
    def put(self, item: Any) -> None:
        if len(self._samples) >= self.queue_size:
            self.dropped += 1
        else:
            self._samples.append(item)

    def send_control(self, msg: dict) -> None:
        """A message that is not a sample (status, trace files); kept while disconnected, bounded."""
        if len(self._control) >= MAX_CONTROL:
            self._control.popleft()
        self._control.append(msg)

    def close(self, timeout: float = 2.0) -> None:
        """Flush what is queued (while connected) and stop the thread."""
        self._stop.set()
        self._thread.join(timeout)

    # -- the shipper thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            try:
                self._ensure_connected()
                self._flush()
                self._poll_commands(0.0 if stopping else self.flush_interval)
            except Exception as exc:  # never let the thread die: log and reconnect later
                log.debug("ms-monitor shipper: %s", exc)
                self._disconnect()
                if not stopping:
                    self._stop.wait(self.flush_interval)
            if stopping:
                self._disconnect()
                return

    def _ensure_connected(self) -> None:
        if self._sock is not None or time.monotonic() < self._next_try:
            return
        try:
            sock = connect(self.addr, timeout=2.0)
            sock.sendall(wire.encode(self.hello))
            reply = read_frame(sock)
        except (OSError, WireError, ConnectionError) as exc:
            self._next_try = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, 5.0)
            if self.connects == 0 and self._backoff >= 1.6:
                log.debug("ms-monitor: daemon at %s not reachable yet (%s)", self.addr, exc)
            return
        if reply["t"] != "welcome":
            log.warning("ms-monitor: daemon at %s refused this agent: %s", self.addr, reply.get("msg"))
            sock.close()
            self._next_try = time.monotonic() + 5.0
            return
        sock.settimeout(2.0)
        self._sock, self._reader = sock, wire.FrameReader()
        self._backoff, self.connects, self.connected = 0.2, self.connects + 1, True
        log.info("ms-monitor: connected to %s", self.addr)

    def _disconnect(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock, self.connected = None, False
        self._next_try = max(self._next_try, time.monotonic() + self._backoff)

    def _flush(self) -> None:
        if self._sock is None:
            return
        while self._samples:
            batch = []
            extra = self._extra() if self._extra else {}
            while self._samples and len(batch) < 512:
                batch.append({**self._pack(self._samples.popleft()), **extra, "dr": self.dropped})
            try:
                # samples come from the agent's own pack function, built to the schema: skip the
                # validation here (the daemon validates everything it receives anyway)
                self._sock.sendall(wire.encode_trusted({"t": "b", "s": batch}))
            except OSError:
                self.dropped += len(batch)  # lost with the connection
                raise
            self.sent += len(batch)
        while self._control:
            msg = self._control[0]
            self._sock.sendall(wire.encode(msg))
            self._control.popleft()

    def _poll_commands(self, timeout: float) -> None:
        if self._sock is None:
            if timeout:
                self._stop.wait(timeout)
            return
        readable, _, _ = select.select([self._sock], [], [], timeout)
        if not readable:
            return
        data = self._sock.recv(65536)
        now = time.time()  # read first: a clock probe's answer must be taken inside its round trip
        if not data:
            raise ConnectionError("the daemon closed the connection")
        for body in self._reader.feed(data):
            msg = wire.decode(body)
            if msg["t"] == "ping":  # answered here, at once, not queued behind samples (see clock.py)
                self._sock.sendall(wire.encode({"t": "pong", "d": msg["d"], "a": now}))
                continue
            if self.on_command is not None:
                try:
                    self.on_command(msg)
                except Exception:
                    log.exception("ms-monitor: command %r failed", msg.get("t"))
