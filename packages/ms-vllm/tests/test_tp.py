"""Tensor and expert parallel through vllm.LLM: 2 worker processes (vLLM's mp executor, ms_layout.comm
gloo collectives) give the same greedy tokens as one process, with prefix caching and chunked
prefill on, compiled (graphs between the collectives, compiled_tp.py) and eager, and with multi-step
decoding (4 iterations per engine step, on both ranks alike). The 2-rank
engines start in one interpreter (about 1-2 minutes each on a busy 2-core box)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import forked_env, make_llm

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch]

N_NEW = 5
SHARED = [0, *range(40, 52)]
PROMPTS = [
    SHARED + [7, 9],
    [0, 17, 23, 99, 5, 61, 200, 31, 8, 8, 150, 42, 19, 77, 240, 3, 66, 90, 12, 14, 130, 55, 71],  # chunked
    [0, 12],
]
FOLLOW_UP = SHARED + [101, 102, 103]
FEATURES = dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16)
# compiled on 3 buckets (each runs 2L + 2 graphs between the collectives)
COMPILED = dict(
    enforce_eager=False,
    additional_config={"compile": {"decode_sizes": [1, 4], "prefill_sizes": [16], "context_sizes": [96],
                                   "batch_tokens": 0}},
)  # fmt: skip


def generate(*jobs: tuple) -> list[dict]:
    """tp_generate.py in a fresh interpreter (see its docstring for why): one engine per (model, LLM
    kwargs[, payload overrides such as prompts and per-prompt LoRA adapters])."""
    payload = [
        {**dict(model=str(job[0]), prompts=PROMPTS, follow_up=FOLLOW_UP, n=N_NEW, llm=job[1]), **(job[2:] or [{}])[0]}
        for job in jobs
    ]
    script = os.path.join(os.path.dirname(__file__), "tp_generate.py")
    proc = subprocess.run(
        [sys.executable, script, json.dumps(payload)], capture_output=True, text=True, timeout=900, check=False,
        env=forked_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


MTP = {"method": "deepseek_mtp", "num_speculative_tokens": 1}
QUANT = {
    "deepseek_v3 TP2 W8A8": ("ms_w8a8", {}),
    "deepseek_v3 TP2+EP2 W4A16": ("ms_w4a16", {"enable_expert_parallel": True}),
}


@pytest.fixture(scope="module")
def quant_dirs(tiny_dirs, tmp_path_factory):
    """{method: the tiny DeepSeek-V3 quantized by it} (routed experts and kv_b_proj included)."""
    from ms_vllm.quant import quantize_checkpoint

    root = tmp_path_factory.mktemp("quant")
    out = {}
    for method in ("ms_w8a8", "ms_w4a16"):
        out[method] = root / method
        quantize_checkpoint(tiny_dirs["deepseek_v3"], str(out[method]), method, PROMPTS, group_size=8)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_dirs, tmp_path_factory):
    """Two PEFT adapters for the tiny Llama (q_proj, v_proj: column-parallel; down_proj: row-parallel)
    and each one's merged-weights reference tokens."""
    from test_lora import PROMPT, merged_reference, write_adapter

    from ms_models import from_pretrained

    root, base = tmp_path_factory.mktemp("lora"), from_pretrained(tiny_dirs["llama"])
    t1, s1 = write_adapter(root / "a1", base, seed=1)
    t2, s2 = write_adapter(root / "a2", base, seed=2, rank=2, alpha=4.0)
    loras = [["a1", 1, str(root / "a1")], ["a2", 2, str(root / "a2")], None]
    expect = [merged_reference(tiny_dirs["llama"], t, s, N_NEW) for t, s in ((t1, s1), (t2, s2))]
    return dict(prompts=[PROMPT] * 3, loras=loras), expect


@pytest.fixture(scope="module")
def tp_runs(tiny_dirs, quant_dirs, adapters):
    """The 2-rank engines, one after the other in one interpreter."""
    multi_step = dict(COMPILED, additional_config=dict(COMPILED["additional_config"], multi_step=4))
    quant = [
        (quant_dirs[method], dict(tensor_parallel_size=2, quantization=method, **extra, **FEATURES, **COMPILED))
        for method, extra in QUANT.values()
    ]
    ep = dict(tensor_parallel_size=2, enable_expert_parallel=True, **FEATURES)
    # the plain compiled Llama engine is not run on its own: the multi-step one is it plus extra
    # decode iterations, and asserts all it would (tokens, compiled segments only, shards, cache)
    llama_eager, deepseek, llama_multi, lora, *quantized = generate(
        (tiny_dirs["llama"], dict(tensor_parallel_size=2, **FEATURES, enforce_eager=True)),
        (tiny_dirs["deepseek_v3"], dict(ep, speculative_config=MTP, **COMPILED)),
        (tiny_dirs["llama"], dict(tensor_parallel_size=2, **FEATURES, **multi_step)),
        (tiny_dirs["llama"], dict(tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8, **COMPILED),
         adapters[0]),
        *quant,
    )  # fmt: skip
    runs = {"llama eager": llama_eager, "deepseek_v3": deepseek, "llama multi-step": llama_multi}
    return dict(runs, lora=lora, **dict(zip(QUANT, quantized)))


def check_tokens(out, arch, reference):
    assert out["tokens"] == [reference(arch, p, N_NEW) for p in PROMPTS]
    assert out["follow_up"] == reference(arch, FOLLOW_UP, N_NEW)
    assert out["cached"] == 12  # the shared prefix's three blocks were reused across ranks


@pytest.mark.parametrize("run", ["llama eager", "llama multi-step"])
def test_llama_tp2_matches_one_process(run, tp_runs, reference):
    out = tp_runs[run]
    check_tokens(out, "llama", reference)
    shards = out["shards"]
    assert all(s["compiled"] == (run != "llama eager") for s in shards)
    if run != "llama eager":  # every step of both ranks ran the compiled segments
        assert out["eager_calls"] == [0, 0] and min(out["compiled_calls"]) > 0
    if run == "llama multi-step":  # both ranks ran the extra decode iterations inside engine steps
        assert out["forwards"][0] == out["forwards"][1] > out["steps"][0] == out["steps"][1]
    assert [s["rank"] for s in shards] == [0, 1]
    # Each rank caches 1 of the 2 kv heads; each holds about half of the weights (norms replicated).
    assert all(s["kv_cache_shape"][2:] == [1, 16] for s in shards)
    assert shards[0]["params"] == shards[1]["params"]


def test_deepseek_tp2_ep2_mtp_matches_one_process(tp_runs, reference):
    """TP2 + EP2 with MTP drafting (the MTP module cut at its collectives, compiled_mtp.SegmentedMTP)."""
    out = tp_runs["deepseek_v3"]
    check_tokens(out, "deepseek_v3", reference)
    assert all(s["compiled"] for s in out["shards"])
    assert out["eager_calls"] == [0, 0] and min(out["compiled_calls"]) > 0
    # both ranks drafted the same tokens, every draft in a compiled bucket
    assert out["drafts"][0] == out["drafts"][1] > 0
    assert out["draft_calls"][0] == out["draft_calls"][1] and out["draft_calls"][0][0] > 0
    # MLA's latent cache (kv_lora_rank 16 + rope 8) is replicated: every rank's heads read all of it.
    assert all(s["kv_cache_shape"][2:] == [24] for s in out["shards"])


def test_lora_tp2_matches_merged_weights(tp_runs, adapters, reference):
    """Two adapters and the base model in one batch under TP2, compiled: each rank holds its slice of
    every adapter (B rows of q/v, A columns of the row-parallel down_proj), the tokens of one process
    with the adapter merged into the weights."""
    from test_lora import PROMPT

    out = tp_runs["lora"]
    assert out["tokens"] == [*adapters[1], reference("llama", PROMPT, N_NEW)]
    assert out["eager_calls"] == [0, 0] and min(out["compiled_calls"]) > 0


@pytest.mark.parametrize("run", list(QUANT))
def test_quantized_deepseek_tp2_matches_one_process(run, tp_runs, quant_dirs):
    """W8A8 under TP (experts and kv_b_proj split by columns/rows with their scales) and W4A16 under
    TP + EP (whole experts per rank): the same greedy tokens as the one-process quantized model."""
    from ms_models import generate_greedy_recompute
    from ms_vllm.quant import load_quantized

    method = QUANT[run][0]
    model = load_quantized(str(quant_dirs[method]), method)
    out = tp_runs[run]
    assert out["tokens"] == [generate_greedy_recompute(model, p, N_NEW) for p in PROMPTS]
    assert out["follow_up"] == generate_greedy_recompute(model, FOLLOW_UP, N_NEW)
    assert out["eager_calls"] == [0, 0] and min(out["compiled_calls"]) > 0
    assert shards_quantized(out["shards"])


def shards_quantized(shards) -> bool:
    """Each rank's model holds int8 / int4 experts (tp_generate reports the quantized cell count)."""
    return all(s.get("quantized_cells", 0) > 0 for s in shards)


def test_bad_parallel_configs_are_refused(tiny_dirs, tmp_path):
    """Sizes that do not split and features not built for TP fail at LLM(...), naming the value (vLLM's
    config validation re-raises the plugin's ParallelError as a pydantic ValidationError, both ValueErrors)."""
    src = Path(tiny_dirs["llama"])
    config = json.loads((src / "config.json").read_text())
    bad = tmp_path / "odd"
    bad.mkdir()
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(src / name, bad / name)
    (bad / "config.json").write_text(json.dumps(dict(config, intermediate_size=129)))
    with pytest.raises(ValueError, match="intermediate_size=129"):
        make_llm(bad, tensor_parallel_size=2)
