"""The online executors on 4 local CPU ranks over gloo, bit-exact against the global weights.

Kept to two launches (the machine has 2 cores): one runs a set of tensor plans through the numpy
executor -- all-gather, all-to-all, rounds under a memory cap, disjoint rank sets, collectives off,
int16 (which gloo cannot move) as raw bits, multicast rows -- the other reshards MindSpore Parameters
of a tiny Llama from dp=2,tp=2 with optimizer sharding to tp=4 (fused qkv/gate_up), and from pp=2 x tp=2
to tp=2 on 2 ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_llama import expected_shard, llama_shapes, random_weights

from ms_layout import Layout, ParallelConfig
from ms_reshard import DEFAULT_FUSIONS, model_plan, param_specs, plan

L4 = Layout((4,), ("tp",))
L22 = Layout((2, 2), ("dp", "tp"))
CASES = [
    # (src, dst, shape, plan kwargs, run kwargs)
    (L4("tp", "None"), L4("None", "tp"), (8, 8), {}, {}),  # all-to-all
    (L22("tp", "None"), L4("None", "None"), (8, 4), {}, {}),  # two all-gathers
    (L22("tp", "None"), L4("None", "None"), (8, 4), {}, {"collectives": False}),  # same, as p2p
    (L4("tp", "None"), L4("None", "tp"), (8, 8), {"mem_cap": 32}, {}),  # rounds
    # as point-to-point, boxes contiguous in the source shard only (and, reversed, the target only)
    (L4("None", "tp"), L4("tp", "None"), (8, 8), {}, {"collectives": False}),
    (L4("tp", "None"), L4("None", "tp"), (8, 8), {}, {"collectives": False}),
    (Layout((2,), ("tp",))("tp", "None"), Layout((2,), ("tp",), rank_list=(2, 3))("None", "tp"), (4, 6), {}, {}),
    (L22(("tp", "dp"), "None"), Layout((3,), ("x",), rank_list=(1, 2, 3))("None", "x"), (4, 6), {}, {}),
    (L22("tp", "None"), L4("None", "None"), (8, 4), {}, {"dtype": "int16"}),
    # multicast rows: one row per (piece, sender), spelled out as sends and receives per rank
    (Layout((2,), ("dp",))("dp", "None"), L4("None", "None"), (8, 4), {"multicast_min": 0}, {}),
    (L22(("tp", "dp"), "None"), L22("None", "tp"), (8, 4), {"multicast_min": 0}, {}),
]


MIXED = [
    (L4("None", "tp"), L4("tp", "None"), (8, 8)),
    (L4("tp", "None"), L4("None", "tp"), (8, 8)),
    (L22("tp", "None"), L4("None", "None"), (8, 4)),
]


def _global(shape, dtype="float32"):
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * 1.5 - 7
    return x.astype(dtype)


def rank_tensor_plans(group):
    from ms_reshard import exchange
    from ms_reshard.exchange import make_groups, run_plan

    assert group.ranks == (0, 1, 2, 3)

    me, results = group.rank, []
    # every case twice: contiguous boxes of any size as their own messages, then the default
    for k, (src, dst, shape, plan_kw, run_kw) in enumerate(CASES + CASES):
        exchange.DIRECT_BYTES = 0 if k < len(CASES) else 256 << 10
        run_kw = dict(run_kw)
        x = _global(shape, run_kw.pop("dtype", "float32"))
        p = plan(src, dst, shape, itemsize=x.dtype.itemsize, **plan_kw)
        s = np.ascontiguousarray(x[src.global_slice(shape, me)]) if me in src.ranks else None
        out = np.zeros(dst.shard_shape(shape), dtype=x.dtype) if me in dst.ranks else None
        groups = make_groups([p], group) if run_kw.get("collectives", True) else {}
        run_plan(p, group, s, out, groups, **run_kw)
        results.append(None if out is None else out.astype(np.float32))
    # Three plans in one bucket, so that a peer gets several boxes in one batch: contiguous in the
    # source shard only (MIXED[0]), in the target shard only ([1]), in both ([2]); with 16 B all
    # travel as own messages, with 32 B the first two share the per-peer message. Both ends must
    # agree on which message holds what.
    for direct in (16, 32):
        exchange.DIRECT_BYTES = direct
        items, outs = [], []
        for src, dst, shape in MIXED:
            x = _global(shape)
            s = np.ascontiguousarray(x[src.global_slice(shape, me)])
            outs.append(np.zeros(dst.shard_shape(shape), np.float32))
            items.append((plan(src, dst, shape), s, outs[-1], None))
        exchange.run_plans(items, group, collectives=False)
        results.append(outs)
    exchange.DIRECT_BYTES = 256 << 10
    return results


@pytest.mark.needs_torch
def test_tensor_plans_on_four_gloo_ranks(run_ranks):
    results = run_ranks(rank_tensor_plans, nprocs=4, backend="gloo", timeout=120)
    forced = [(s, d, shape, kw) for s, d, shape, kw, _ in CASES if kw.get("multicast_min") == 0]
    assert all(plan(s, d, shape, **kw).multicast is not None for s, d, shape, kw in forced)
    for k, (_, dst, shape, _, run_kw) in enumerate(CASES + CASES):
        x = _global(shape, run_kw.get("dtype", "float32")).astype(np.float32)
        for rank in range(4):
            got = results[rank][k]
            if rank in dst.ranks:
                np.testing.assert_array_equal(got, x[dst.global_slice(shape, rank)], err_msg=f"case {k} rank {rank}")
            else:
                assert got is None
    for k in range(2):  # the mixed buckets
        for rank in range(4):
            for (_, dst, shape), got in zip(MIXED, results[rank][len(CASES) * 2 + k]):
                np.testing.assert_array_equal(got, _global(shape)[dst.global_slice(shape, rank)], err_msg=f"{k} {rank}")


SCENARIOS = {
    "dp2_tp2_opt_to_tp4": (ParallelConfig(dp=2, tp=2, optimizer_shard=True), ParallelConfig(tp=4)),
    "pp2_tp2_to_tp2": (ParallelConfig(pp=2, tp=2), ParallelConfig(tp=2)),
}


def _specs(name):
    train, infer = SCENARIOS[name]
    shapes = llama_shapes(2)
    return (
        param_specs(shapes, train, num_layers=2),
        param_specs(shapes, infer, num_layers=2, fusions=DEFAULT_FUSIONS),
    )


def rank_mindspore_params(group):
    import mindspore as ms

    from ms_reshard.execute import reshard_parameters

    me, out = group.rank, {}
    weights = random_weights(llama_shapes(2), seed=7)
    for scenario in SCENARIOS:
        src_specs, dst_specs = _specs(scenario)
        mp = model_plan(src_specs, dst_specs)
        src = {
            n: ms.Parameter(ms.Tensor(weights[n][s.layout.global_slice(s.shape, me)]), name=f"src.{n}")
            for n, s in src_specs.items()
            if me in s.layout.ranks
        }
        # Targets start as placeholders of the wrong shape: set_data must replace them.
        dst = {
            n: ms.Parameter(ms.Tensor(np.zeros(1, np.float32)), name=n)
            for n, s in dst_specs.items()
            if me in s.layout.ranks
        }
        ids = {n: id(p) for n, p in dst.items()}
        reshard_parameters(mp, group, src, dst)
        assert all(id(dst[n]) == ids[n] for n in dst)
        out[scenario] = {n: p.asnumpy().copy() for n, p in dst.items()}
    return out


@pytest.mark.needs_torch
@pytest.mark.needs_mindspore
def test_mindspore_parameters_bit_exact_on_four_ranks(run_ranks):
    results = run_ranks(rank_mindspore_params, nprocs=4, backend="gloo", timeout=240)
    weights = random_weights(llama_shapes(2), seed=7)
    for scenario in SCENARIOS:
        _, dst_specs = _specs(scenario)
        for rank in range(4):
            got = results[rank][scenario]
            want_names = {n for n, s in dst_specs.items() if rank in s.layout.ranks}
            assert set(got) == want_names
            for name in want_names:
                want = expected_shard(name, dst_specs[name], weights, DEFAULT_FUSIONS, rank)
                np.testing.assert_array_equal(got[name], want, err_msg=f"{scenario} rank {rank} {name}")
    assert results[2]["pp2_tp2_to_tp2"] == {} and results[3]["pp2_tp2_to_tp2"] == {}
