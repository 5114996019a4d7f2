"""The agent <-> daemon protocol: length-prefixed msgpack maps, each checked against a schema.

A frame is a 4-byte big-endian length followed by one msgpack map whose key ``"t"`` names the
message type. Everything read from a socket goes through :func:`decode`, which enforces the frame
size, msgpack's own container limits (no extension types, so nothing but plain data can come
out), and the schema of the message type: required keys, value types, numeric ranges, string and
container sizes. Unknown keys are dropped. Nothing is ever unpickled.

Samples are compact maps with short keys (about 60 bytes each), shipped in batches (``"b"``).
"""

from __future__ import annotations

import asyncio
import math
import struct
from typing import Any, Callable

import msgpack

from ms_layout.limits import Limit

from .errors import FrameError, WireError

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
#: the largest frame either side accepts; trace files travel in chunks below this
MAX_FRAME = 2 * 1024 * 1024
#: the size of one trace-file chunk
CHUNK = 1024 * 1024
MAX_BATCH = 4096
MAX_NAME = 128
MAX_PHASES = 64
MAX_STEP = 2**53
#: the highest rank number a message may carry (-1: a relay or a daemon)
MAX_RANK = Limit("MS_MONITOR_MAX_RANK", (1 << 20) - 1, "as a rank number")
#: seconds the rest of a frame may take once its header has arrived
FRAME_TIMEOUT = 30.0
ROLES = ("agent", "dyno", "relay")

Check = Callable[[Any, str], Any]


def _int(lo: int, hi: int) -> Check:
    def check(value: Any, key: str) -> int:
        # bool is an int in Python; a protocol integer is not a bool.
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise WireError(f"{key}={value!r} is not an integer in [{lo}, {hi}]")
        return value

    return check


def _float(lo: float, hi: float) -> Check:
    def check(value: Any, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WireError(f"{key}={value!r} is not a number")
        value = float(value)
        if not math.isfinite(value) or not lo <= value <= hi:
            raise WireError(f"{key}={value!r} is not a finite number in [{lo}, {hi}]")
        return value

    return check


def _str(max_len: int, choices: tuple[str, ...] | None = None) -> Check:
    def check(value: Any, key: str) -> str:
        if not isinstance(value, str) or len(value) > max_len:
            raise WireError(f"{key} must be a string of at most {max_len} characters, got {type(value).__name__}")
        if choices is not None and value not in choices:
            raise WireError(f"{key}={value!r} is not one of {choices}")
        return value

    return check


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise WireError(f"{key}={value!r} is not a bool")
    return value


def _bin(max_len: int) -> Check:
    def check(value: Any, key: str) -> bytes:
        if not isinstance(value, bytes) or len(value) > max_len:
            raise WireError(f"{key} must be at most {max_len} bytes of binary data")
        return value

    return check


def _str_map(value_check: Check, max_entries: int) -> Check:
    def check(value: Any, key: str) -> dict:
        if not isinstance(value, dict) or len(value) > max_entries:
            raise WireError(f"{key} must be a map of at most {max_entries} entries")
        return {_str(MAX_NAME)(k, f"{key} key"): value_check(v, f"{key}[{k!r}]") for k, v in value.items()}

    return check


def _list(item_check: Check, max_items: int) -> Check:
    def check(value: Any, key: str) -> list:
        if not isinstance(value, list) or len(value) > max_items:
            raise WireError(f"{key} must be a list of at most {max_items} items")
        return [item_check(v, f"{key}[{i}]") for i, v in enumerate(value)]

    return check


def _rank(value: Any, key: str) -> int:
    """A rank: -1 (a relay or a daemon) up to MAX_RANK (read on every use, so the variable can raise it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise WireError(f"{key}={value!r} is not a rank (an integer from -1)")
    return MAX_RANK.check(value, key, WireError)


RANK = _rank

STEP = _int(-1, MAX_STEP)
COUNT = _int(0, MAX_STEP)
SECONDS = _float(0.0, 1e7)
ID = _str(64)
#: a wall-clock time in seconds since the epoch
WALL = _float(0.0, 1e11)

#: one step of one rank: r rank, s step, ts wall time at step end, dt step seconds, ct seconds in
#: communication ranges, ph seconds per named range, tok/smp tokens/samples in the step, hm host
#: RSS bytes, dm device bytes, dr samples the agent dropped so far
SAMPLE: dict[str, tuple[Check, bool]] = {
    "r": (RANK, True),
    "s": (STEP, True),
    "ts": (_float(0.0, 1e11), True),
    "dt": (SECONDS, True),
    "ct": (SECONDS, False),
    "ph": (_str_map(SECONDS, MAX_PHASES), False),
    "tok": (COUNT, False),
    "smp": (COUNT, False),
    "hm": (COUNT, False),
    "dm": (COUNT, False),
    "dr": (COUNT, False),
}


def _record(schema: dict[str, tuple[Check, bool]]) -> Check:
    def check(value: Any, key: str) -> dict:
        if not isinstance(value, dict):
            raise WireError(f"{key} must be a map, got {type(value).__name__}")
        return _apply(schema, value, key)

    return check


SCHEMAS: dict[str, dict[str, tuple[Check, bool]]] = {
    # agent/dyno/relay -> daemon
    "hello": {
        "v": (_int(1, 1000), True),
        "role": (_str(16, ROLES), True),
        "rank": (RANK, True),
        "world": (_int(0, 1 << 24), False),
        "host": (_str(256), False),
        "pid": (_int(0, 1 << 31), False),
        "job": (_str(256), False),
        "token": (_str(256), False),
        "poll": (_bool, False),  # dyno only: False for a status-only connection that takes no configs
        "clk": (_bool, False),  # the client answers ``ping`` with ``pong`` (clock.py); older clients do not
    },
    "b": {"s": (_list(_record(SAMPLE), MAX_BATCH), True)},
    "dstat": {
        "rank": (RANK, True),
        "status": (_int(-1, 3), True),
        "cur": (STEP, True),
        "start": (STEP, False),
        "stop": (STEP, False),
    },
    "npumon": {"rank": (RANK, True), "cfg": (_str_map(_str(4096), 64), True)},
    "tfile": {
        "id": (ID, True),
        "rank": (RANK, True),
        "name": (_str(MAX_NAME), True),
        "seq": (_int(0, 1 << 20), True),
        "last": (_bool, True),
        "data": (_bin(CHUNK), True),
    },
    "tdone": {
        "id": (ID, True),
        "rank": (RANK, True),
        "first": (STEP, True),
        "last": (STEP, True),
        "sources": (_list(_str(MAX_NAME), 16), True),
        "error": (_str(4096), False),
        "note": (_str(4096), False),
        "clk": (_float(-1e9, 1e9), False),  # relay only: the rank's clock minus the relay's, seconds
        "clke": (_float(0.0, 1e9), False),  # relay only: the error bound of clk, seconds
    },
    # answer to a ping, sent at once by the client: d echoed, a its own wall clock at receipt
    "pong": {"d": (WALL, True), "a": (WALL, True)},
    # daemon -> agent
    "welcome": {"v": (_int(1, 1000), True)},
    "error": {"msg": (_str(4096), True)},
    "trace": {
        "id": (ID, True),
        "start": (STEP, True),
        "steps": (_int(1, 100000), True),
        "profiler": (_bool, True),
        "analyse": (_bool, False),
        "ranks": (_list(RANK, 1 << 16), False),
    },
    "cfg": {"id": (ID, True), "cfg": (_str(65536), True)},
    # clock probe (``clock.py``): d is the daemon's wall clock when sent
    "ping": {"d": (WALL, True)},
}


def _apply(schema: dict[str, tuple[Check, bool]], msg: dict, where: str) -> dict:
    out: dict[str, Any] = {}
    for key, (check, required) in schema.items():
        if key in msg and msg[key] is not None:
            out[key] = check(msg[key], f"{where}.{key}")
        elif required:
            raise WireError(f"{where} lacks the required key {key!r}")
    return out


def validate(msg: Any) -> dict:
    """Check a decoded message against the schema of its type; returns it with unknown keys dropped."""
    if not isinstance(msg, dict):
        raise WireError(f"a message must be a map, got {type(msg).__name__}")
    kind = msg.get("t")
    if kind not in SCHEMAS:
        raise WireError(f"unknown message type {kind!r}; known: {sorted(SCHEMAS)}")
    out = _apply(SCHEMAS[kind], msg, kind)
    out["t"] = kind
    return out


def encode(msg: dict) -> bytes:
    """One frame: the length header and the msgpack body (the message is validated first)."""
    body = msgpack.packb(validate(msg), use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise WireError(f"message of {len(body)} bytes exceeds the frame limit of {MAX_FRAME}")
    return HEADER.pack(len(body)) + body


def encode_trusted(msg: dict) -> bytes:
    """A frame of a message built by this package to the schema (no validation; the size limit holds)."""
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise WireError(f"message of {len(body)} bytes exceeds the frame limit of {MAX_FRAME}")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The body length announced by a 4-byte header, refusing anything above MAX_FRAME."""
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes announced; the limit is {MAX_FRAME}")
    return length


def decode(body: bytes) -> dict:
    """Parse and validate one frame body. Raises WireError for anything but a valid message."""
    if len(body) > MAX_FRAME:
        raise WireError(f"frame of {len(body)} bytes exceeds the limit of {MAX_FRAME}")
    try:
        msg = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_FRAME,
            max_bin_len=MAX_FRAME,
            max_array_len=MAX_BATCH * 2,
            max_map_len=1024,
            max_ext_len=0,  # no extension types: plain data only
        )
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise WireError(f"frame of {len(body)} bytes is not a msgpack message ({type(exc).__name__}: {exc})") from None
    return validate(msg)


async def read_message(reader: asyncio.StreamReader, timeout: float | None = None) -> dict:
    """The next message of a stream: waits as long as it takes for a header, then at most `timeout`
    (default FRAME_TIMEOUT) seconds for the body: a client that announces a frame and stalls is cut off."""
    header = await reader.readexactly(HEADER.size)
    body = reader.readexactly(frame_length(header))
    return decode(await asyncio.wait_for(body, FRAME_TIMEOUT if timeout is None else timeout))


class FrameReader:
    """Incremental framing for non-blocking sockets: feed bytes, get complete frame bodies."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out = []
        while len(self._buf) >= HEADER.size:
            length = frame_length(bytes(self._buf[: HEADER.size]))
            end = HEADER.size + length
            if len(self._buf) < end:
                break
            out.append(bytes(self._buf[HEADER.size : end]))
            del self._buf[:end]
        return out


def parse_address(addr: str) -> tuple[str, Any]:
    """``unix:/path``, ``tcp:host:port`` or ``host:port`` -> ("unix", path) or ("tcp", (host, port))."""
    if not isinstance(addr, str) or not addr:
        raise WireError(f"address {addr!r} must be 'unix:/path' or 'tcp:host:port'")
    if addr.startswith("unix:"):
        path = addr[len("unix:") :]
        if not path:
            raise WireError(f"address {addr!r} has an empty socket path")
        return "unix", path
    rest = addr[len("tcp:") :] if addr.startswith("tcp:") else addr
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise WireError(f"address {addr!r} must be 'unix:/path' or 'tcp:host:port' with a port in 1..65535")
    return "tcp", (host.strip("[]"), int(port))
