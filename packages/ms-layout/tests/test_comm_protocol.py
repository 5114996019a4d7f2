"""ms_layout.comm without any framework: argument checks, layout helpers, the rank environment,
the capability table. Nothing here imports torch or MindSpore (the core test variant runs it)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from ms_layout import comm
from ms_layout.comm import CommArgumentError, CommError, CommUnsupportedError, P2POp, ReduceOp
from ms_layout.comm.env import read_env
from ms_layout.comm.gloo import GlooGroup
from ms_layout.comm.mindspore_backend import CAPABILITIES, MindSporeGroup
from ms_layout.comm.protocol import (
    ProcessGroup,
    all_to_all_result,
    concat_gathered,
    split_axis_first,
)


def _gloo(rank: int = 0, size: int = 4) -> GlooGroup:
    # A group object with no torch behind it: every check below fails before torch is needed.
    return GlooGroup(None, range(size), rank, timeout=10.0)


def _ms_cpu(rank: int = 0, size: int = 2) -> MindSporeGroup:
    return MindSporeGroup("mccl_world_group", range(size), rank, "CPU")


def test_no_framework_imported_by_the_checks():
    g = _gloo()
    with pytest.raises(CommArgumentError):
        g.all_reduce(np.ones((4, 4))[:, 0])
    assert isinstance(g, ProcessGroup) and isinstance(_ms_cpu(), ProcessGroup)


def test_reduce_op_parse():
    assert ReduceOp.parse("MAX") is ReduceOp.MAX
    assert ReduceOp.parse(ReduceOp.AVG) is ReduceOp.AVG
    with pytest.raises(CommArgumentError, match="'median'"):
        ReduceOp.parse("median")
    with pytest.raises(ValueError, match="sum, max, min, prod, avg"):
        _gloo().all_reduce(np.ones(3), op="median")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda g: g.all_reduce(np.ones((4, 4))[:, 1]), "C-contiguous"),
        (lambda g: g.all_reduce([1.0, 2.0]), "numpy.ndarray, got list"),
        (lambda g: g.all_reduce(np.ones(3, np.int32), op="avg"), "AVG needs a floating dtype"),
        (lambda g: g.reduce_scatter(np.ones((6, 2)), axis=0), "length 6.*group size 4"),
        (lambda g: g.all_to_all(np.ones((4, 3)), split_axis=1), "length 3.*group size 4"),
        (lambda g: g.all_gather(np.ones((2, 2)), axis=2), "axis=2 is out of range"),
        (lambda g: g.all_to_all(np.ones((4, 4)), concat_axis="0"), "concat_axis must be an int"),
        (lambda g: g.broadcast(np.ones(2), src=4), "src=4 is out of range for a group of size 4"),
        (lambda g: g.send(np.ones(2), dst=-1), "dst=-1 is out of range"),
        (lambda g: g.send(np.ones(2), dst=0), "dst=0 is this rank"),
        (lambda g: g.recv(np.ones(2), src=1.0), "src must be an int group rank, got 1.0"),
        (lambda g: g.isend(np.ones(2), dst=1, tag=-3), "tag must be a non-negative int, got -3"),
        (lambda g: g.batch_isend_irecv([("send", np.ones(2), 1)]), "expected P2POp"),
        (lambda g: g.new_group([0, 7]), r"ranks \[7\] are not members"),
        (lambda g: g.new_group([1, 1]), "duplicates"),
        (lambda g: g.split([[0, 1], [1, 2, 3]]), "rank 1 is in group 0 and group 1"),
        (lambda g: g.split([[0, 1], [2]]), r"ranks \[3\] of this group are in none"),
    ],
)
def test_bad_arguments_name_the_value(call, match):
    with pytest.raises(CommArgumentError, match=match) as info:
        call(_gloo())
    assert isinstance(info.value, ValueError) and isinstance(info.value, CommError)


def test_read_only_buffer_refused_for_in_place_ops():
    a = np.ones(4)
    a.flags.writeable = False
    with pytest.raises(CommArgumentError, match="read-only"):
        _gloo().all_reduce(a)
    with pytest.raises(CommArgumentError, match="read-only"):
        _gloo(rank=1).recv(a, src=0)


def test_unsupported_dtype_names_it():
    with pytest.raises(CommUnsupportedError, match="dtype int16 is not supported by the gloo"):
        _gloo().all_reduce(np.ones(3, np.int16))
    with pytest.raises(CommUnsupportedError, match="float64.*mccl on CPU.*backend='gloo'"):
        _ms_cpu().all_reduce(np.ones(3, np.float64))


def test_p2pop_kind():
    with pytest.raises(CommArgumentError, match="'put'"):
        P2POp("put", np.ones(2), 1)


@pytest.mark.parametrize("op", ["reduce_scatter", "all_to_all", "batch_isend_irecv"])
def test_mindspore_cpu_refuses_missing_ops_at_once(op):
    g = _ms_cpu()
    call = {
        "reduce_scatter": lambda: g.reduce_scatter(np.ones(4, np.float32)),
        "all_to_all": lambda: g.all_to_all(np.ones(4, np.float32)),
        "batch_isend_irecv": lambda: g.batch_isend_irecv([P2POp("send", np.ones(2), 1)]),
    }[op]
    with pytest.raises(CommUnsupportedError, match=f"{op} is not supported by MindSpore's CPU"):
        call()
    assert op in CAPABILITIES["CPU"].unsupported and not CAPABILITIES["Ascend"].unsupported


def test_mindspore_refuses_tags():
    with pytest.raises(CommUnsupportedError, match="tag=3.*ignores message tags"):
        _ms_cpu().send(np.ones(2, np.float32), dst=1, tag=3)


def test_layout_helpers_match_numpy():
    rng = np.random.default_rng(0)
    size = 3
    xs = [rng.standard_normal((6, 4, 3)) for _ in range(size)]
    stacked = np.stack(xs)
    for axis in range(3):
        np.testing.assert_array_equal(concat_gathered(stacked, axis), np.concatenate(xs, axis))
    # all_to_all: received chunk i comes from rank i; simulate with numpy on rank 1
    for split_axis, concat_axis in [(0, 0), (0, 1), (2, 0), (1, 2)]:
        sizes = [x.shape[split_axis] for x in xs]
        if any(s % size for s in sizes):
            xs_ = [np.concatenate([x] * size, axis=split_axis) for x in xs]
        else:
            xs_ = xs
        me = 1
        outs = [split_axis_first(x, split_axis) for x in xs_]
        n = outs[0].shape[0] // size
        out = np.concatenate([o[me * n : (me + 1) * n] for o in outs])
        want = np.concatenate([np.array_split(x, size, axis=split_axis)[me] for x in xs_], axis=concat_axis)
        np.testing.assert_array_equal(all_to_all_result(out, size, split_axis, concat_axis), want)


def test_read_env_torchrun():
    env = read_env({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "7"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (
        2,
        4,
        2,
        "10.0.0.1",
        7,
    )
    assert env.launcher == "torchrun" and not env.is_scheduler


def test_read_env_msrun_worker_and_scheduler():
    base = {"MS_WORKER_NUM": "2", "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "8118"}
    worker = read_env({**base, "MS_ROLE": "MS_WORKER", "RANK_ID": "1", "DEVICE_ID": "1"})
    assert (worker.rank, worker.world_size, worker.local_rank, worker.device_id) == (1, 2, 1, 1)
    assert (worker.master_addr, worker.master_port, worker.under_msrun) == ("127.0.0.1", 8119, True)
    sched = read_env({**base, "MS_ROLE": "MS_SCHED", "RANK_ID": "0"})
    assert sched.is_scheduler and sched.rank == -1
    unknown = read_env({**base, "MS_ROLE": "MS_WORKER"})  # multi-node msrun without --node_rank
    assert unknown.rank == -1


def test_read_env_single_and_errors():
    single = read_env({})
    assert (single.rank, single.world_size, single.launcher) == (0, 1, "single")
    with pytest.raises(CommArgumentError, match="RANK='x' is not an integer"):
        read_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(CommArgumentError, match="RANK=5 is out of range for WORLD_SIZE=2"):
        read_env({"RANK": "5", "WORLD_SIZE": "2"})


def test_init_arguments():
    with pytest.raises(CommArgumentError, match="'nccl'"):
        comm.init("nccl")
    with pytest.raises(CommArgumentError, match="timeout"):
        comm.init("gloo", timeout=0)
    with pytest.raises(CommArgumentError, match="rank=3 is out of range for world_size=2"):
        comm.init_process_group("gloo", rank=3, world_size=2)
    with pytest.raises(CommError, match="not initialised"):
        comm.world()
    assert not comm.is_initialized()


def test_run_local_arguments():
    with pytest.raises(CommArgumentError, match="nprocs must be a positive int, got 0"):
        comm.run_local(print, 0)
    with pytest.raises(CommArgumentError, match="'nccl'"):
        comm.run_local(print, 2, backend="nccl")


def test_available_backends():
    names = comm.available_backends()
    assert ("gloo" in names) == (importlib.util.find_spec("torch") is not None)
    assert ("mindspore" in names) == (importlib.util.find_spec("mindspore") is not None)
