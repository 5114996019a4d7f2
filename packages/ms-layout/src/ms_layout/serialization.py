"""msgpack serialization of layouts and parallel configs, in a versioned envelope.

Every blob is a map {"format": "ms-layout", "version": N, "kind": ..., "data": ...}. Readers
accept versions up to their own and refuse anything else with a LayoutError that says what was
found, so foreign or truncated bytes never turn into a half-built object.
"""

from __future__ import annotations

from typing import Any, Callable

import msgpack

from .errors import LayoutError
from .layout import Layout
from .limits import Limit
from .parallel_config import ParallelConfig

MAX_BLOB_BYTES = Limit("MS_LAYOUT_MAX_BLOB_BYTES", 64 << 20, "bytes")
"""Size of one msgpack blob; msgpack bounds every array, map and string by the blob's length."""

FORMAT = "ms-layout"
VERSION = 1

_KINDS: dict[str, tuple[type, Callable[[Any], dict], Callable[[dict], Any]]] = {
    "Layout": (Layout, Layout.to_dict, Layout.from_dict),
    "ParallelConfig": (ParallelConfig, ParallelConfig.to_dict, ParallelConfig.from_dict),
}


def register(kind: str, cls: type, to_dict: Callable[[Any], dict], from_dict: Callable[[dict], Any]) -> None:
    """Let another package put its own plans into the same envelope."""
    _KINDS[kind] = (cls, to_dict, from_dict)


def dumps(obj: Any) -> bytes:
    """Serialize a Layout, a ParallelConfig or a registered kind to msgpack bytes."""
    for kind, (cls, to_dict, _) in _KINDS.items():
        if type(obj) is cls:
            envelope = {"format": FORMAT, "version": VERSION, "kind": kind, "data": to_dict(obj)}
            return msgpack.packb(envelope, use_bin_type=True)
    raise LayoutError(f"cannot serialize {type(obj).__name__}; known kinds: {sorted(_KINDS)}")


def loads(blob: bytes, expect: str | None = None) -> Any:
    """Read bytes written by dumps; `expect` names the kind the caller wants."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise LayoutError(f"expected bytes, got {type(blob).__name__}")
    MAX_BLOB_BYTES.check(len(blob), "ms-layout blob size", LayoutError)
    try:
        envelope = msgpack.unpackb(bytes(blob), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise LayoutError(f"not an ms-layout blob: msgpack could not read {len(blob)} bytes ({exc})") from None
    if not isinstance(envelope, dict) or envelope.get("format") != FORMAT:
        found = envelope.get("format") if isinstance(envelope, dict) else type(envelope).__name__
        raise LayoutError(f"not an ms-layout blob: format is {found!r:.100}, expected {FORMAT!r}")
    version = envelope.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= VERSION:  # True is an int
        raise LayoutError(f"ms-layout blob has version {version!r:.100}; this reader knows versions 1..{VERSION}")
    kind = envelope.get("kind")
    if not isinstance(kind, str) or kind not in _KINDS:  # a list or map is not hashable
        raise LayoutError(f"ms-layout blob holds unknown kind {kind!r:.100}; known kinds: {sorted(_KINDS)}")
    if expect is not None and kind != expect:
        raise LayoutError(f"ms-layout blob holds a {kind}, expected a {expect}")
    try:
        return _KINDS[kind][2](envelope.get("data"))
    except LayoutError:
        raise
    except (TypeError, KeyError, ValueError, AttributeError, OverflowError, RecursionError) as exc:
        # Registered kinds of other packages may still let one of these through.
        detail = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"  # KeyError says only 'x'
        raise LayoutError(f"ms-layout blob of kind {kind} has bad data: {detail}") from None
