"""Reading the rank environment that a launcher leaves for each process.

Two conventions are understood:

* torchrun style (also what :func:`ms_layout.comm.launcher.run_local` sets):
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
* msrun (MindSpore's launcher): ``MS_ROLE`` (``MS_SCHED`` or ``MS_WORKER``), ``MS_WORKER_NUM``,
  ``MS_SCHED_HOST``, ``MS_SCHED_PORT``, ``MS_NODE_ID``/``RANK_ID`` and ``DEVICE_ID`` (the local
  index). msrun also runs the *same script* as a scheduler process (``MS_ROLE=MS_SCHED``) which
  does no work of its own: ``RankEnv.is_scheduler`` tells ``init()`` to serve that role.
  The gloo backend cannot share MindSpore's scheduler port, so under msrun its rendezvous
  store listens on ``MS_SCHED_PORT + 1`` on ``MS_SCHED_HOST``.

Without either, the process is a world of one (rank 0) with a free local port.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from ms_layout.comm.protocol import CommArgumentError

#: the port offset, from msrun's scheduler port, of the gloo rendezvous store under msrun
GLOO_PORT_OFFSET_UNDER_MSRUN = 1

# Variables that mark a process as started by msrun. The local launcher removes them from its
# children so that a test run inside an msrun job does not mistake itself for an msrun worker.
MSRUN_VARS = (
    "MS_ROLE",
    "MS_WORKER_NUM",
    "MS_SCHED_HOST",
    "MS_SCHED_PORT",
    "MS_NODE_ID",
    "RANK_ID",
    "RANK_SIZE",
)


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in the job. ``rank`` is -1 when msrun left it to MindSpore to
    assign (multi-node msrun without ``--node_rank``); only the mindspore backend copes."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "msrun" | "single"
    role: str = "worker"  # "worker" | "scheduler" (msrun's MS_SCHED process)
    device_id: int | None = None
    sched_host: str | None = None
    sched_port: int | None = None

    @property
    def is_scheduler(self) -> bool:
        return self.role == "scheduler"

    @property
    def under_msrun(self) -> bool:
        return self.launcher == "msrun"


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise CommArgumentError(f"environment variable {name}={raw!r} is not an integer") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the usual race applies; callers retry on failure)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def read_env(environ: Mapping[str, str] | None = None) -> RankEnv:
    """Read the rank environment (``os.environ`` by default); see the module docstring."""
    env = os.environ if environ is None else environ
    if env.get("MS_ROLE") or (env.get("MS_WORKER_NUM") and env.get("MS_SCHED_HOST")):
        return _read_msrun(env)
    if env.get("RANK") is not None and env.get("WORLD_SIZE") is not None:
        return _read_torchrun(env)
    return RankEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        master_addr="127.0.0.1",
        master_port=free_port(),
        launcher="single",
        device_id=_int(env, "DEVICE_ID"),
    )


def _read_torchrun(env: Mapping[str, str]) -> RankEnv:
    rank = _int(env, "RANK")
    world = _int(env, "WORLD_SIZE")
    assert rank is not None and world is not None
    if world < 1:
        raise CommArgumentError(f"WORLD_SIZE={world} must be at least 1")
    if not 0 <= rank < world:
        raise CommArgumentError(f"RANK={rank} is out of range for WORLD_SIZE={world}")
    port = _int(env, "MASTER_PORT", 29500)
    assert port is not None
    return RankEnv(
        rank=rank,
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK", rank) or 0,
        master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
        master_port=port,
        launcher="torchrun",
        device_id=_int(env, "DEVICE_ID"),
    )


def _read_msrun(env: Mapping[str, str]) -> RankEnv:
    role = "scheduler" if env.get("MS_ROLE") == "MS_SCHED" else "worker"
    world = _int(env, "MS_WORKER_NUM")
    if world is None or world < 1:
        raise CommArgumentError(f"MS_WORKER_NUM={env.get('MS_WORKER_NUM')!r} must be at least 1")
    host = env.get("MS_SCHED_HOST") or "127.0.0.1"
    sched_port = _int(env, "MS_SCHED_PORT", 8118)
    assert sched_port is not None
    # msrun exports RANK_ID for workers whose rank it knows (single node, or --node_rank);
    # the scheduler gets RANK_ID=0, which means nothing for it.
    rank = -1 if role == "scheduler" else _int(env, "RANK_ID", _int(env, "MS_NODE_ID", -1))
    assert rank is not None
    if rank >= world:
        raise CommArgumentError(f"RANK_ID/MS_NODE_ID={rank} is out of range for MS_WORKER_NUM={world}")
    device_id = _int(env, "DEVICE_ID")
    local = _int(env, "LOCAL_RANK", device_id if device_id is not None else max(rank, 0))
    return RankEnv(
        rank=rank,
        world_size=world,
        local_rank=local or 0,
        master_addr=host,
        master_port=sched_port + GLOO_PORT_OFFSET_UNDER_MSRUN,
        launcher="msrun",
        role=role,
        device_id=device_id,
        sched_host=host,
        sched_port=sched_port,
    )
