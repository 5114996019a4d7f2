"""One open connection to the daemon (an agent, a dyno poller or a relay), as the daemon keeps it."""

from __future__ import annotations

import asyncio
from collections import deque

from . import wire
from .clock import KEEP


class Conn:
    """One open agent, dyno or relay connection."""

    def __init__(self, writer: asyncio.StreamWriter, hello: dict):
        self.writer = writer
        self.role: str = hello["role"]
        self.rank: int = hello["rank"]
        self.host: str = hello.get("host", "")
        self.poll: bool = hello.get("poll", True)  # a dyno connection that takes configs
        self.clk: bool = hello.get("clk", False)  # answers clock probes (clock.py)
        self.ranks: set[int] = set() if self.role == "relay" else {self.rank}
        self.told_refused = False  # whether it was told that some of its ranks are over the limit
        self.probes: deque = deque(maxlen=KEEP)  # clock probes (t0, a, t1) of this connection

    def send(self, msg: dict) -> None:
        if not self.writer.is_closing():
            self.writer.write(wire.encode(msg))
