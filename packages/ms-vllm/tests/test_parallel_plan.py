"""ShardPlan and the start-up checks of parallel settings (pure Python: no MindSpore, no vLLM engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ms_vllm.parallel import ParallelError, ShardPlan, check_vllm_parallel

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


def _vllm_config(**parallel):
    p = dict(
        world_size=2,
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        data_parallel_size=1,
        prefill_context_parallel_size=1,
        decode_context_parallel_size=1,
        distributed_executor_backend="mp",
        enable_expert_parallel=False,
    )
    p.update(parallel)
    features = {k: p.pop(k) for k in ("lora_config", "speculative_config") if k in p}
    model = SimpleNamespace(quantization=p.pop("quantization", None), hf_config=SimpleNamespace(**LLAMA))
    return SimpleNamespace(
        parallel_config=SimpleNamespace(**p),
        model_config=model,
        lora_config=features.get("lora_config"),
        speculative_config=features.get("speculative_config"),
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(pipeline_parallel_size=2, world_size=4), "pipeline_parallel_size=2"),
        (dict(data_parallel_size=2), "data_parallel_size=2"),
        (dict(distributed_executor_backend="ray"), "'ray'"),
        (dict(lora_config=object()), "enable_lora"),
        (dict(speculative_config=object()), "speculative decoding"),
        (dict(quantization="ms_w8a8"), "ms_w8a8"),
    ],
)
def test_unsupported_settings_are_refused(settings, message):
    with pytest.raises(ParallelError, match=message):
        check_vllm_parallel(_vllm_config(**settings))


def test_supported_settings_pass():
    check_vllm_parallel(_vllm_config())
    check_vllm_parallel(_vllm_config(world_size=1, tensor_parallel_size=1, lora_config=object()))
