"""Process groups for ms-layout: one small protocol, two backends.

* ``gloo``: torch.distributed's gloo collectives on CPU -- every operation.
* ``mindspore``: MindSpore's ``mint.distributed`` -- HCCL on Ascend; on CPU (mccl) it lacks
  reduce_scatter, all_to_all, batched point-to-point and some dtypes, which raise
  :class:`CommUnsupportedError` at once.

Numpy arrays are the currency; see :mod:`ms_layout.comm.protocol`. Typical use::

    from ms_layout import comm
    world = comm.init()                      # rank environment from torchrun / msrun / run_local
    world.all_reduce(grad)                   # in place, numpy
    tp = world.split([[0, 1], [2, 3]])       # every member calls; returns this rank's group

Under msrun, the scheduler process (``MS_ROLE=MS_SCHED``) runs the same script: ``init()`` there
never returns. With the mindspore backend it serves msrun's scheduler role through
``mindspore.communication.init()``; with gloo it exits at once with status 0, because the gloo
workers never register with MindSpore's scheduler, which then fails the job after
``--cluster_time_out`` (measured: msrun rc=1 after the timeout; with the early exit rc=0).
gloo's rendezvous store then listens on ``MS_SCHED_HOST:MS_SCHED_PORT+1``.
"""

from __future__ import annotations

import atexit
import importlib.util
import sys

from ms_layout.comm.env import RankEnv, read_env
from ms_layout.comm.launcher import launch_from_env, run_local
from ms_layout.comm.protocol import (
    CommArgumentError,
    CommUnsupportedError,
    P2POp,
    ProcessGroup,
    ReduceOp,
    Work,
)
from ms_layout.errors import CommError, RankFailedError

__all__ = [
    "BACKENDS",
    "CommArgumentError",
    "CommError",
    "CommUnsupportedError",
    "P2POp",
    "ProcessGroup",
    "RankEnv",
    "RankFailedError",
    "ReduceOp",
    "Work",
    "available_backends",
    "destroy",
    "init",
    "init_process_group",
    "is_initialized",
    "launch_from_env",
    "read_env",
    "resolve_backend",
    "run_local",
    "world",
]

BACKENDS = ("gloo", "mindspore")
DEFAULT_PORT = 29500

_WORLD: ProcessGroup | None = None


def available_backends() -> list[str]:
    """Backends whose library is installed (checked without importing torch or mindspore)."""
    found = []
    if importlib.util.find_spec("torch") is not None:
        found.append("gloo")
    if importlib.util.find_spec("mindspore") is not None:
        found.append("mindspore")
    return found


def resolve_backend(backend: str) -> str:
    """``"auto"`` is mindspore where an Ascend device is present, else gloo."""
    if backend == "auto":
        from ms_layout.comm.mindspore_backend import ascend_available

        return "mindspore" if ascend_available() else "gloo"
    if backend not in BACKENDS:
        raise CommArgumentError(f"unknown backend {backend!r}; expected 'auto', 'gloo' or 'mindspore'")
    return backend


def _check_timeout(timeout: float) -> float:
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise CommArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _start(backend: str, env: RankEnv, timeout: float) -> ProcessGroup:
    global _WORLD
    if _WORLD is not None:
        if _WORLD.backend == backend:
            return _WORLD
        raise CommError(f"already initialised with backend {_WORLD.backend!r}; call destroy() first")
    if backend == "gloo":
        if env.is_scheduler:  # see the module docstring: nobody needs msrun's scheduler
            sys.exit(0)
        if env.rank < 0:
            raise CommError(
                "msrun did not export RANK_ID (multi-node without --node_rank); the gloo backend"
                " needs each worker's rank up front: pass --node_rank to msrun"
            )
        from ms_layout.comm.gloo import init_gloo

        _WORLD = init_gloo(env.rank, env.world_size, env.master_addr, env.master_port, timeout)
        _destroy_at_exit()
    else:
        from ms_layout.comm.mindspore_backend import init_mindspore

        _WORLD = init_mindspore(env, timeout)
    return _WORLD


_AT_EXIT = []


def _destroy_at_exit() -> None:
    """Tear a gloo world down when the interpreter exits, if the program did not: a process that
    exits with torch.distributed's gloo threads still alive can die in C++ (std::terminate,
    "terminate called without an active exception", exit -6), seen under msrun after every
    rank had written its results."""
    if _AT_EXIT:
        return

    def tear_down() -> None:
        if _WORLD is not None and _WORLD.backend == "gloo":
            try:
                destroy()
            except Exception:  # exiting anyway; a peer may be gone
                pass

    atexit.register(tear_down)
    _AT_EXIT.append(tear_down)


def init(backend: str = "auto", *, timeout: float = 300.0) -> ProcessGroup:
    """The world group, from the rank environment (:func:`ms_layout.comm.env.read_env`).
    ``timeout`` (seconds) bounds the rendezvous and each collective. Idempotent."""
    return _start(resolve_backend(backend), read_env(), _check_timeout(timeout))


def init_process_group(
    backend: str,
    rank: int,
    world_size: int,
    master_addr: str = "127.0.0.1",
    master_port: int = DEFAULT_PORT,
    timeout: float = 300.0,
) -> ProcessGroup:
    """The world group from explicit coordinates (rank 0 hosts the store at the address)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise CommArgumentError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise CommArgumentError(f"rank={rank!r} is out of range for world_size={world_size}")
    if not isinstance(master_port, int) or not 0 < master_port < 65536:
        raise CommArgumentError(f"master_port={master_port!r} is not a valid TCP port")
    env = RankEnv(rank, world_size, rank, master_addr, master_port, launcher="explicit")
    return _start(resolve_backend(backend), env, _check_timeout(timeout))


def is_initialized() -> bool:
    return _WORLD is not None


def world() -> ProcessGroup:
    """The world group made by :func:`init`; CommError if there is none yet."""
    if _WORLD is None:
        raise CommError("ms_layout.comm is not initialised: call ms_layout.comm.init() first")
    return _WORLD


def destroy() -> None:
    """Drop the world and its groups (gloo: tears down torch.distributed). On MindSpore's CPU
    backend the communicator lives until exit, since mccl cannot be initialised twice."""
    global _WORLD
    backend, _WORLD = (_WORLD.backend if _WORLD is not None else None), None
    if backend == "gloo":
        from ms_layout.comm.gloo import destroy_gloo

        destroy_gloo()
    elif backend == "mindspore":
        from ms_layout.comm.mindspore_backend import destroy_mindspore

        destroy_mindspore()
