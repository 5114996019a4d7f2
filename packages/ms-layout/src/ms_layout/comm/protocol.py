"""The process-group contract shared by every backend, and the argument checks they all use.

Numpy arrays are the currency: every backend wraps them without copying (``torch.from_numpy``,
``mindspore.Tensor.from_numpy``), which is why buffers must be C-contiguous and, for the in-place
operations, writable. The checks live here so that both backends reject bad input with the same
message, before anything is sent, so a caller error never leaves peers waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ms_layout.errors import CommError


class CommArgumentError(CommError, ValueError):
    """A bad argument to a process-group call: the caller is at fault; the message names it."""


class CommUnsupportedError(CommError):
    """The backend cannot do this operation (e.g. reduce_scatter on MindSpore's CPU backend)."""


class ReduceOp(str, Enum):
    """Element-wise reductions; the values are the strings MindSpore's ``mint.distributed`` uses."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
    AVG = "avg"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        """Accept a ReduceOp or its name in any case; anything else is a CommArgumentError."""
        if isinstance(op, cls):
            return op
        if isinstance(op, str):
            try:
                return cls(op.lower())
            except ValueError:
                pass
        names = ", ".join(o.value for o in cls)
        raise CommArgumentError(f"unknown reduce op {op!r}; expected one of {names}")


@runtime_checkable
class Work(Protocol):
    """Handle of an asynchronous operation; ``wait`` raises CommError if the operation failed."""

    def wait(self, timeout: float | None = None) -> None: ...

    def is_completed(self) -> bool: ...


@dataclass(frozen=True)
class P2POp:
    """One entry of ``batch_isend_irecv``: ``kind`` is "send" or "recv", ``peer`` a group rank."""

    kind: str
    array: np.ndarray
    peer: int
    tag: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("send", "recv"):
            raise CommArgumentError(f"P2POp kind must be 'send' or 'recv', got {self.kind!r}")


@runtime_checkable
class ProcessGroup(Protocol):
    """A set of ranks that run collectives together. Ranks in arguments are group ranks,
    except ``new_group``/``split`` which take global ranks (as torch and MindSpore do)."""

    backend: str
    rank: int
    size: int
    ranks: tuple[int, ...]

    def all_reduce(
        self, array: np.ndarray, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False
    ) -> Work | None: ...

    def all_gather(self, array: np.ndarray, axis: int = 0) -> np.ndarray: ...

    def reduce_scatter(self, array: np.ndarray, op: ReduceOp | str = ReduceOp.SUM, axis: int = 0) -> np.ndarray: ...

    def all_to_all(self, array: np.ndarray, split_axis: int = 0, concat_axis: int = 0) -> np.ndarray: ...

    def broadcast(self, array: np.ndarray, src: int = 0, async_op: bool = False) -> Work | None: ...

    def send(self, array: np.ndarray, dst: int, tag: int = 0) -> None: ...

    def recv(self, array: np.ndarray, src: int, tag: int = 0) -> None: ...

    def isend(self, array: np.ndarray, dst: int, tag: int = 0) -> Work: ...

    def irecv(self, array: np.ndarray, src: int, tag: int = 0) -> Work: ...

    def batch_isend_irecv(self, ops: list[P2POp]) -> list[Work]: ...

    def barrier(self) -> None: ...

    def new_group(self, ranks: Sequence[int]) -> ProcessGroup | None: ...

    def split(self, groups: Sequence[Sequence[int]]) -> ProcessGroup: ...


# ---------------------------------------------------------------- argument checks


def check_array(array: Any, op: str, *, writable: bool = False) -> np.ndarray:
    """The buffer must be a C-contiguous ndarray (zero-copy wrapping needs it); in-place
    operations also need it writable."""
    if not isinstance(array, np.ndarray):
        raise CommArgumentError(f"{op}: expected a numpy.ndarray, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise CommArgumentError(
            f"{op}: the array must be C-contiguous (shape {array.shape}, strides {array.strides});"
            " pass np.ascontiguousarray(x)"
        )
    if writable and not array.flags.writeable:
        raise CommArgumentError(f"{op}: the array is read-only, but {op} writes into it in place")
    return array


def check_dtype(array: np.ndarray, supported: frozenset[np.dtype], op: str, backend: str, hint: str = "") -> None:
    """Refuse dtypes the backend cannot carry (a backend limit, hence CommUnsupportedError),
    naming the dtype and the ones it can."""
    if array.dtype not in supported:
        names = ", ".join(sorted(str(d) for d in supported))
        raise CommUnsupportedError(
            f"{op}: dtype {array.dtype} is not supported by the {backend} backend (supported: {names}){hint}"
        )


def check_avg_dtype(array: np.ndarray, op: ReduceOp, name: str) -> None:
    """An in-place average cannot be stored in an integer buffer without silent truncation."""
    if op is ReduceOp.AVG and not np.issubdtype(array.dtype, np.inexact):
        raise CommArgumentError(f"{name}: ReduceOp.AVG needs a floating dtype, got {array.dtype}; use SUM and divide")


def check_peer(peer: Any, size: int, op: str, what: str, me: int | None = None) -> int:
    """A peer is a group rank in [0, size); for point-to-point (``me`` given) not this rank."""
    if isinstance(peer, (bool, np.bool_)) or not isinstance(peer, (int, np.integer)):
        raise CommArgumentError(f"{op}: {what} must be an int group rank, got {peer!r}")
    peer = int(peer)
    if not 0 <= peer < size:
        raise CommArgumentError(f"{op}: {what}={peer} is out of range for a group of size {size}")
    if peer == me:
        raise CommArgumentError(f"{op}: {what}={peer} is this rank; a rank cannot message itself")
    return peer


def check_tag(tag: Any, op: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or tag < 0:
        raise CommArgumentError(f"{op}: tag must be a non-negative int, got {tag!r}")
    return int(tag)


def check_axis(axis: Any, ndim: int, op: str, name: str = "axis") -> int:
    """Normalise a possibly negative axis; 0-d arrays have no axis to gather or split along."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise CommArgumentError(f"{op}: {name} must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise CommArgumentError(f"{op}: {name}={axis} is out of range for an array of {ndim} dims")
    return int(axis) % ndim


def check_divisible(array: np.ndarray, axis: int, size: int, op: str) -> None:
    if array.shape[axis] % size:
        raise CommArgumentError(
            f"{op}: dimension {axis} of shape {array.shape} has length {array.shape[axis]},"
            f" which is not divisible by the group size {size}"
        )


def check_new_group_ranks(ranks: Any, parent: Sequence[int], op: str) -> tuple[int, ...]:
    """Global ranks of a new group: unique members of the parent; returned sorted, because
    both torch and MindSpore order a group's ranks ascending."""
    try:
        out = tuple(int(r) for r in ranks)
    except TypeError:
        raise CommArgumentError(f"{op}: ranks must be a sequence of ints, got {ranks!r}") from None
    if not out:
        raise CommArgumentError(f"{op}: ranks must not be empty")
    if len(set(out)) != len(out):
        raise CommArgumentError(f"{op}: ranks {list(out)} contain duplicates")
    strangers = sorted(set(out) - set(parent))
    if strangers:
        raise CommArgumentError(f"{op}: ranks {strangers} are not members of this group {list(parent)}")
    return tuple(sorted(out))


def check_partition(groups: Any, parent: Sequence[int]) -> list[tuple[int, ...]]:
    """``split`` takes disjoint groups that together hold every member, so every rank gets a
    group and every rank runs the same validation (no rank errors while others wait)."""
    out = [check_new_group_ranks(g, parent, "split") for g in groups]
    seen: dict[int, int] = {}
    for i, g in enumerate(out):
        for r in g:
            if r in seen:
                raise CommArgumentError(f"split: rank {r} is in group {seen[r]} and group {i}")
            seen[r] = i
    missing = sorted(set(parent) - set(seen))
    if missing:
        raise CommArgumentError(f"split: ranks {missing} of this group are in none of {out}")
    return out


# ---------------------------------------------------------------- layout helpers


def concat_gathered(stacked: np.ndarray, axis: int) -> np.ndarray:
    """``stacked`` is (size, *shape), one slab per rank: concatenate the slabs along ``axis``."""
    if axis == 0:
        return stacked.reshape((-1,) + stacked.shape[2:])
    return np.concatenate(list(stacked), axis=axis)


def split_axis_first(array: np.ndarray, axis: int) -> np.ndarray:
    """Move ``axis`` to the front, contiguously, so chunk i is a contiguous block (what the
    backends' flat reduce-scatter / all-to-all expect). No copy when ``axis`` is 0."""
    if axis == 0:
        return array
    return np.ascontiguousarray(np.moveaxis(array, axis, 0))


def all_to_all_result(out: np.ndarray, size: int, split_axis: int, concat_axis: int) -> np.ndarray:
    """``out`` holds the received chunks stacked along axis 0 in the split-axis-first layout;
    put each back in the original orientation and concatenate along ``concat_axis``."""
    if split_axis == 0 and concat_axis == 0:
        return out
    chunks = out.reshape((size, out.shape[0] // size) + out.shape[1:])
    return np.concatenate([np.moveaxis(c, 0, split_axis) for c in chunks], axis=concat_axis)
