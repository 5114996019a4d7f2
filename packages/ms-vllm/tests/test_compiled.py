"""Compiled steps (buckets + mindspore.jit) through vllm.LLM and through the runner: the greedy
tokens equal ms-models' reference (so the eager path's, test_llm.py) for Llama and DeepSeek-V3 with
prefix caching, chunked prefill, multi-step and MTP on; shapes outside the buckets fall back to the
eager path and are counted; padding writes no real cache slot."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import close_llm, make_llm, token_prompts

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch]

# Small buckets keep start-up short (each graph compiles in 1-3 s here); max_model_len is 96.
# Chunks of up to 8 tokens also run two at a time (batch_tokens 16).
BUCKETS = {"decode_sizes": [1, 2, 4], "prefill_sizes": [8, 16], "context_sizes": [32, 96], "batch_tokens": 16}
# Where the bucket set itself is not under test: one size each (2 graphs instead of 12).
FEW_BUCKETS = {"decode_sizes": [4], "prefill_sizes": [16], "context_sizes": [96], "batch_tokens": 16}
# ... and with a batched prefill graph (two chunks of up to 16 tokens): 3 graphs.
FEW_BATCHED = dict(FEW_BUCKETS, batch_tokens=32)
SHARED = [0, *range(40, 52)]
PROMPTS = [
    SHARED + [7, 9],
    [0, 17, 23, 99, 5, 61, 200, 31, 8, 8, 150, 42, 19, 77, 240, 3, 66, 90, 12, 14, 130, 55, 71],  # > 16: chunked
    [0, 12],
    [0, 5, 9, 33, 77, 100, 21],
    [0, 40, 41, 42, 43],
]
FOLLOW_UP = SHARED + [101, 102, 103]  # a prefix-cache hit: its chunk is shorter than its context


def greedy(n):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def compiled_llm(path, buckets=BUCKETS, **kw):
    args = dict(
        enforce_eager=False,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        additional_config={"compile": buckets},
    )
    args.update(kw)
    return make_llm(path, **args)


# Llama on the full bucket set; DeepSeek-V3 (a longer compile per graph) on one size of each kind
@pytest.mark.parametrize(("arch", "buckets", "graphs"), [("llama", BUCKETS, 12), ("deepseek_v3", FEW_BATCHED, 3)])
def test_compiled_greedy_matches_reference(arch, buckets, graphs, tiny_dirs, reference):
    llm = compiled_llm(tiny_dirs[arch], buckets)
    try:
        outs = llm.generate(token_prompts(PROMPTS), greedy(6), use_tqdm=False)
        follow = llm.generate(token_prompts([FOLLOW_UP]), greedy(6), use_tqdm=False)[0]
        stats = llm.collective_rpc("ms_vllm_stats")[0]
    finally:
        close_llm(llm)
    assert [list(o.outputs[0].token_ids) for o in outs] == [reference(arch, p, 6) for p in PROMPTS]
    assert list(follow.outputs[0].token_ids) == reference(arch, FOLLOW_UP, 6)
    assert follow.num_cached_tokens == 12
    # BUCKETS: 3 decode sizes x 2 contexts + (2 prefill sizes + 8 x 2 batched) x 2 contexts;
    # FEW_BATCHED: 1 decode graph, 1 prefill graph of one chunk, 1 of two; all compiled at start-up
    assert len(stats["compile_s"]) == graphs and all(t > 0 for t in stats["compile_s"].values())
    assert stats["eager_calls"] == 0 and stats["compiled_calls"] >= stats["steps"]
    assert stats["batched_prefill_calls"] > 0


def test_shapes_outside_the_buckets_run_eagerly_and_are_counted(tiny_dirs, reference):
    """Prefill graphs of 4 tokens only: every longer chunk runs eagerly, with the same tokens."""
    llm = compiled_llm(tiny_dirs["llama"], {"decode_sizes": [1, 2], "prefill_sizes": [4], "context_sizes": [96]})
    try:
        outs = llm.generate(token_prompts(PROMPTS), greedy(4), use_tqdm=False)
        stats = llm.collective_rpc("ms_vllm_stats")[0]
    finally:
        close_llm(llm)
    assert [list(o.outputs[0].token_ids) for o in outs] == [reference("llama", p, 4) for p in PROMPTS]
    assert stats["eager_calls"] > 0 and stats["compiled_calls"] > 0
    assert sum(stats["eager_reasons"].values()) == stats["eager_calls"]
    assert any("no bucket" in r for r in stats["eager_reasons"])
    # 5 requests in decode graphs of at most 2: several decode calls per step, none eager
    assert not any("context" in r and "largest" in r for r in stats["eager_reasons"])


def test_compiled_multi_step_and_mtp(tiny_dirs, reference):
    """Multi-step decode (Llama) and MTP drafting (DeepSeek-V3) with the compiled path on: the
    draft-verification steps take verify buckets (every row sampled) and the MTP module its own
    graphs (decode, prefill and draft buckets), so nothing runs eagerly."""
    llm = compiled_llm(tiny_dirs["llama"], additional_config={"compile": FEW_BUCKETS, "multi_step": 4})
    try:
        outs = llm.generate(token_prompts(PROMPTS), greedy(7), use_tqdm=False)
        stats = llm.collective_rpc("ms_vllm_stats")[0]
    finally:
        close_llm(llm)
    assert [list(o.outputs[0].token_ids) for o in outs] == [reference("llama", p, 7) for p in PROMPTS]
    assert stats["forwards"] > stats["steps"] and stats["eager_calls"] == 0

    llm = compiled_llm(
        tiny_dirs["deepseek_v3"],
        FEW_BUCKETS,
        speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1},
    )
    try:
        outs = llm.generate(token_prompts(PROMPTS), greedy(5), use_tqdm=False)
        stats = llm.collective_rpc("ms_vllm_stats")[0]
    finally:
        close_llm(llm)
    assert [list(o.outputs[0].token_ids) for o in outs] == [reference("deepseek_v3", p, 5) for p in PROMPTS]
    assert stats["drafts"] > 0 and stats["compiled_calls"] > 0 and stats["eager_calls"] == 0
    assert stats["draft_compiled_calls"] > 0 and stats["draft_eager_calls"] == 0
    kinds = {name.split(":")[-1].split("[")[0] for name in stats["compile_s"]}
    assert kinds == {"decode", "prefill", "verify", "draft"} and len(stats["compile_s"]) == 6


def test_padding_never_writes_a_real_slot(tiny_dirs):
    """A compiled decode of 3 requests padded to 4: only their own slots and the scratch block change."""
    from test_runner import runner_for

    from ms_vllm.batch import RequestState, build_batch
    from ms_vllm.buckets import BucketConfig

    runner, _ = runner_for(tiny_dirs["llama"])  # 8 blocks of 4 (+ the scratch block 8)
    eager, _ = runner_for(tiny_dirs["llama"])
    runner.compile(BucketConfig((4,), (8,), (32,)), progress=False)
    tables = {"a": [3], "b": [1, 6], "c": [5]}
    prompts = {"a": [0, 9, 4], "b": [0, 7, 7, 7, 2, 8], "c": [0, 1]}
    for r in (runner, eager):
        r.requests = {k: RequestState(k, prompts[k], None, tables[k], len(prompts[k]) - 1) for k in prompts}
    before = [c.asnumpy().copy() for c in runner.kv_caches[0]]
    batch = build_batch(runner.requests, {"a": 1, "b": 1, "c": 1}, {}, 4)
    logits, _ = runner.run_model(batch)
    ref, _ = eager.run_model(batch)
    assert runner.stats["compiled_calls"] == 1 and eager.stats["eager_calls"] == 1
    np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    written = {int(s) for s in batch.slot_mapping}
    for cache, old in zip(runner.kv_caches[0], before):
        new = cache.asnumpy()
        changed = {int(s) for s in np.nonzero(np.any(new.reshape(36, -1) != old.reshape(36, -1), -1))[0]}
        scratch = set(range(32, 36))
        assert changed - scratch == written
        # padding tokens (id 0 at position 0, as in the warm-up batches) write the scratch block only
        assert np.any(new.reshape(36, -1)[32:] != 0)


CACHE_SCRIPT = """
import json, os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], max_model_len=96, block_size=4, max_num_seqs=8, kv_cache_memory_bytes=4 << 20,
          seed=0, additional_config={"compile": json.loads(sys.argv[2])})
out = llm.generate([{"prompt_token_ids": [0, 5, 9, 33, 77]}], SamplingParams(max_tokens=6, temperature=0.0))
stats = llm.collective_rpc("ms_vllm_stats")[0]
print("RESULT", json.dumps([list(out[0].outputs[0].token_ids), stats["compile_s"]]))
llm.llm_engine.engine_core.shutdown()
"""


def test_compile_cache_restart_loads_the_graphs(tiny_dirs, reference, tmp_path):
    """Two fresh processes with one compile cache: the second loads the graphs (each bucket much
    faster than compiling it) and generates the same tokens. MindSpore keys the cache by the entry
    script's source, so the processes run the same script file (`python -c` cannot use the cache)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "start.py"
    script.write_text(CACHE_SCRIPT)
    # one decode and one prefill graph: the two kinds, in fewer seconds of cold compile
    buckets = {"decode_sizes": [1], "prefill_sizes": [8], "context_sizes": [96], "batch_tokens": 0,
               "cache_dir": str(tmp_path / "cc")}  # fmt: skip
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, str(script), str(tiny_dirs["llama"]), json.dumps(buckets)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        assert out.returncode == 0 and line, out.stderr[-3000:]
        runs.append(json.loads(line[0][7:]))
    (cold_tokens, cold), (warm_tokens, warm) = runs
    assert cold_tokens == warm_tokens == reference("llama", [0, 5, 9, 33, 77], 6)
    assert sorted(cold) == sorted(warm) and len(cold) == 2
    assert sum(warm.values()) < 0.5 * sum(cold.values()), (cold, warm)
