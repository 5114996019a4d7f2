"""DP attention + EP through `vllm serve --data-parallel-size 2 --enable-expert-parallel`: two engine
processes, each with its own requests, latent cache and half of DeepSeek-V3's routed experts, the
experts' tokens exchanged by all-to-all (gloo). Concurrent requests (spread over both ranks by vLLM's
DP load balancing) give the greedy tokens of one process, compiled and eager; with W8A8 (each
rank's int8 experts, its own scales) those of the one-process W8A8 model; with a LoRA adapter on
half of the requests and multi-step decoding (the ranks' rounds paired, lockstep.py) those of the
adapter merged into the weights; with MTP (compiled drafts cut at the MTP layer's exchange, the
drafting forwards paired one by one) those of one process."""

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
LORA_MULTI_STEP = [
    "--additional-config", json.dumps({"compile": BUCKETS, "multi_step": 2}),
    "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
]  # fmt: skip
MTP = ["--speculative-config", json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": 1})]
# No plain "compiled" mode: its checks (compiled calls only, tokens both ways through the
# exchange, one process's tokens) are made by "compiled W8A8" (the same graphs, int8 experts) and
# "compiled MTP" (the same graphs plus the drafts); each mode is a DP2 x EP2 server start, about
# 2.5 minutes of CI on 2 cores.
MODES = {
    "eager": ["--enforce-eager"], "compiled W8A8": COMPILED, "LoRA multi-step": LORA_MULTI_STEP,
    "compiled MTP": COMPILED + MTP,
}  # fmt: skip
ADAPTED = (0, 2, 4)  # the prompts sent to the adapter in the LoRA mode


def _lora_case(model: str, tmp_path) -> tuple[list[str], list[list[int]]]:
    """(the server's --lora-modules flag, expected tokens: the adapter merged for ADAPTED prompts)."""
    from test_lora import merged_reference, write_adapter

    from ms_models import from_pretrained, generate_greedy_recompute

    base = from_pretrained(model)
    tensors, scale = write_adapter(tmp_path / "a1", base, seed=1, targets=("self_attn.q_b_proj", "self_attn.o_proj"))
    expect = [
        merged_reference(model, tensors, scale, N_NEW, prompt=p) if i in ADAPTED
        else generate_greedy_recompute(base, p, N_NEW)
        for i, p in enumerate(PROMPTS)
    ]  # fmt: skip
    assert any(expect[i] != generate_greedy_recompute(base, PROMPTS[i], N_NEW) for i in ADAPTED)  # it changes tokens
    return ["--lora-modules", f"a1={tmp_path / 'a1'}"], expect


def _complete(base: str, prompt: list[int], name: str = "tiny") -> list[int]:
    import requests

    body = dict(model=name, prompt=prompt, max_tokens=N_NEW, temperature=0.0, ignore_eos=True, return_token_ids=True)
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
    names, extra = ["tiny"] * len(PROMPTS), []
    if mode.startswith("LoRA"):
        extra, expect = _lora_case(model, tmp_path)
        names = ["a1" if i in ADAPTED else "tiny" for i in range(len(PROMPTS))]
    args = [
        "--served-model-name", "tiny", "--max-model-len", "96", "--block-size", "4",
        "--kv-cache-memory-bytes", str(4 << 20), "--max-num-batched-tokens", "16", "--enable-prefix-caching",
        "--data-parallel-size", "2", "--api-server-count", "1", "--enable-expert-parallel", *MODES[mode], *extra,
    ]  # fmt: skip
    with vllm_server(
        model,
        args,
        tmp_path / "server.log",
        {"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "INFO"},
        # four processes (2 API servers, 2 engine cores) start on 2 cores beside the other pytest
        # worker: with LoRA + multi-step one start took over 240 s there
        wait_s=480,
    ) as base:
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda pn: _complete(base, *pn), zip(PROMPTS, names)))
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
    if mode.startswith("LoRA"):  # multi-step: some steps ran more than one decode iteration
        assert stats["multi_step_rounds"] > 0
    if mode.endswith("MTP"):  # drafts were verified (the drafting exchanges paired over the ranks)
        assert stats["drafts"] > 0 and stats["draft_compiled_calls"] > 0
    if mode != "eager":
        assert stats["eager_calls"] == 0 and stats["compiled_calls"] > 0
        ex = stats["exchange"]
        # tokens went both ways: this rank's to rank 1's experts and rank 1's to this rank's
        assert ex["exchanges"] > 0 and ex["sent_rows"] > 0 and ex["received_rows"] > 0


def test_offline_dp2_ep2_one_llm_per_rank_matches_one_process(tiny_dirs, reference):
    """vLLM's multi-process offline DP route: one `LLM` per DP rank (VLLM_DP_SIZE / VLLM_DP_RANK /
    the DP master's address in the environment), each with its own prompts, the experts split over
    the two; the ranks finish at different steps (the one done early runs vLLM's dummy batches)."""
    import os
    import subprocess
    import sys

    from conftest import _free_port, forked_env

    script = os.path.join(os.path.dirname(__file__), "tp_generate.py")
    llm = dict(enable_expert_parallel=True, enforce_eager=False, additional_config={"compile": BUCKETS},
               max_num_batched_tokens=16, enable_chunked_prefill=True)  # fmt: skip
    mine = {0: PROMPTS[0::2], 1: PROMPTS[1::2][:2]}  # unequal work: 3 prompts and 2
    port, procs = _free_port(), []
    for rank in (0, 1):
        job = dict(model=str(tiny_dirs["deepseek_v3"]), prompts=mine[rank], follow_up=[0, 12], n=N_NEW, llm=llm)
        env = forked_env(VLLM_DP_SIZE="2", VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank),
                         VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port))  # fmt: skip
        cmd = [sys.executable, script, json.dumps([job])]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1])[0])
    for rank, result in enumerate(results):
        assert result["tokens"] == [reference("deepseek_v3", p, N_NEW) for p in mine[rank]]
        (shard,) = result["shards"]
        assert (shard["data_parallel_rank"], shard["world_size"]) == (rank, 2)
        assert result["eager_calls"] == [0]
