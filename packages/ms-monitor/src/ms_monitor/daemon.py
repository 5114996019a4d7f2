"""The node daemon: receives samples from local ranks, detects, exports, and runs trace jobs.

One asyncio loop serves the agent protocol (loopback TCP and/or a Unix socket, see ``wire.py``)
and, when ``forward`` is set, a client connection to a cluster aggregator (another daemon): every
validated sample batch is relayed up through a bounded queue (dropped and counted when the
aggregator is slow), and trace commands from the aggregator are run here as local jobs whose files
go back up. An HTTP server (``http_api.py``) runs in a thread beside the loop and reads the store.
The loop's periodic work (clock probes, trace deadlines, /dev/shm sweeps, flushes) is in
``periodic.py``; a connection's state is a ``Conn`` (``conn.py``).

Security: listeners default to 127.0.0.1; binding anything else requires a token, which agents
then send in their hello. HTTP commands that change a process (trace) always need the token in
``Authorization: Bearer``; a daemon without ``--token`` makes one and writes it to a 0600 file the
CLI reads (``auth.py``). Every message is validated against its schema; nothing is unpickled.
What clients can make the daemon hold is bounded (``config.py``): ranks tracked, connections,
frame and body sizes, read timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from typing import Any, Callable

from . import auth, periodic, wire
from .clock import Clocks, Offset
from .config import DaemonConfig
from .conn import Conn
from .errors import FrameError, MonitorError, WireError
from .exporters import JsonlWriter, TensorBoardWriter, prometheus_text
from .http_api import Api, start_http
from .relay import Relay
from .store import Store
from .traces import TraceJob, TraceManager, dyno_config, start_step

log = logging.getLogger("ms_monitor.daemon")


class Daemon:
    """See the module docstring. ``start_in_thread()`` for tests and embedding, ``run()`` for the CLI."""

    def __init__(self, config: DaemonConfig | None = None):
        self.config = config or DaemonConfig()
        self.config.check()
        cfg = self.config
        self.store = Store(cfg.window, cfg.detector, cfg.max_ranks)
        self.conns: set[Conn] = set()
        self.relay = Relay(cfg.forward, self.trace, cfg.token) if cfg.forward else None
        self.token: str | None = cfg.token
        """the token HTTP commands need (``config.token``, or the one made at start)"""
        self.token_file: str | None = None
        """where the made token was written"""
        self.clocks = Clocks()
        """clock probes of the agent and dyno ranks, offsets of relayed ones (``clock.py``)"""
        self.traces = TraceManager(
            self.config.trace_dir, forward=self.relay.put if self.relay else None, offset_of=self.clock_offset
        )
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
            self.token = cfg.token or auth.new_token()
            api = Api(
                status=self.status,
                series=self.store.series,
                metrics=lambda: prometheus_text(self.store),
                trace=self.request_trace,
                trace_status=self.trace_status,
                token=self.token,
                config=cfg,
            )
            self._http = start_http(api, cfg.http_host, cfg.http_port)
            port = self._http.server_address[1]
            self.http_url = f"http://{cfg.http_host}:{port}"
            if not cfg.token:
                self.token_file = cfg.token_file or auth.default_token_file(port)
                auth.write_token(self.token_file, self.token)
                log.info("ms-monitor daemon: HTTP token written to %s", self.token_file)
        periodic.sweep_shm(cfg.clean_shm)
        writers = (self.jsonl, self.tensorboard)
        self._tasks = [asyncio.ensure_future(periodic.run(self.conns, self.traces, cfg.clean_shm, writers))]
        if self.relay is not None:
            self._tasks.append(asyncio.ensure_future(self.relay.run()))
        log.info("ms-monitor daemon: agents at %s, http at %s", self.agent_addrs, self.http_url)

    async def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        """Start, call `on_ready`, run until ``stop()`` or SIGTERM (in the main thread), shut down."""
        await self.start()
        assert self._stopped is not None and self.loop is not None
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
            self.loop.add_signal_handler(signal.SIGTERM, self._stopped.set)
        if on_ready is not None:
            on_ready()
        await self._stopped.wait()
        await self._shutdown()

    def run(self) -> None:
        asyncio.run(self.serve())

    def start_in_thread(self, timeout: float = 10.0) -> Daemon:
        ready = threading.Event()
        self._thread = threading.Thread(
            target=asyncio.run, args=(self.serve(ready.set),), name="ms-monitor-daemon", daemon=True
        )
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
        if self.token_file and self.token:
            auth.remove_token(self.token_file, self.token)

    # -- agent connections -----------------------------------------------------------------------
    def _refusal(self, hello: dict) -> str | None:
        """Why a connection is refused after its hello, or None."""
        if self.config.token and not auth.same_token(hello.get("token", ""), self.config.token):
            return "bad or missing token"
        if len(self.conns) >= self.config.max_connections:
            return f"the daemon has {len(self.conns)} connections open, its limit (--max-connections)"
        if hello["role"] != "relay" and not self.store.has_room(hello["rank"]):
            return self._over(hello["rank"])
        return None

    def _over(self, rank: int) -> str:
        return (
            f"rank {rank} refused: the daemon tracks {len(self.store.ranks)} connected ranks, its limit "
            "(raise it with --max-ranks or MS_MONITOR_MAX_RANKS=N)"
        )

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = None
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        try:
            hello = await asyncio.wait_for(wire.read_message(reader), 10.0)
            if hello["t"] != "hello":
                raise WireError(f"first message must be hello, got {hello['t']!r}")
            refusal = self._refusal(hello)
            if refusal is not None:
                log.warning("ms-monitor daemon: %s %d refused: %s", hello["role"], hello["rank"], refusal)
                writer.write(wire.encode({"t": "error", "msg": refusal}))
                await writer.drain()
                return
            conn = Conn(writer, hello)
            self.conns.add(conn)
            if conn.role != "relay":
                self.store.connected(conn.rank, hello)
                if conn.role == "agent":
                    self.clocks.forget(conn.rank)  # the rank may have come back on another host
            writer.write(wire.encode({"t": "welcome", "v": wire.PROTOCOL_VERSION}))
            if conn.clk:
                conn.send({"t": "ping", "d": time.time()})
            await writer.drain()
            while True:
                try:
                    msg = await wire.read_message(reader)
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
                refused = set()
                for s in samples:
                    if s["r"] not in conn.ranks and s["r"] not in refused:
                        if self.store.connected(s["r"], {"host": conn.host, "role": "relay"}):
                            conn.ranks.add(s["r"])
                        else:
                            refused.add(s["r"])
                if refused:
                    samples = [s for s in samples if s["r"] not in refused]
                    self._tell_refused(conn, refused)
            alerts = self.store.add(samples)
            self._export(samples, alerts)
            if self.relay is not None and samples:
                self.relay.put({"t": "b", "s": samples})
        elif kind == "dstat":
            self.store.dyno_status(msg)
        elif kind == "npumon":
            log.info("ms-monitor daemon: rank %d npu-monitor config %s", msg["rank"], msg["cfg"])
        elif kind == "pong":
            t1 = time.time()
            conn.probes.append((msg["d"], msg["a"], t1))
            if conn.role != "relay":
                self.clocks.observe(conn.rank, conn.host, msg["d"], msg["a"], t1)
        elif kind == "tfile":
            self.traces.on_tfile(msg)
        elif kind == "tdone":
            if conn.role == "relay":
                self.clocks.observe_relayed(msg["rank"], list(conn.probes), msg)
            self.traces.on_tdone(msg)

    def clock_offset(self, rank: int) -> Offset | None:
        """The rank's clock minus this daemon's, if probes measured it (directly or through a relay)."""
        return self.clocks.aligned(rank)

    def _tell_refused(self, conn: Conn, refused: set[int]) -> None:
        """Tell a relay once that ranks of it are over the limit (their samples are dropped)."""
        if conn.told_refused:
            return
        conn.told_refused = True
        msg = f"{len(refused)} ranks (first {min(refused)}) dropped: " + self._over(min(refused))
        log.warning("ms-monitor daemon: relay %s: %s", conn.host or "?", msg)
        conn.send({"t": "error", "msg": msg})

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

    # -- what the HTTP side reads and commands ---------------------------------------------------
    def status(self) -> dict:
        """The /api/status document (thread-safe)."""
        out = self.store.status()
        out["traces"] = self.on_loop(lambda: [j.summary() for j in self.traces.jobs.values()])
        out["agent_addrs"] = self.agent_addrs
        out["forward_dropped"] = self.relay.dropped if self.relay else 0
        return out

    def request_trace(self, req: dict, timeout: float = 10.0) -> dict:
        """Thread-safe entry (HTTP): start a trace job; returns its summary or raises MonitorError."""
        if self.loop is None:
            raise MonitorError("the daemon is not running")
        fut = asyncio.run_coroutine_threadsafe(self.trace(req), self.loop)
        return fut.result(timeout)

    def on_loop(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` on the daemon's event loop and return its result (for the HTTP threads)."""
        if self.loop is None:
            raise MonitorError("the daemon is not running")

        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)

    def trace_status(self, job_id: str) -> dict | None:
        """A trace job's summary, None if there is no such job (thread-safe)."""

        def get() -> dict | None:
            job = self.traces.jobs.get(job_id)
            return None if job is None else job.summary()

        return self.on_loop(get)

    async def trace(self, req: dict, job_id: str | None = None, upstream: bool = False) -> dict:
        """Start a trace job from a request (on the loop); a relay's job (`upstream`) sends its files up."""
        ranks = req.get("ranks")
        if ranks is not None:
            if not isinstance(ranks, list) or len(ranks) > 1 << 16:
                raise MonitorError(f"ranks={str(ranks)[:100]} must be a list of at most 65536 rank numbers")
            for r in ranks:
                if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= wire.MAX_RANK.value:
                    raise MonitorError(f"ranks: {r!r} is not a rank number in 0..{wire.MAX_RANK.value}")
        steps = req.get("steps")
        wanted = None if ranks is None else set(ranks)
        want = (lambda r: True) if wanted is None else (lambda r: r in wanted)
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
            start = start_step({r["rank"]: r for r in self.store.status()["ranks"]}, served, [c.rank for c in dynos])
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
            # one config per node reaches all its ranks: it names the ranks it is for, and each rank's gate obeys
            job.dyno_select = None if ranks is None else sorted(set(ranks) - served)
            log_dir = os.path.abspath(os.path.join(job.out_dir, "dyno"))
            cfg = dyno_config(start, steps, log_dir, bool(analyse), job.dyno_select)
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


__all__ = ["Daemon", "DaemonConfig", "TraceJob"]
