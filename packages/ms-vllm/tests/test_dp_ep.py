"""DP attention + EP through `vllm serve --data-parallel-size 2 --enable-expert-parallel`: two engine
processes, each with its own requests, latent cache and half of DeepSeek-V3's routed experts, the
experts' tokens exchanged by all-to-all (gloo). Concurrent requests (spread over both ranks by vLLM's
DP load balancing) give the greedy tokens of one process, compiled and eager, and with W8A8 (each
rank's int8 experts, its own scales) those of the one-process W8A8 model."""

from __future__ import annotations

import concurrent.futures as cf
import json

import pytest
from conftest import vllm_server

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch]

N_NEW = 5
PROMPTS = [
    [0, *range(40, 52), 7, 9],
    [0, 17, 23, 99, 5, 61, 200, 31, 8, 8, 150, 42, 19, 77, 240, 3, 66, 90, 12, 14, 130, 55, 71],  # chunked
    [0, 12],
    [5, 6, 7, 8, 9, 10],
    [300, 2, 4, 8],
    [0, *range(40, 52), 101],
]
BUCKETS = {"decode_sizes": [1, 4], "prefill_sizes": [16], "context_sizes": [96], "batch_tokens": 0}
COMPILED = ["--additional-config", json.dumps({"compile": BUCKETS})]
MODES = {"compiled": COMPILED, "eager": ["--enforce-eager"], "compiled W8A8": COMPILED}


def _complete(base: str, prompt: list[int]) -> list[int]:
    import requests

    body = dict(model="tiny", prompt=prompt, max_tokens=N_NEW, temperature=0.0, ignore_eos=True, return_token_ids=True)
    r = requests.post(base + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def _rank0(base: str, method: str) -> dict:
    """DP rank 0's worker answer (vLLM's dev /collective_rpc reaches the first engine only)."""
    import requests

    r = requests.post(base + "/collective_rpc", json={"method": method}, timeout=120)
    r.raise_for_status()
    return r.json()["results"][0]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_dp2_ep2_serve_matches_one_process(mode, tiny_dirs, reference, tmp_path):
    model, expect = tiny_dirs["deepseek_v3"], [reference("deepseek_v3", p, N_NEW) for p in PROMPTS]
    if mode.endswith("W8A8"):  # (the checkpoint's config.json names its method: no flag needed)
        from ms_models import generate_greedy_recompute
        from ms_vllm.quant import load_quantized, quantize_checkpoint

        model = str(tmp_path / "w8a8")
        quantize_checkpoint(tiny_dirs["deepseek_v3"], model, "ms_w8a8", PROMPTS)
        quantized = load_quantized(model, "ms_w8a8")
        expect = [generate_greedy_recompute(quantized, p, N_NEW) for p in PROMPTS]
    args = [
        "--served-model-name", "tiny", "--max-model-len", "96", "--block-size", "4",
        "--kv-cache-memory-bytes", str(4 << 20), "--max-num-batched-tokens", "16", "--enable-prefix-caching",
        "--data-parallel-size", "2", "--enable-expert-parallel", *MODES[mode],
    ]  # fmt: skip
    with vllm_server(
        model,
        args,
        tmp_path / "server.log",
        {"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "INFO"},
    ) as base:
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: _complete(base, p), PROMPTS))
        stats, shard = _rank0(base, "ms_vllm_stats"), _rank0(base, "ms_vllm_shard_info")
    assert got == expect
    log = (tmp_path / "server.log").read_text()
    assert "DP=2 x EP=2" in log  # the plan line at start-up
    # Rank 0 emitted only some of the tokens: rank 1 served the others (and matched one process too).
    assert 0 < stats["tokens"] < N_NEW * len(PROMPTS)
    assert shard["world_size"] == 2 and shard["rank"] == shard["data_parallel_rank"] == 0
    assert shard["kv_cache_shape"][2:] == [24]  # this rank's own latent cache (kv_lora_rank 16 + rope 8)
    if mode.endswith("W8A8"):
        assert shard["quantized_cells"] > 0
    if mode.startswith("compiled"):
        assert stats["eager_calls"] == 0 and stats["compiled_calls"] > 0
        ex = stats["exchange"]
        # tokens went both ways: this rank's to rank 1's experts and rank 1's to this rank's
        assert ex["exchanges"] > 0 and ex["sent_rows"] > 0 and ex["received_rows"] > 0
