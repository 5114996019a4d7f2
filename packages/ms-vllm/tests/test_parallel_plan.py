"""The start-up checks of vLLM's parallel settings (pure Python: no MindSpore, no vLLM engine).

ShardPlan itself is ms_models.parallel's (tested there)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ms_vllm.parallel import ParallelError, check_vllm_parallel

LLAMA = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=320)


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
