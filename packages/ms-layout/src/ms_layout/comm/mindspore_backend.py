"""ProcessGroup on MindSpore's ``mint.distributed``: HCCL on Ascend, mccl on CPU.

MindSpore 2.10's CPU backend (mccl) lacks several operations and dtypes, and a failed mccl op can
leave the peers' ring out of step (a later collective then hangs or reads the wrong message).
So everything the CPU backend cannot do is refused *before* calling MindSpore, from the table
``CAPABILITIES`` (measured on 2 CPU ranks; see docs/mindspore-cpu.md §2.2).

Other facts this module relies on (measured):
* ``Tensor.from_numpy`` shares memory and the CPU ops write into it, but PyNative runs them
  asynchronously: the numpy buffer is only valid after a sync, so every op ends with
  ``asnumpy()`` (which also copies back on Ascend, where the result lives on the device).
* ``send``/``recv`` default to the group ``hccl_world_group`` (bound at import time), which does
  not exist on CPU: ``_patch_default_group`` repoints the defaults after init.
* Groups are created by their members only (MindSpore's rule); mccl ignores message tags, so a
  non-zero tag is refused rather than silently matched in arrival order.
mindspore is imported lazily (it takes seconds), so importing this module is cheap.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import numpy as np

from ms_layout.comm.base import BaseGroup
from ms_layout.comm.env import RankEnv
from ms_layout.comm.protocol import CommUnsupportedError, ReduceOp, Work
from ms_layout.errors import CommError


def _dtypes(*names: str) -> frozenset[np.dtype]:
    return frozenset(np.dtype(n) for n in names)


@dataclass(frozen=True)
class Capabilities:
    """What one device target's MindSpore communication can do."""

    unsupported: dict  # op name -> why (the kernel MindSpore lacks)
    move_dtypes: frozenset  # dtypes all_gather/broadcast/send/recv carry
    reduce_dtypes: frozenset  # dtypes all_reduce/reduce_scatter reduce
    fused_all_gather: bool  # all_gather_into_tensor exists (else the list form)
    tags: bool  # point-to-point honours tags


_MCCL_MISSING = "is not supported by MindSpore's CPU backend (mccl): kernel {} is unregistered"
CAPABILITIES: dict[str, Capabilities] = {
    "CPU": Capabilities(
        unsupported={
            "reduce_scatter": _MCCL_MISSING.format("DistCommReduceScatterTensor"),
            "all_to_all": _MCCL_MISSING.format("DistCommAllToAllVSingle"),
            "batch_isend_irecv": _MCCL_MISSING.format("DistCommBatchIsendIrecv"),
        },
        # int16 and bool fail in AllGather/Broadcast ("AllGather failed.") and desync the ring
        move_dtypes=_dtypes("float16", "float32", "float64", "int8", "uint8", "int32", "int64"),
        # float64, uint8 and bool fail with "AllReduce failed."; all five ReduceOps work
        reduce_dtypes=_dtypes("float16", "float32", "int8", "int16", "int32", "int64"),
        fused_all_gather=False,  # DistCommAllGatherIntoTensor is unregistered on CPU
        tags=False,  # measured: recv(tag=7) received the tag-5 message sent first
    ),
    # Ascend: not measured here (no device); the dtypes are those HCCL documents for its collectives
    "Ascend": Capabilities(
        unsupported={},
        move_dtypes=_dtypes("float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool"),
        reduce_dtypes=_dtypes("float16", "float32", "int8", "int16", "int32", "int64"),
        fused_all_gather=True,
        tags=False,  # mint.distributed documents tag as reserved; P2POp rejects tag != 0
    ),
}

_STATE: dict[str, Any] = {}  # the TCPStore must outlive init; group cache by ranks


def ascend_available() -> bool:
    """Cheap capability check: mindspore importable and an Ascend device present. mindspore is
    imported only when the device hints are there (it costs seconds on a CPU-only machine)."""
    if importlib.util.find_spec("mindspore") is None:
        return False
    if "mindspore" not in sys.modules:
        hints = glob.glob("/dev/davinci[0-9]*") or os.environ.get("ASCEND_HOME_PATH")
        if not hints:
            return False
    import mindspore

    return mindspore.get_context("device_target") == "Ascend"


def _md() -> Any:
    import mindspore.mint.distributed as md

    return md


def serve_scheduler() -> None:
    """msrun's scheduler process (MS_ROLE=MS_SCHED) runs the user script too; MindSpore's
    ``init()`` serves that role and exits the process when the job ends (it never returns)."""
    from mindspore.communication import init as ms_init

    ms_init()
    sys.exit(0)


def _patch_default_group() -> None:
    """mint.distributed's send/recv call get_cache_group_rank() whose default group was bound
    at import to "hccl_world_group"; on CPU that group does not exist. Repoint it if needed."""
    from mindspore.communication import GlobalComm

    mdd = importlib.import_module("mindspore.mint.distributed.distributed")
    world = GlobalComm.WORLD_COMM_GROUP
    for fn in (mdd.get_cache_group_rank, mdd.get_cache_group_size):
        if fn.__defaults__ != (world,):
            fn.__defaults__ = (world,)


def init_mindspore(env: RankEnv, timeout: float) -> MindSporeGroup:
    """Initialise MindSpore communication: under msrun with plain ``init()``; otherwise (a
    torchrun-style environment, as run_local sets) without a scheduler, through a TCPStore."""
    if env.is_scheduler:
        serve_scheduler()
    if "world" in _STATE:  # mccl cannot be initialised twice: after destroy(), reuse it
        _STATE["groups"] = {_STATE["world"].ranks: _STATE["world"]}
        return _STATE["world"]
    import mindspore as ms
    from mindspore.communication import GlobalComm, get_group_size, get_rank
    from mindspore.communication import init as ms_init
    from mindspore.communication.management import _init_with_store  # private, see docstring

    target = ms.get_context("device_target")
    md = _md()
    try:
        if env.under_msrun:
            ms_init()
        else:
            if target == "Ascend":
                ms.set_device("Ascend", env.device_id if env.device_id is not None else env.local_rank)
            delta = timedelta(seconds=timeout)
            store = md.TCPStore(
                env.master_addr,
                env.master_port,
                world_size=env.world_size,
                is_master=env.rank == 0,
                timeout=delta,
            )
            _STATE["store"] = store
            backend = "hccl" if target == "Ascend" else "mccl"
            _init_with_store(
                backend=backend,
                timeout=delta,
                world_size=env.world_size,
                rank=env.rank,
                store=store,
            )
    except (RuntimeError, ValueError) as e:
        raise CommError(
            f"MindSpore communication init failed for rank {env.rank} of {env.world_size}"
            f" ({env.launcher}, {env.master_addr}:{env.master_port}): {e}"
        ) from e
    _patch_default_group()
    size = get_group_size()
    world = MindSporeGroup(GlobalComm.WORLD_COMM_GROUP, tuple(range(size)), get_rank(), target)
    _STATE["groups"] = {world.ranks: world}
    if target != "Ascend":
        _STATE["world"] = world
    return world


def destroy_mindspore() -> None:
    """Forget our groups. mccl cannot be initialised twice in a process, so on CPU the
    communicator stays up until exit (a later init() reuses it); on Ascend it is destroyed."""
    _STATE.pop("groups", None)
    if "mindspore" in sys.modules:
        import mindspore as ms

        if ms.get_context("device_target") == "Ascend":
            _md().destroy_process_group()


class MindSporeWork:
    """A MindSpore CommHandle. MindSpore handles cannot be polled or waited with a timeout:
    ``is_completed`` turns True after ``wait``; the collective timeout set at init applies."""

    def __init__(self, handle: Any, what: str, finish: Callable[[], None]):
        self._handle, self._what, self._finish = handle, what, finish
        self._done = False

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        try:
            if self._handle is not None:
                self._handle.wait()
        except (RuntimeError, TypeError, ValueError) as e:
            raise CommError(f"{self._what} failed: {e}") from e
        self._finish()  # syncs (PyNative surfaces errors there) and copies results back
        self._done = True

    def is_completed(self) -> bool:
        return self._done


class MindSporeGroup(BaseGroup):
    """A MindSpore communication group (by name); see the ProcessGroup protocol for the contract."""

    backend = "mindspore"

    def __init__(self, name: str, ranks: Any, rank: int, target: str):
        super().__init__(ranks, rank)
        self.name = name
        self.target = target
        self.caps = CAPABILITIES.get(target, CAPABILITIES["CPU"])  # unknown targets: the strict one
        self.move_dtypes = self.caps.move_dtypes
        self.reduce_dtypes = self.caps.reduce_dtypes
        self.supports_tags = self.caps.tags
        self.dtype_hint = "" if target == "Ascend" else "; use backend='gloo' on CPU"
        self._comm = "hccl" if target == "Ascend" else "mccl"

    def backend_label(self) -> str:
        return f"mindspore ({self._comm} on {self.target})"

    def _require(self, op: str) -> None:
        why = self.caps.unsupported.get(op)
        if why is not None:
            raise CommUnsupportedError(f"{op} {why}; use backend='gloo' on CPU")

    def _run(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError) as e:
            where = f"rank {self.rank} of {list(self.ranks)}"
            raise CommError(f"mindspore {what} failed on {where}: {e}") from e

    def _finish(self, what: str, pairs: list[tuple[Any, np.ndarray]]) -> None:
        """Sync each tensor (PyNative runs ops asynchronously) and make sure its result is in
        the numpy buffer: on CPU it already is (shared memory), on Ascend it is copied back."""
        for t, array in pairs:
            res = self._run(what, t.asnumpy)
            if array.flags.writeable and not np.may_share_memory(res, array):
                np.copyto(array, res.reshape(array.shape))

    def _handle(self, what: str, handle: Any, pairs: list, async_op: bool) -> Work | None:
        finish = lambda: self._finish(what, pairs)  # noqa: E731
        if async_op:
            return MindSporeWork(handle, f"mindspore {what}", finish)
        finish()
        return None

    @staticmethod
    def _tensor(array: np.ndarray) -> Any:
        import mindspore as ms

        return ms.Tensor.from_numpy(array)

    def _all_reduce(self, array: np.ndarray, op: ReduceOp, async_op: bool) -> Work | None:
        t = self._tensor(array)  # mint.distributed does AVG itself (measured on CPU)
        h = self._run("all_reduce", _md().all_reduce, t, op.value, self.name, async_op)
        return self._handle("all_reduce", h, [(t, array)], async_op)

    def _all_gather(self, array: np.ndarray, out: np.ndarray) -> None:
        md, src = _md(), self._tensor(array)
        if self.caps.fused_all_gather:
            flat = out.reshape((-1,) + array.shape[1:])
            t = self._tensor(flat)
            self._run("all_gather", md.all_gather_into_tensor, t, src, self.name)
            self._finish("all_gather", [(t, flat)])
        else:
            outs = [self._tensor(out[i]) for i in range(self.size)]
            self._run("all_gather", md.all_gather, outs, src, self.name)
            self._finish("all_gather", list(zip(outs, out)))

    def _reduce_scatter(self, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        t, md = self._tensor(out), _md()
        self._run("reduce_scatter", md.reduce_scatter_tensor, t, self._tensor(src), op.value, self.name)
        self._finish("reduce_scatter", [(t, out)])

    def _all_to_all(self, src: np.ndarray, out: np.ndarray) -> None:
        t = self._tensor(out)
        self._run("all_to_all", _md().all_to_all_single, t, self._tensor(src), group=self.name)
        self._finish("all_to_all", [(t, out)])

    def _broadcast(self, array: np.ndarray, src: int, async_op: bool) -> Work | None:
        t = self._tensor(array)
        h = self._run("broadcast", _md().broadcast, t, src, self.name, async_op)
        return self._handle("broadcast", h, [(t, array)], async_op)

    def _p2p(self, kind: str, array: np.ndarray, peer: int, tag: int, async_op: bool) -> Any:
        md = _md()
        name = ("i" if async_op else "") + kind
        fn = {"send": md.send, "recv": md.recv, "isend": md.isend, "irecv": md.irecv}[name]
        t = self._tensor(array)
        h = self._run(name, fn, t, peer, self.name, tag)
        # a sync send also syncs: the caller may overwrite the buffer once send returns
        return self._handle(name, h, [(t, array)], async_op)

    def _batch(self, items: list[tuple[str, np.ndarray, int, int]]) -> list[Work]:
        md, p2p, pairs = _md(), [], []
        for kind, array, peer, _tag in items:  # tags were refused already
            t = self._tensor(array)
            p2p.append(md.P2POp("i" + kind, t, peer, group=self.name))
            pairs.append((t, array))
        handles = self._run("batch_isend_irecv", md.batch_isend_irecv, p2p)
        # MindSpore returns one handle for the whole batch; every op shares it
        handle = handles[0] if handles else None
        work = self._handle("batch_isend_irecv", handle, pairs, True)
        return [work] * len(items)

    def barrier(self) -> None:
        self._run("barrier", _md().barrier, group=self.name)

    def _cache(self) -> dict[tuple[int, ...], BaseGroup]:
        return _STATE.setdefault("groups", {})

    def _create(self, ranks: tuple[int, ...], rank: int) -> MindSporeGroup:
        name = self._run("new_group", _md().new_group, list(ranks), backend=self._comm)
        if not name:
            raise CommError(f"mindspore new_group({list(ranks)}) failed (see MindSpore's log)")
        return MindSporeGroup(name, ranks, rank, self.target)
