"""The gloo backend on 4 local ranks, every result checked against numpy.

Each spawned run packs many checks (starting 4 ranks costs seconds); a failing check raises inside
its rank and comes back as RankFailedError with the rank's traceback."""

from __future__ import annotations

import numpy as np
import pytest

from ms_layout import comm
from ms_layout.comm import CommArgumentError, CommError, P2POp, ReduceOp
from ms_layout.comm.env import free_port
from ms_layout.testing import run_ranks  # noqa: F401  (also provided by the pytest plugin)

pytestmark = pytest.mark.needs_torch

N = 4
REDUCE = {
    ReduceOp.SUM: lambda xs: np.sum(xs, axis=0),
    ReduceOp.MAX: lambda xs: np.max(xs, axis=0),
    ReduceOp.MIN: lambda xs: np.min(xs, axis=0),
    ReduceOp.PROD: lambda xs: np.prod(xs, axis=0),
    ReduceOp.AVG: lambda xs: np.mean(xs, axis=0),
}


def data(rank: int, shape: tuple[int, ...] = (4, 6), dtype: type = np.float64) -> np.ndarray:
    """Every rank can compute every other rank's input, hence the expected results."""
    n = int(np.prod(shape))
    return ((np.arange(n) % 7 + 1) * (rank + 1) + rank).reshape(shape).astype(dtype)


def expected_all_to_all(me: int, size: int, split_axis: int, concat_axis: int, shape) -> np.ndarray:
    chunks = [np.array_split(data(r, shape), size, axis=split_axis)[me] for r in range(size)]
    return np.concatenate(chunks, axis=concat_axis)


def collectives(g) -> dict:
    r, n = g.rank, g.size
    everyone = np.stack([data(i) for i in range(n)])
    for op, ref in REDUCE.items():
        a = data(r)
        assert g.all_reduce(a, op=op) is None
        np.testing.assert_allclose(a, ref(everyone), err_msg=str(op))
    ints = data(r, dtype=np.int64)
    g.all_reduce(ints, op="max")
    np.testing.assert_array_equal(ints, np.max([data(i, dtype=np.int64) for i in range(n)], 0))
    f32 = data(r, dtype=np.float32)
    g.all_reduce(f32)
    np.testing.assert_allclose(f32, everyone.sum(0).astype(np.float32), rtol=1e-6)

    for axis in (0, 1, -1):
        got = g.all_gather(data(r), axis=axis)
        np.testing.assert_array_equal(got, np.concatenate(list(everyone), axis=axis))

    big = [data(i, (8, 3)) for i in range(n)]
    got = g.reduce_scatter(big[r], op="sum", axis=0)
    np.testing.assert_allclose(got, np.split(np.sum(big, 0), n, axis=0)[r])
    wide = [data(i, (2, 8)) for i in range(n)]
    got = g.reduce_scatter(wide[r], op=ReduceOp.MAX, axis=1)
    np.testing.assert_array_equal(got, np.split(np.max(wide, 0), n, axis=1)[r])
    got = g.reduce_scatter(wide[r], op=ReduceOp.AVG, axis=1)
    np.testing.assert_allclose(got, np.split(np.mean(wide, 0), n, axis=1)[r])
    assert got.flags.c_contiguous

    for shape, split_axis, concat_axis in [
        ((8, 3), 0, 0),
        ((4, 8), 1, 0),
        ((8, 2), 0, 1),
        ((2, 3, 4), 2, 1),
    ]:
        got = g.all_to_all(data(r, shape), split_axis=split_axis, concat_axis=concat_axis)
        want = expected_all_to_all(r, n, split_axis, concat_axis, shape)
        np.testing.assert_array_equal(got, want, err_msg=f"{shape} {split_axis} {concat_axis}")

    b = data(r)
    g.broadcast(b, src=2)
    np.testing.assert_array_equal(b, data(2))
    b = np.zeros(5, np.int32) if r != 3 else np.arange(5, dtype=np.int32)
    work = g.broadcast(b, src=3, async_op=True)
    work.wait()
    np.testing.assert_array_equal(b, np.arange(5))

    a = data(r)
    work = g.all_reduce(a, op="avg", async_op=True)
    work.wait(timeout=30)
    assert work.is_completed()
    np.testing.assert_allclose(a, everyone.mean(0))
    g.barrier()
    return {"rank": r, "size": n, "ranks": g.ranks, "backend": g.backend}


def point_to_point(g) -> None:
    r, n = g.rank, g.size
    right, left = (r + 1) % n, (r - 1) % n
    # ring in both directions at once, told apart by tags
    from_left, from_right = np.zeros(6), np.zeros(6)
    works = [
        g.isend(data(r, (6,)), right, tag=1),
        g.isend(data(r, (6,)) * 10, left, tag=2),
        g.irecv(from_left, left, tag=1),
        g.irecv(from_right, right, tag=2),
    ]
    for w in works:
        w.wait()
    np.testing.assert_array_equal(from_left, data(left, (6,)))
    np.testing.assert_array_equal(from_right, data(right, (6,)) * 10)

    got = np.zeros((2, 3), np.float32)
    ops = [P2POp("send", data(r, (2, 3), np.float32), right), P2POp("recv", got, left)]
    for w in g.batch_isend_irecv(ops):
        w.wait()
    np.testing.assert_array_equal(got, data(left, (2, 3), np.float32))

    # blocking pairs 0<->1, 2<->3
    peer = r ^ 1
    buf = np.zeros(4, np.int64)
    if r % 2 == 0:
        g.send(np.full(4, r, np.int64), peer)
        g.recv(buf, peer)
    else:
        g.recv(buf, peer)
        g.send(np.full(4, r, np.int64), peer)
    np.testing.assert_array_equal(buf, np.full(4, peer))


def groups(g) -> dict:
    me = g.ranks[g.rank]
    low = g.new_group([0, 1])
    high = g.new_group([3, 2])  # ranks are sorted: group rank order is ascending global rank
    mine = low if me < 2 else high
    assert (low is None) == (me >= 2) and (high is None) == (me < 2)
    assert mine.ranks == ((0, 1) if me < 2 else (2, 3)) and mine.rank == me % 2

    out = {}
    for name, parts in [("halves", [[0, 1], [2, 3]]), ("strided", [[0, 2], [1, 3]])]:
        sub = g.split(parts)
        members = next(p for p in parts if me in p)
        assert sub.ranks == tuple(members) and sub.size == 2
        a = data(me)
        sub.all_reduce(a)
        np.testing.assert_array_equal(a, sum(data(m) for m in members))
        got = sub.all_gather(data(me), axis=1)
        np.testing.assert_array_equal(got, np.concatenate([data(m) for m in members], axis=1))
        got = sub.reduce_scatter(data(me, (4, 2)), op="min")
        want = np.split(np.min([data(m, (4, 2)) for m in members], 0), 2)[sub.rank]
        np.testing.assert_array_equal(got, want)
        got = sub.all_to_all(data(me, (2, 4)), split_axis=1, concat_axis=0)
        want = np.concatenate([np.split(data(m, (2, 4)), 2, axis=1)[sub.rank] for m in members])
        np.testing.assert_array_equal(got, want)
        b = data(me)
        sub.broadcast(b, src=1)  # group rank 1
        np.testing.assert_array_equal(b, data(members[1]))
        buf = np.zeros(3)
        if sub.rank == 0:
            sub.send(np.full(3, float(me)), dst=1, tag=4)
        else:
            sub.recv(buf, src=0, tag=4)
            np.testing.assert_array_equal(buf, np.full(3, float(members[0])))
        sub.barrier()
        assert g.split(parts) is sub  # cached: same ranks, same group
        # a group of a group: collective over `sub`; only its first member is in the new one
        solo = sub.new_group([members[0]])
        assert (solo is None) == (me != members[0])
        if solo is not None:
            s = data(me)
            solo.all_reduce(s)
            np.testing.assert_array_equal(s, data(me))
        with pytest.raises(CommArgumentError, match="not members"):
            sub.new_group([0, 1, 2, 3])
        out[name] = sub.ranks
    return out


def test_collectives_4_ranks(run_ranks):  # noqa: F811
    results = run_ranks(collectives, nprocs=N, backend="gloo", timeout=90)
    assert [r["rank"] for r in results] == list(range(N))
    assert all(r["size"] == N and r["ranks"] == (0, 1, 2, 3) for r in results)
    assert {r["backend"] for r in results} == {"gloo"}


def test_point_to_point_and_groups_4_ranks(run_ranks):  # noqa: F811
    results = run_ranks(_p2p_and_groups, nprocs=N, backend="gloo", timeout=90)
    assert [r["halves"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["strided"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]


def _p2p_and_groups(g) -> dict:
    point_to_point(g)
    return groups(g)


def test_world_of_one_in_process():
    g = comm.init_process_group("gloo", rank=0, world_size=1, master_port=free_port(), timeout=30)
    try:
        assert comm.world() is g and comm.init("gloo") is g and (g.rank, g.size) == (0, 1)
        with pytest.raises(CommError, match="already initialised with backend 'gloo'"):
            comm.init_process_group("mindspore", rank=0, world_size=1)
        a = data(0)
        g.all_reduce(a, op="avg")
        np.testing.assert_array_equal(a, data(0))
        np.testing.assert_array_equal(g.all_gather(data(0), axis=1), data(0))
        np.testing.assert_array_equal(g.reduce_scatter(data(0), axis=1), data(0))
        np.testing.assert_array_equal(g.all_to_all(data(0), 1, 0), data(0))
        assert g.new_group([0]) is g and g.split([[0]]) is g
    finally:
        comm.destroy()
    with pytest.raises(CommError, match="not initialised"):
        comm.world()
