"""Relaying from a node daemon to a cluster aggregator (another daemon, ``--forward tcp:HOST:PORT``).

The node daemon connects to the aggregator like an agent with role ``relay`` and sends every
validated sample batch through a bounded queue: when the aggregator is slow or gone, batches are
dropped and counted (``forward_dropped`` in /api/status), and the connection is retried with backoff. Trace
commands from the aggregator are run here as local jobs whose files go back up the same connection
(see ``traces.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable
from typing import Callable

from . import wire
from .errors import MonitorError
from .wire import read_message

log = logging.getLogger("ms_monitor.daemon")

#: runs a trace job here: (request, job id, upstream) -> the job's summary
TraceFn = Callable[[dict, str, bool], Awaitable[dict]]


class Relay:
    """The node daemon's connection to its aggregator at `addr`; `trace` runs its trace commands here."""

    def __init__(self, addr: str, trace: TraceFn, token: str | None = None, maxsize: int = 1024):
        self.addr = addr
        self.trace = trace
        self.token = token
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=maxsize)
        self.dropped = 0
        self.connected = False

    def put(self, msg: dict) -> None:
        """Queue a message for the aggregator; drop and count it when the queue is full."""
        try:
            self.queue.put_nowait(msg)
        except asyncio.QueueFull:
            self.dropped += len(msg.get("s", [])) or 1

    async def run(self) -> None:
        assert self.addr
        kind, where = wire.parse_address(self.addr)
        hello = {
            "t": "hello",
            "v": wire.PROTOCOL_VERSION,
            "role": "relay",
            "rank": -1,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "clk": True,  # answers clock probes (clock.py)
        }
        if self.token:
            hello["token"] = self.token
        backoff = 0.2
        while True:
            writer = None
            try:
                if kind == "unix":
                    reader, writer = await asyncio.open_unix_connection(where)
                else:
                    reader, writer = await asyncio.open_connection(*where)
                writer.write(wire.encode(hello))
                reply = await asyncio.wait_for(read_message(reader), 10.0)
                if reply["t"] != "welcome":
                    raise ConnectionError(f"aggregator refused this relay: {reply.get('msg')}")
                backoff, self.connected = 0.2, True
                log.info("ms-monitor daemon: relaying to %s", self.addr)
                await asyncio.gather(self._send(writer), self._receive(reader, writer))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("ms-monitor daemon: aggregator connection: %s", exc)
            finally:
                self.connected = False
                if writer is not None:
                    writer.close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _send(self, writer: asyncio.StreamWriter) -> None:
        while True:
            msg = await self.queue.get()
            writer.write(wire.encode(msg))
            await asyncio.wait_for(writer.drain(), 10.0)

    async def _receive(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            msg = await read_message(reader)
            if msg["t"] == "ping":  # the aggregator's clock probe, answered at once (clock.py)
                writer.write(wire.encode({"t": "pong", "d": msg["d"], "a": time.time()}))
                continue
            if msg["t"] != "trace":
                continue
            req = {
                "ranks": msg.get("ranks"),
                "steps": msg["steps"],
                "start_step": msg["start"],
                "profiler": msg["profiler"],
                "analyse": msg.get("analyse", True),
            }
            try:
                await self.trace(req, msg["id"], True)
            except MonitorError as exc:
                log.warning("ms-monitor daemon: trace %s from the aggregator: %s", msg["id"], exc)
