"""Expert parallel by all-to-all (DP attention): the routing groups each token's choices by rank
exactly; on 2 gloo ranks, each serving its own prompt, a DP=2 x EP=2 DeepSeek-V3 gives every rank
the logits one process gives for that rank's prompt."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_parallel import RTOL, _paged_logits

from ms_layout.testing import assert_close

PROMPTS = ([0, 17, 23, 99, 5, 61, 200, 31, 8], [3, 140, 77, 12, 250])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 12), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_route_sends_each_choice_to_its_owner(ranks, per_rank, tokens, k, seed):
    from ms_models.parallel.dispatch import route

    rng = np.random.default_rng(seed)
    k = min(k, ranks * per_rank)
    choices = [rng.choice(ranks * per_rank, k, replace=False) for _ in range(tokens)]
    indices = np.array(choices, np.int64).reshape(tokens, k)
    weights = rng.random((tokens, k)).astype(np.float32)
    routed = route(indices, weights, ranks, per_rank)
    # Rebuild the dense [tokens, experts] weight table from what each rank receives.
    dense = np.zeros((tokens, ranks * per_rank), np.float32)
    for d, (rows, mix) in enumerate(zip(routed.rows, routed.mix)):
        assert np.all(np.diff(rows) > 0), "rows are sent once each, in order"
        assert np.all(mix.sum(1) > 0), "no row is sent where it chose no expert"
        dense[rows, d * per_rank : (d + 1) * per_rank] = mix
    want = np.zeros_like(dense)
    np.put_along_axis(want, indices.astype(np.int64), weights, 1)
    np.testing.assert_array_equal(dense, want)


def test_route_rejects_bad_input():
    from ms_models.parallel.dispatch import capacity, route

    with pytest.raises(ValueError, match="expert index 8 outside 0..7"):
        route(np.array([[8]]), np.array([[1.0]]), 2, 4)
    with pytest.raises(ValueError, match=r"indices \(1, 2\) and weights \(1, 1\)"):
        route(np.array([[0, 1]]), np.array([[1.0]]), 2, 4)
    assert [capacity(c) for c in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]


def _dp_rank(group, path):
    import mindspore as ms

    from ms_models.parallel import DispatchMoE, ShardPlan, build_tp_model

    ms.set_device("CPU")
    plan = ShardPlan(1, 0, expert_parallel=True, dp=group.size, dp_rank=group.rank)
    model = build_tp_model(str(path), plan, group)
    sizes = {name: tuple(p.shape) for name, p in model.parameters_and_names()}
    logits = _paged_logits(model, PROMPTS[group.rank], 42)
    moe = [c for _, c in model.cells_and_names() if isinstance(c, DispatchMoE)]
    return logits, sizes, moe[0].last_stats  # layer 1 (the MTP layer's MoE does not run here)


def test_dp2_ep2_each_rank_matches_one_process(tiny_dirs, run_ranks):
    """Rank r serves PROMPTS[r] (9 and 5 tokens): its routed experts' tokens travel to the other
    rank and back, and its logits equal one process's on the same prompt."""
    import mindspore as ms

    from ms_models import from_pretrained

    ms.set_device("CPU")
    path = tiny_dirs["deepseek_v3"]
    results = run_ranks(_dp_rank, nprocs=2, timeout=300, args=(path,))
    full = from_pretrained(path)
    for rank, ((pre, dec), sizes, stats) in enumerate(results):
        want_pre, want_dec = _paged_logits(full, PROMPTS[rank], 42)
        assert_close(pre, want_pre, RTOL, f"DP=2 x EP=2 prefill logits, rank {rank}")
        assert_close(dec, want_dec, RTOL, f"DP=2 x EP=2 decode logits, rank {rank}")
        assert sizes["model.layers.1.mlp.experts.gate_proj"] == (4, 32, 64)  # 4 of 8 experts, whole
        assert sizes["model.layers.1.mlp.gate.weight"] == (8, 64)  # the router sees every expert
        assert sizes["model.layers.1.mlp.shared_experts.gate_proj.weight"] == (32, 64)  # whole
        assert sizes["model.embed_tokens.weight"] == (320, 64)  # whole vocabulary
        assert stats["cap"] >= 1 and stats["sent_rows"] >= 1  # the decode step's exchange


def test_dp_plan_errors_name_the_value():
    from ms_models.parallel import ParallelError, ShardPlan

    with pytest.raises(ParallelError, match="data_parallel_size=2 without expert parallel"):
        ShardPlan(1, 0, dp=2)
    with pytest.raises(ParallelError, match="data_parallel_size=2 with tensor_parallel_size=2"):
        ShardPlan(2, 0, expert_parallel=True, dp=2)
    with pytest.raises(ParallelError, match="dp_rank=2"):
        ShardPlan(1, 0, expert_parallel=True, dp=2, dp_rank=2)
    with pytest.raises(ParallelError, match="n_routed_experts=6 over 4 expert-parallel ranks|does not split"):
        ShardPlan(1, 0, expert_parallel=True, dp=4).check({"n_routed_experts": 6})
    with pytest.raises(ParallelError, match="without routed experts"):
        ShardPlan(1, 0, expert_parallel=True, dp=2).check({"num_attention_heads": 4})
    plan = ShardPlan(1, 0, expert_parallel=True, dp=2, dp_rank=1)
    assert ShardPlan.from_dict(plan.to_dict()) == plan and plan.ep == 2 and plan.ep_rank == 1
    assert plan.expert_range(8) == (4, 8) and "DP=2 x EP=2" in plan.describe()
