"""The exceptions of ms-monitor."""

from __future__ import annotations


class MonitorError(ValueError):
    """Bad input to ms-monitor (an argument, a config, a trace file); the message names the value."""


class WireError(MonitorError):
    """A message from a socket that is not what the protocol allows: too big, not msgpack, wrong schema."""


class FrameError(WireError):
    """A frame header announcing more than the protocol allows: the stream can no longer be read."""
