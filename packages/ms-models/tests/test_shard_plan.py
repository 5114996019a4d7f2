"""ms_models.parallel.ShardPlan: its meshes, ranges and the config checks (no MindSpore needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ms_models.parallel.plan import ParallelError, ShardPlan

LLAMA = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=320)
DEEPSEEK = dict(
    LLAMA,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    first_k_dense_replace=1,
)


def test_plan_round_trip_and_ranges():
    plan = ShardPlan(2, 1, expert_parallel=True)
    assert ShardPlan.from_dict(plan.to_dict()) == plan
    assert plan.expert_range(8) == (4, 8)
    assert ShardPlan(2, 1).expert_range(8) == (0, 8)  # TP inside experts: every rank has all
    assert "EP=2" in plan.describe()
    assert plan.expert_config().coords(1)["ep"] == 1 and plan.dense_config().coords(1)["tp"] == 1
    with pytest.raises(ParallelError, match="version 7"):
        ShardPlan.from_dict({**plan.to_dict(), "version": 7})


@pytest.mark.parametrize(
    ("config", "tp", "ep", "message"),
    [
        (dict(LLAMA, num_key_value_heads=1), 2, False, "num_key_value_heads=1"),
        (dict(LLAMA, vocab_size=321), 2, False, "vocab_size=321"),
        (dict(LLAMA, intermediate_size=129), 2, False, "intermediate_size=129"),
        (dict(DEEPSEEK, moe_intermediate_size=33), 2, False, "moe_intermediate_size=33"),
        (dict(DEEPSEEK, n_routed_experts=6), 4, True, "n_routed_experts=6"),
        (dict(DEEPSEEK, n_routed_experts=2), 2, True, "leaves 1 per rank"),
    ],
)
def test_sizes_that_do_not_split_are_named(config, tp, ep, message):
    with pytest.raises(ParallelError, match=message):
        ShardPlan(tp, 0, ep).check(config)


def test_sizes_that_split():
    ShardPlan(2, 0).check(LLAMA)
    ShardPlan(2, 0, True).check(DEEPSEEK)
    # Under EP only the shared experts are TP-split, so an odd expert width is fine there.
    ShardPlan(2, 0, True).check(dict(DEEPSEEK, moe_intermediate_size=33, n_shared_experts=2))
    with pytest.raises(ParallelError, match="rank=2"):
        ShardPlan(2, 2)


def test_vocab_kept_whole_needs_no_vocab_split():
    ShardPlan(2, 0, vocab_parallel=False).check(dict(LLAMA, vocab_size=321))
    plan = ShardPlan(2, 1, vocab_parallel=False)
    assert ShardPlan.from_dict(plan.to_dict()) == plan and "whole" in plan.describe()


def test_plan_imports_without_mindspore():
    """vLLM's API server checks plans and must not load MindSpore (it forks workers)."""
    code = "import sys, ms_models.parallel.plan, ms_models; ms_models.LlamaConfig; sys.exit('mindspore' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
