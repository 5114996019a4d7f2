"""The node daemon: receives samples from local ranks, detects, exports, and runs trace jobs.

One asyncio loop serves the agent protocol (loopback TCP and/or a Unix socket, see ``wire.py``)
and, when ``forward`` is set, a client connection to a cluster aggregator (another daemon): every
validated sample batch is relayed up through a bounded queue (dropped and counted when the
aggregator is slow), and trace commands from the aggregator are run here as local jobs whose files
go back up. An HTTP server (``http_api.py``) runs in a thread beside the loop and reads the store.

Security: listeners default to 127.0.0.1; binding anything else requires a token, which agents
send in their hello and HTTP clients in ``Authorization: Bearer`` for commands that change a
process (trace). Every message is validated against its schema; nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import wire
from .capture import default_trace_root
from .detect import DetectorConfig
from .errors import FrameError, MonitorError, WireError
from .exporters import JsonlWriter, TensorBoardWriter
from .relay import Relay, read_message
from .store import Store
from .traces import DYNO_POLL, TraceJob, TraceManager, choose_start, dyno_config

log = logging.getLogger("ms_monitor.daemon")
#: seconds ahead of the ranks' newest step at which an agent trace starts (commands arrive within ~0.1 s)
AGENT_LEAD = 0.25


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a listener on this machine ("" and 0.0.0.0 mean every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class DaemonConfig:
    """Where the daemon listens and what it exports."""

    host: str = "127.0.0.1"
    """host of the agent TCP listener"""
    port: int | None = 7781
    """agent TCP port (0: any free port, None: no TCP listener)"""
    unix: str | None = None
    """path of a Unix socket for agents (mode 0600)"""
    http_host: str = "127.0.0.1"
    """host of the HTTP server (dashboard, /metrics, API)"""
    http_port: int | None = 7780
    """HTTP port (0: any free port, None: no HTTP server)"""
    token: str | None = None
    """shared secret; required when any listener is beyond loopback"""
    forward: str | None = None
    """address of a cluster aggregator to relay samples to (``tcp:host:port``)"""
    trace_dir: str = field(default_factory=default_trace_root)
    """where trace jobs write their merged traces"""
    jsonl: str | None = None
    """append every sample and alert as a JSON line to this file"""
    tensorboard: str | None = None
    """write TensorBoard scalars under this directory"""
    window: int = 600
    """samples kept per rank"""
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    """detector thresholds"""
    trace_timeout: float = 180.0
    """seconds after which a trace job finishes with whatever arrived"""

    def check(self) -> None:
        exposed = [
            h
            for h, p in ((self.host, self.port), (self.http_host, self.http_port))
            if p is not None and not is_loopback(h)
        ]
        if exposed and not self.token:
            raise MonitorError(f"listening on {exposed} (beyond loopback) needs a token (--token or MS_MONITOR_TOKEN)")
        if self.port is None and self.unix is None:
            raise MonitorError("the daemon needs an agent listener: a TCP port or a Unix socket path")
        if self.forward:
            wire.parse_address(self.forward)


class Conn:
    """One open agent, dyno or relay connection."""

    def __init__(self, writer: asyncio.StreamWriter, hello: dict):
        self.writer = writer
        self.role: str = hello["role"]
        self.rank: int = hello["rank"]
        self.host: str = hello.get("host", "")
        self.poll: bool = hello.get("poll", True)  # a dyno connection that takes configs
        self.ranks: set[int] = set() if self.role == "relay" else {self.rank}

    def send(self, msg: dict) -> None:
        if not self.writer.is_closing():
            self.writer.write(wire.encode(msg))


class Daemon:
    """See the module docstring. ``start_in_thread()`` for tests and embedding, ``run()`` for the CLI."""

    def __init__(self, config: DaemonConfig | None = None):
        self.config = config or DaemonConfig()
        self.config.check()
        self.store = Store(self.config.window, self.config.detector)
        self.conns: set[Conn] = set()
        self.relay = Relay(self) if self.config.forward else None
        self.traces = TraceManager(self.config.trace_dir, forward=self.relay.put if self.relay else None)
        self.jsonl = JsonlWriter(self.config.jsonl) if self.config.jsonl else None
        self.tensorboard = TensorBoardWriter(self.config.tensorboard) if self.config.tensorboard else None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.agent_addrs: list[str] = []
        self.http_url: str | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._http: Any = None
        self._stopped: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._handlers: set[asyncio.Task] = set()

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        cfg = self.config
        if cfg.port is not None:
            srv = await asyncio.start_server(self._handle, cfg.host, cfg.port, reuse_address=True)
            self._servers.append(srv)
            host, port = srv.sockets[0].getsockname()[:2]
            self.agent_addrs.append(f"tcp:{host}:{port}")
        if cfg.unix:
            if os.path.exists(cfg.unix):
                os.unlink(cfg.unix)  # a stale socket of a killed daemon
            srv = await asyncio.start_unix_server(self._handle, cfg.unix)
            os.chmod(cfg.unix, 0o600)
            self._servers.append(srv)
            self.agent_addrs.append(f"unix:{cfg.unix}")
        if cfg.http_port is not None:
            from .http_api import start_http

            self._http = start_http(self, cfg.http_host, cfg.http_port)
            self.http_url = f"http://{cfg.http_host}:{self._http.server_address[1]}"
        self._tasks = [asyncio.ensure_future(self._tick())]
        if self.relay is not None:
            self._tasks.append(asyncio.ensure_future(self.relay.run()))
        log.info("ms-monitor daemon: agents at %s, http at %s", self.agent_addrs, self.http_url)

    async def serve(self) -> None:
        await self.start()
        assert self._stopped is not None
        await self._stopped.wait()
        await self._shutdown()

    def run(self) -> None:
        asyncio.run(self.serve())

    def start_in_thread(self, timeout: float = 10.0) -> Daemon:
        ready = threading.Event()

        async def main() -> None:
            await self.start()
            ready.set()
            assert self._stopped is not None
            await self._stopped.wait()
            await self._shutdown()

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), name="ms-monitor-daemon", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise MonitorError("the daemon did not start")
        return self

    def stop(self) -> None:
        if self.loop is not None and self._stopped is not None:
            self.loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(10)

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for srv in self._servers:
            srv.close()
        for conn in list(self.conns):
            conn.writer.close()
        if self._handlers:  # let the handlers see the closed connections and end on their own
            await asyncio.wait(self._handlers, timeout=2.0)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        for w in (self.jsonl, self.tensorboard):
            if w is not None:
                w.close()
        if self.config.unix and os.path.exists(self.config.unix):
            os.unlink(self.config.unix)

    async def _tick(self) -> None:
        last_flush = time.monotonic()
        while True:
            await asyncio.sleep(0.5)
            try:
                self.traces.tick()
                if time.monotonic() - last_flush > 5:
                    for w in (self.jsonl, self.tensorboard):
                        if w is not None:
                            w.flush()
                    last_flush = time.monotonic()
            except Exception:
                log.exception("ms-monitor daemon: periodic work failed")

    # -- agent connections -----------------------------------------------------------------------
    async def _read(self, reader: asyncio.StreamReader) -> dict:
        return await read_message(reader)

    def _authorized(self, hello: dict, writer: asyncio.StreamWriter) -> bool:
        if not self.config.token:
            return True
        return hmac.compare_digest(hello.get("token", ""), self.config.token)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = None
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        try:
            hello = await asyncio.wait_for(self._read(reader), 10.0)
            if hello["t"] != "hello":
                raise WireError(f"first message must be hello, got {hello['t']!r}")
            if not self._authorized(hello, writer):
                writer.write(wire.encode({"t": "error", "msg": "bad or missing token"}))
                await writer.drain()
                return
            conn = Conn(writer, hello)
            self.conns.add(conn)
            if conn.role != "relay":
                self.store.connected(conn.rank, hello)
            writer.write(wire.encode({"t": "welcome", "v": wire.PROTOCOL_VERSION}))
            await writer.drain()
            while True:
                try:
                    msg = await self._read(reader)
                except FrameError:
                    raise  # the stream cannot be resynchronized: close
                except WireError as exc:
                    self.store.count_invalid()
                    log.warning("ms-monitor daemon: invalid message from %s rank %d: %s", conn.role, conn.rank, exc)
                    continue
                self._dispatch(conn, msg)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass
        except WireError as exc:
            self.store.count_invalid()
            log.warning("ms-monitor daemon: closing a connection: %s", exc)
        finally:
            if conn is not None:
                self.conns.discard(conn)
                gone = {r for r in conn.ranks if not any(r in c.ranks for c in self.conns)}
                for rank in gone:
                    self.store.connected(rank, {}, up=False)
                if conn.role != "dyno":
                    self.traces.ranks_lost(gone)
            writer.close()

    def _dispatch(self, conn: Conn, msg: dict) -> None:
        kind = msg["t"]
        if kind == "b":
            samples = msg["s"]
            if conn.role == "agent":
                samples = [s for s in samples if s["r"] == conn.rank]  # an agent speaks for its own rank only
            elif conn.role == "relay":
                for s in samples:
                    if s["r"] not in conn.ranks:
                        conn.ranks.add(s["r"])
                        self.store.connected(s["r"], {"host": conn.host, "role": "relay"})
            alerts = self.store.add(samples)
            self._export(samples, alerts)
            if self.relay is not None and samples:
                self.relay.put({"t": "b", "s": samples})
        elif kind == "dstat":
            self.store.dyno_status(msg)
        elif kind == "npumon":
            log.info("ms-monitor daemon: rank %d npu-monitor config %s", msg["rank"], msg["cfg"])
        elif kind == "tfile":
            self.traces.on_tfile(msg)
        elif kind == "tdone":
            self.traces.on_tdone(msg)

    def _export(self, samples: list[dict], events: list[dict]) -> None:
        for e in events:
            raised = e["event"] == "raised"
            (log.warning if raised else log.info)("ms-monitor alert%s: %s", "" if raised else " resolved", e["message"])
        if self.jsonl is not None:
            for s in samples:
                self.jsonl.write({"type": "sample", **s})
            for e in events:
                self.jsonl.write({"type": "alert", **e})
        if self.tensorboard is not None:
            for s in samples:
                self.tensorboard.write(s)

    # -- traces ------------------------------------------------------------------------------------
    def request_trace(self, req: dict, timeout: float = 10.0) -> dict:
        """Thread-safe entry (HTTP): start a trace job; returns its summary or raises MonitorError."""
        if self.loop is None:
            raise MonitorError("the daemon is not running")
        fut = asyncio.run_coroutine_threadsafe(self._trace(req), self.loop)
        return fut.result(timeout)

    def on_loop(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` on the daemon's event loop and return its result (for the HTTP threads)."""
        if self.loop is None:
            raise MonitorError("the daemon is not running")

        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)

    def trace_status(self, job_id: str) -> dict | None:
        job = self.traces.jobs.get(job_id)
        return None if job is None else job.summary()

    async def _trace(self, req: dict, job_id: str | None = None, upstream: bool = False) -> dict:
        ranks = req.get("ranks")
        if ranks is not None and (not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks)):
            raise MonitorError(f"ranks={ranks!r} must be a list of integers")
        steps = req.get("steps")
        want = (lambda r: True) if ranks is None else (lambda r: r in ranks)
        # one agent per rank (the newest connection, if a rank reconnected before its old socket closed)
        agents = list({c.rank: c for c in self.conns if c.role == "agent" and want(c.rank)}.values())
        relays = {c: sorted(r for r in c.ranks if want(r)) for c in self.conns if c.role == "relay"}
        relays = {c: rs for c, rs in relays.items() if rs}
        served = {c.rank for c in agents} | {r for rs in relays.values() for r in rs}
        dynos = [c for c in self.conns if c.role == "dyno" and c.poll] if ranks is None or set(ranks) - served else []
        if not agents and not relays and not dynos:
            raise MonitorError(f"no connected rank matches ranks={ranks}")
        timeout = req.get("timeout") or self.config.trace_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise MonitorError(f"timeout={timeout!r} must be a number of seconds in (0, 86400]")
        start = req.get("start_step")
        if start is None:
            start = self._choose_start(served, [c.rank for c in dynos])
        job = self.traces.new_job(start, steps, ranks, float(timeout), job_id=job_id, upstream=upstream)
        analyse = req.get("analyse")  # default: agents analyse (asynchronously), dyno does not (it would block)
        cmd = {
            "t": "trace",
            "id": job.id,
            "start": start,
            "steps": steps,
            "profiler": bool(req.get("profiler", True)),
            "analyse": True if analyse is None else bool(analyse),
        }
        for c in agents:
            c.send(cmd)
        for c, rs in relays.items():
            c.send({**cmd, "ranks": rs})
        if dynos:
            cfg = dyno_config(start, steps, os.path.abspath(os.path.join(job.out_dir, "dyno")), bool(analyse))
            for c in dynos:
                c.send({"t": "cfg", "id": job.id, "cfg": cfg})
        job.expected, job.dyno_ranks = served, sorted(c.rank for c in dynos)
        job.missing = [] if ranks is None or dynos else sorted(set(ranks) - served)
        log.info(
            "ms-monitor daemon: trace %s of steps %d..%d on ranks %s (dyno %s)",
            job.id,
            start,
            start + steps - 1,
            sorted(served),
            job.dyno_ranks,
        )
        return job.summary()

    def _choose_start(self, agent_ranks: set[int], dyno_ranks: list[int]) -> int:
        ranks = {r["rank"]: r for r in self.store.status()["ranks"]}
        starts = []
        if agent_ranks:
            rows = [ranks[r] for r in agent_ranks if r in ranks]
            times = [r.get("step_time_median") for r in rows]
            starts.append(choose_start([r["last_step"] for r in rows], times, AGENT_LEAD))
        if dyno_ranks:
            rows = [ranks[r] for r in dyno_ranks if r in ranks and ranks[r]["last_step"] >= 0]
            starts.append(
                choose_start(
                    [r["last_step"] for r in rows], [r.get("seconds_per_step") for r in rows], DYNO_POLL, min_lead=3
                )
            )
        return max(starts)


__all__ = ["Daemon", "DaemonConfig", "TraceJob"]
