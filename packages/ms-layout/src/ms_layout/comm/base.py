"""BaseGroup: the public ProcessGroup methods written once over a backend's primitives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ms_layout.comm.protocol import (
    CommArgumentError,
    CommUnsupportedError,
    P2POp,
    ReduceOp,
    Work,
    all_to_all_result,
    check_array,
    check_avg_dtype,
    check_axis,
    check_divisible,
    check_dtype,
    check_new_group_ranks,
    check_partition,
    check_peer,
    check_tag,
    concat_gathered,
    split_axis_first,
)


class BaseGroup:
    """The public methods of a ProcessGroup, written once: argument checks, layout transforms and
    the group cache. A backend supplies the primitives (``_all_reduce``, ``_all_gather``, ...),
    which receive validated C-contiguous arrays and *global* peer ranks."""

    backend = "base"
    move_dtypes: frozenset[np.dtype] = frozenset()  # dtypes gather/broadcast/p2p carry
    reduce_dtypes: frozenset[np.dtype] = frozenset()  # dtypes all_reduce/reduce_scatter reduce
    supports_tags = True
    dtype_hint = ""  # appended to dtype errors, e.g. "; use backend='gloo' on CPU"

    def __init__(self, ranks: Sequence[int], rank: int):
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.rank = rank

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size}, ranks={list(self.ranks)})"

    # primitives of a backend ------------------------------------------------
    def _require(self, op: str) -> None:
        """Raise CommUnsupportedError if the backend cannot do ``op`` at all."""

    def _all_reduce(self, array: np.ndarray, op: ReduceOp, async_op: bool) -> Work | None:
        raise NotImplementedError

    def _all_gather(self, array: np.ndarray, out: np.ndarray) -> None:  # out: (size, *shape)
        raise NotImplementedError

    def _reduce_scatter(self, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        raise NotImplementedError

    def _all_to_all(self, src: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError

    def _broadcast(self, array: np.ndarray, src: int, async_op: bool) -> Work | None:
        raise NotImplementedError

    def _p2p(self, kind: str, array: np.ndarray, peer: int, tag: int, async_op: bool) -> Any:
        raise NotImplementedError

    def _batch(self, items: list[tuple[str, np.ndarray, int, int]]) -> list[Work]:
        raise NotImplementedError

    def _create(self, ranks: tuple[int, ...], rank: int) -> BaseGroup:
        raise NotImplementedError

    def _cache(self) -> dict[tuple[int, ...], BaseGroup]:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    # checks ------------------------------------------------------------------
    def _check(self, array: Any, op: str, *, reduce: bool = False, writable: bool = False) -> None:
        check_array(array, op, writable=writable)
        supported = self.reduce_dtypes if reduce else self.move_dtypes
        check_dtype(array, supported, op, self.backend_label(), self.dtype_hint)

    def backend_label(self) -> str:
        return self.backend

    def _peer(self, array: Any, peer: Any, tag: Any, op: str, what: str) -> tuple[int, int]:
        self._check(array, op, writable=op in ("recv", "irecv"))
        peer = check_peer(peer, self.size, op, what, me=self.rank)
        tag = check_tag(tag, op)
        if tag and not self.supports_tags:
            raise CommUnsupportedError(
                f"{op}: tag={tag}: the {self.backend_label()} backend ignores message tags;"
                " use tag=0 (messages between two ranks arrive in order) or backend='gloo'"
            )
        return self.ranks[peer], tag

    # the protocol --------------------------------------------------------------
    def all_reduce(self, array: np.ndarray, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False) -> Work | None:
        op = ReduceOp.parse(op)
        self._check(array, "all_reduce", reduce=True, writable=True)
        check_avg_dtype(array, op, "all_reduce")
        return self._all_reduce(array, op, bool(async_op))

    def all_gather(self, array: np.ndarray, axis: int = 0) -> np.ndarray:
        self._check(array, "all_gather")
        axis = check_axis(axis, array.ndim, "all_gather")
        out = np.empty((self.size,) + array.shape, dtype=array.dtype)
        self._all_gather(array, out)
        return concat_gathered(out, axis)

    def reduce_scatter(self, array: np.ndarray, op: ReduceOp | str = ReduceOp.SUM, axis: int = 0) -> np.ndarray:
        self._require("reduce_scatter")
        op = ReduceOp.parse(op)
        self._check(array, "reduce_scatter", reduce=True)
        check_avg_dtype(array, op, "reduce_scatter")
        axis = check_axis(axis, array.ndim, "reduce_scatter")
        check_divisible(array, axis, self.size, "reduce_scatter")
        src = split_axis_first(array, axis)
        out = np.empty((src.shape[0] // self.size,) + src.shape[1:], dtype=array.dtype)
        self._reduce_scatter(src, out, op)
        return out if axis == 0 else np.ascontiguousarray(np.moveaxis(out, 0, axis))

    def all_to_all(self, array: np.ndarray, split_axis: int = 0, concat_axis: int = 0) -> np.ndarray:
        self._require("all_to_all")
        self._check(array, "all_to_all")
        split_axis = check_axis(split_axis, array.ndim, "all_to_all", "split_axis")
        concat_axis = check_axis(concat_axis, array.ndim, "all_to_all", "concat_axis")
        check_divisible(array, split_axis, self.size, "all_to_all")
        src = split_axis_first(array, split_axis)
        out = np.empty_like(src)
        self._all_to_all(src, out)
        return all_to_all_result(out, self.size, split_axis, concat_axis)

    def broadcast(self, array: np.ndarray, src: int = 0, async_op: bool = False) -> Work | None:
        self._check(array, "broadcast", writable=True)
        src = check_peer(src, self.size, "broadcast", "src")
        return self._broadcast(array, self.ranks[src], bool(async_op))

    def send(self, array: np.ndarray, dst: int, tag: int = 0) -> None:
        self._p2p("send", array, *self._peer(array, dst, tag, "send", "dst"), False)

    def recv(self, array: np.ndarray, src: int, tag: int = 0) -> None:
        self._p2p("recv", array, *self._peer(array, src, tag, "recv", "src"), False)

    def isend(self, array: np.ndarray, dst: int, tag: int = 0) -> Work:
        return self._p2p("send", array, *self._peer(array, dst, tag, "isend", "dst"), True)

    def irecv(self, array: np.ndarray, src: int, tag: int = 0) -> Work:
        return self._p2p("recv", array, *self._peer(array, src, tag, "irecv", "src"), True)

    def batch_isend_irecv(self, ops: list[P2POp]) -> list[Work]:
        self._require("batch_isend_irecv")
        items = []
        for op in ops:
            if not isinstance(op, P2POp):
                raise CommArgumentError(f"batch_isend_irecv: expected P2POp items, got {op!r}")
            name, what = ("isend", "dst") if op.kind == "send" else ("irecv", "src")
            items.append((op.kind, op.array, *self._peer(op.array, op.peer, op.tag, name, what)))
        return self._batch(items) if items else []

    def new_group(self, ranks: Sequence[int]) -> BaseGroup | None:
        return self._make_group(check_new_group_ranks(ranks, self.ranks, "new_group"))

    def split(self, groups: Sequence[Sequence[int]]) -> BaseGroup:
        me = self.ranks[self.rank]
        group = self._make_group(next(g for g in check_partition(groups, self.ranks) if me in g))
        assert group is not None
        return group

    def _make_group(self, ranks: tuple[int, ...]) -> BaseGroup | None:
        """Only the members create a group (MindSpore's rule, and torch's with local
        synchronization); groups are cached by their ranks, as both backends name a group by a
        hash of its ranks and would collide when asked for the same ranks twice."""
        me = self.ranks[self.rank]
        if me not in ranks:
            return None
        cache = self._cache()
        if ranks not in cache:
            cache[ranks] = self._create(ranks, ranks.index(me))
        return cache[ranks]
