"""ProcessGroup on torch.distributed's gloo backend: every collective and point-to-point op on CPU.

Arrays cross into torch with ``torch.from_numpy`` (zero copy), so in-place operations write
straight into the caller's numpy buffer. torch is imported lazily: importing this module is cheap.

Sub-groups are created with ``use_local_synchronization=True``, so only the members of a new group
take part in creating it -- the same rule as MindSpore's, which lets ``new_group``/``split`` behave
identically on both backends (the argument checks and group cache live in ``BaseGroup``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import numpy as np

from ms_layout.comm.base import BaseGroup
from ms_layout.comm.protocol import ReduceOp, Work
from ms_layout.errors import CommError

#: dtypes gloo moves and reduces (int16/uint16 fail in torch 2.13 with "Invalid scalar type")
GLOO_DTYPES = frozenset(
    np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64, np.bool_)
)

# group ranks -> GlooGroup, for this process
_GROUPS: dict[tuple[int, ...], BaseGroup] = {}


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _torch_op(op: ReduceOp) -> Any:
    r = _dist().ReduceOp
    # gloo has no AVG: it is a SUM followed by a division on our side
    ops = {ReduceOp.SUM: r.SUM, ReduceOp.AVG: r.SUM, ReduceOp.MAX: r.MAX, ReduceOp.MIN: r.MIN}
    return ops.get(op, r.PRODUCT)


def _tensor(array: np.ndarray) -> Any:
    """Zero-copy torch view; read-only inputs are copied since torch tensors are always writable."""
    import torch

    return torch.from_numpy(array if array.flags.writeable else array.copy())


def _first_attr(module: Any, *names: str) -> Callable[..., Any]:
    """torch 2.13 renamed the fused collectives (``*_single``); older torch has the old names."""
    for name in names:
        fn = getattr(module, name, None)
        if fn is not None:
            return fn
    raise CommError(f"torch.distributed has none of {names}")


class GlooWork:
    """Wraps a torch Work; ``finish`` runs once after completion (e.g. the AVG division)."""

    def __init__(self, work: Any, what: str, keep: tuple = (), finish: Callable | None = None):
        self._work = work
        self._what = what
        self._keep = keep  # the tensors must stay alive while the op runs
        self._finish = finish
        self._done = False

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        try:
            if timeout is None:
                ok = self._work.wait()
            else:
                ok = self._work.wait(timedelta(seconds=timeout))
        except RuntimeError as e:
            raise CommError(f"{self._what} failed: {e}") from e
        if ok is False:
            raise CommError(f"{self._what} did not complete within {timeout} s")
        if self._finish is not None:
            self._finish()
        self._done = True
        self._keep = ()

    def is_completed(self) -> bool:
        return self._done or bool(self._work.is_completed())


class GlooGroup(BaseGroup):
    """A gloo process group; see :class:`ms_layout.comm.protocol.ProcessGroup` for the contract."""

    backend = "gloo"
    move_dtypes = GLOO_DTYPES
    reduce_dtypes = GLOO_DTYPES

    def __init__(self, pg: Any, ranks: Any, rank: int, timeout: float):
        super().__init__(ranks, rank)
        self._pg = pg  # None means torch's default (world) group
        self._timeout = timeout

    def _run(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call torch; its failures (a dead peer, a timeout) become CommError naming the group."""
        try:
            return fn(*args, group=self._pg, **kwargs)
        except (RuntimeError, ValueError) as e:
            where = f"rank {self.rank} of {list(self.ranks)}"
            raise CommError(f"gloo {what} failed on {where}: {e}") from e

    def _all_reduce(self, array: np.ndarray, op: ReduceOp, async_op: bool) -> Work | None:
        t = _tensor(array)

        def finish() -> None:
            if op is ReduceOp.AVG:
                np.divide(array, self.size, out=array)

        w = self._run("all_reduce", _dist().all_reduce, t, op=_torch_op(op), async_op=async_op)
        if async_op:
            return GlooWork(w, "gloo all_reduce", (t,), finish)
        finish()
        return None

    def _all_gather(self, array: np.ndarray, out: np.ndarray) -> None:
        fn = _first_attr(_dist(), "all_gather_single", "all_gather_into_tensor")
        # the concatenated form (size * dim0, ...): gloo rejects the stacked (size, ...) form
        self._run("all_gather", fn, _tensor(out.reshape((-1,) + array.shape[1:])), _tensor(array))

    def _reduce_scatter(self, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        fn = _first_attr(_dist(), "reduce_scatter_single", "reduce_scatter_tensor")
        self._run("reduce_scatter", fn, _tensor(out), _tensor(src), op=_torch_op(op))
        if op is ReduceOp.AVG:
            np.divide(out, self.size, out=out)

    def _all_to_all(self, src: np.ndarray, out: np.ndarray) -> None:
        self._run("all_to_all", _dist().all_to_all_single, _tensor(out), _tensor(src))

    def _broadcast(self, array: np.ndarray, src: int, async_op: bool) -> Work | None:
        t = _tensor(array)
        w = self._run("broadcast", _dist().broadcast, t, src=src, async_op=async_op)
        return GlooWork(w, "gloo broadcast", (t,)) if async_op else None

    def _p2p(self, kind: str, array: np.ndarray, peer: int, tag: int, async_op: bool) -> Any:
        dist = _dist()
        if async_op:
            fn, name = (dist.isend, "isend") if kind == "send" else (dist.irecv, "irecv")
        else:
            fn, name = (dist.send, "send") if kind == "send" else (dist.recv, "recv")
        t = _tensor(array)
        w = self._run(name, fn, t, peer, tag=tag)
        return GlooWork(w, f"gloo {name}", (t,)) if async_op else None

    def _batch(self, items: list[tuple[str, np.ndarray, int, int]]) -> list[Work]:
        dist = _dist()
        tensors = [_tensor(array) for _, array, _, _ in items]
        p2p = [
            dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, self._pg, tag)
            for (kind, _, peer, tag), t in zip(items, tensors)
        ]
        try:
            works = dist.batch_isend_irecv(p2p)
        except (RuntimeError, ValueError) as e:
            raise CommError(f"gloo batch_isend_irecv failed on rank {self.rank}: {e}") from e
        return [GlooWork(w, "gloo batch_isend_irecv", tuple(tensors)) for w in works]

    def barrier(self) -> None:
        self._run("barrier", _dist().barrier)

    def _cache(self) -> dict[tuple[int, ...], BaseGroup]:
        return _GROUPS

    def _create(self, ranks: tuple[int, ...], rank: int) -> GlooGroup:
        try:
            pg = _dist().new_group(
                list(ranks),
                timeout=timedelta(seconds=self._timeout),
                backend="gloo",
                use_local_synchronization=True,
            )
        except (RuntimeError, ValueError) as e:
            raise CommError(f"gloo new_group({list(ranks)}) failed: {e}") from e
        return GlooGroup(pg, ranks, rank, self._timeout)


def init_gloo(rank: int, world_size: int, master_addr: str, master_port: int, timeout: float) -> GlooGroup:
    """Join (or adopt an existing) torch.distributed gloo world; ``timeout`` (seconds) bounds the
    rendezvous and every collective, so a dead peer raises instead of hanging."""
    dist = _dist()
    if not dist.is_available():
        raise CommError("this torch build has no torch.distributed; the gloo backend needs it")
    if dist.is_initialized():
        if dist.get_backend() != "gloo":
            raise CommError(f"torch.distributed is already initialised with {dist.get_backend()}")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        host = f"[{master_addr}]" if ":" in master_addr else master_addr
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{host}:{master_port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout),
            )
        except (RuntimeError, ValueError) as e:
            where = f"{master_addr}:{master_port}"
            raise CommError(f"gloo rendezvous at {where} failed for rank {rank} of {world_size}: {e}") from e
    world = GlooGroup(None, range(world_size), rank, timeout)
    _GROUPS.clear()
    _GROUPS[world.ranks] = world
    return world


def destroy_gloo() -> None:
    """Tear down torch.distributed (all groups); safe to call when not initialised."""
    _GROUPS.clear()
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
