"""The mindspore backend: on CPU (mccl) one 2-rank run checks what works against numpy and that
what mccl lacks is refused at once; the Ascend tests run only where an Ascend device is present."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ms_layout import comm
from ms_layout.comm import CommUnsupportedError, P2POp, ReduceOp
from ms_layout.comm.mindspore_backend import ascend_available
from ms_layout.testing import run_ranks  # noqa: F401  (also provided by the pytest plugin)

pytestmark = pytest.mark.needs_mindspore


def data(rank: int, shape=(2, 3), dtype=np.float32) -> np.ndarray:
    return (np.arange(int(np.prod(shape))).reshape(shape) * (rank + 1) + rank).astype(dtype)


def cpu_checks(g) -> dict:
    r, n = g.rank, g.size
    peer = 1 - r
    everyone = np.stack([data(i) for i in range(n)])
    for op, ref in [(ReduceOp.SUM, np.sum), (ReduceOp.MAX, np.max), (ReduceOp.AVG, np.mean)]:
        a = data(r)
        g.all_reduce(a, op=op)
        np.testing.assert_allclose(a, ref(everyone, axis=0), err_msg=str(op))
    ints = data(r, dtype=np.int32)
    g.all_reduce(ints, op="min")
    np.testing.assert_array_equal(ints, np.min([data(i, dtype=np.int32) for i in range(n)], 0))
    a = data(r)
    g.all_reduce(a, async_op=True).wait()
    np.testing.assert_allclose(a, everyone.sum(0))

    for axis in (0, 1):
        np.testing.assert_array_equal(g.all_gather(data(r), axis), np.concatenate(everyone, axis))
    b = data(r, dtype=np.float64)  # broadcast carries float64 (all_reduce does not)
    g.broadcast(b, src=1)
    np.testing.assert_array_equal(b, data(1, dtype=np.float64))

    got = np.zeros((2, 3), np.float32)
    if r == 0:
        g.send(data(0), dst=1)
        g.recv(got, src=1)
    else:
        g.recv(got, src=0)
        g.send(data(1), dst=0)
    np.testing.assert_array_equal(got, data(peer))
    got = np.zeros((2, 3), np.float32)
    works = [g.isend(data(r) * 2, peer), g.irecv(got, peer)]
    for w in works:
        w.wait()
    np.testing.assert_array_equal(got, data(peer) * 2)

    sub = g.new_group([0, 1])
    a = data(r)
    sub.all_reduce(a)
    np.testing.assert_allclose(a, everyone.sum(0))
    np.testing.assert_array_equal(sub.all_gather(data(r)), np.concatenate(everyone))

    refused = {}
    for name, call in [
        ("reduce_scatter", lambda: g.reduce_scatter(np.ones((2, 2), np.float32))),
        ("all_to_all", lambda: g.all_to_all(np.ones((2, 2), np.float32))),
        ("batch_isend_irecv", lambda: g.batch_isend_irecv([P2POp("send", data(r), peer)])),
        ("float64 all_reduce", lambda: g.all_reduce(np.ones(2))),
        ("tagged send", lambda: g.send(data(r), peer, tag=5)),
    ]:
        start = time.monotonic()
        with pytest.raises(CommUnsupportedError) as info:
            call()
        refused[name] = (str(info.value), time.monotonic() - start)
    a = data(r)  # nothing reached mccl, so the ring is still in step
    g.all_reduce(a)
    np.testing.assert_allclose(a, everyone.sum(0))
    g.barrier()
    comm.destroy()  # mccl cannot start twice in a process: init() after destroy() reuses it
    assert comm.init("mindspore") is g
    return {"rank": r, "backend": g.backend, "refused": refused}


def test_mindspore_cpu_2_ranks(run_ranks):  # noqa: F811
    if ascend_available():
        pytest.skip("checks MindSpore's CPU backend")
    results = run_ranks(cpu_checks, nprocs=2, backend="mindspore", timeout=120)
    assert [r["rank"] for r in results] == [0, 1]
    assert {r["backend"] for r in results} == {"mindspore"}
    for r in results:
        for name, (message, seconds) in r["refused"].items():
            assert seconds < 0.5, (name, seconds)
            assert "backend='gloo'" in message or "tag=0" in message, message
        msg = r["refused"]["reduce_scatter"][0]
        assert "reduce_scatter is not supported by MindSpore's CPU backend (mccl)" in msg


def ascend_checks(g) -> None:
    r, n = g.rank, g.size
    big = [data(i, (4, 3)) for i in range(n)]
    got = g.reduce_scatter(big[r])
    np.testing.assert_allclose(got, np.split(np.sum(big, 0), n)[r])
    got = g.all_to_all(data(r, (2, 4)), split_axis=1, concat_axis=0)
    want = np.concatenate([np.split(data(i, (2, 4)), n, axis=1)[r] for i in range(n)])
    np.testing.assert_array_equal(got, want)
    out = np.zeros((2, 3), np.float32)
    right, left = (r + 1) % n, (r - 1) % n
    for w in g.batch_isend_irecv([P2POp("send", data(r), right), P2POp("recv", out, left)]):
        w.wait()
    np.testing.assert_array_equal(out, data(left))


@pytest.mark.ascend
@pytest.mark.skipif("not ascend_available()")  # for runs without the plugin (which skips too)
def test_mindspore_ascend_ops(run_ranks):  # noqa: F811
    run_ranks(ascend_checks, nprocs=2, backend="mindspore", timeout=180)
