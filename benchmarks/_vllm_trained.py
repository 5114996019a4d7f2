"""bench_vllm's rows on a *trained* tiny DeepSeek-V3 (ms_models.train_tiny): MTP draft acceptance and
decode speed with and without MTP (compiled steps), and W8A8 / W4A16 perplexity and weight bytes
against float. On the random tiny model no draft is ever accepted and perplexity is noise; trained on
the synthetic corpus, the model (and its MTP module) predicts held-out text of the same grammar.
"""

from __future__ import annotations

import os
import time

import numpy as np

MTP = {"method": "deepseek_mtp", "num_speculative_tokens": 1}
WIDE = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=128,
)  # fmt: skip
"""The trained model's width: hidden 256, where the target model's work, not per-step overhead,
sets a decode step's time (at make_tiny's hidden 64 MTP's extra graphs cost more than it saves)."""
FEW_BUCKETS = {
    "compile": {"decode_sizes": [1, 2, 4, 8], "prefill_sizes": [32], "context_sizes": [256], "batch_tokens": 0}
}


def held_out_prompts(path: str, n: int, length: int, seed: int = 1) -> list[list[int]]:
    """n windows of held-out text (the corpus generator with another seed), as token ids."""
    from tokenizers import Tokenizer

    from ms_models.train_tiny import corpus_text

    ids = Tokenizer.from_file(os.path.join(path, "tokenizer.json")).encode(corpus_text(seed, 400)).ids
    starts = np.random.default_rng(seed).integers(0, len(ids) - length, n)
    return [ids[s : s + length] for s in starts]


def trained_rows(root: str, quick: bool, h) -> tuple[list[dict], dict]:
    """Rows and summary entries; `h` carries bench_vllm's helpers (vllm_engine, vllm_run, best_of,
    timing_row, quant_rows, close)."""
    from ms_models.train_tiny import train_tiny

    path = os.path.join(root, "dsv3_trained")
    start = time.perf_counter()
    report = train_tiny("deepseek_v3", path, steps=150 if quick else 400, seed=0, **WIDE)
    train_s = time.perf_counter() - start
    rows = [
        dict(
            case="trained DeepSeek-V3, hidden 256 (ms-models train-tiny --set ..., synthetic corpus)",
            ours=f"held-out ppl {report['held_out_perplexity']:.2f} after {report['steps']} steps",
            baseline=f"first-step loss {report['first_loss']:.2f} (ppl {np.exp(report['first_loss']):.0f})",
            ratio=round(float(np.exp(report["first_loss"]) / report["held_out_perplexity"]), 1),
            train_s=round(train_s, 1),
        )
    ]
    prompts = held_out_prompts(path, 8, 24)
    n_new, repeats = (16, 1) if quick else (48, 2)
    times, tokens, stats = {}, {}, {}
    for mtp in (False, True):
        kw = dict(speculative_config=MTP) if mtp else {}
        llm = h.vllm_engine(path, enforce_eager=False, additional_config=FEW_BUCKETS, **kw)
        h.vllm_run(llm, prompts, 2)
        before = llm.collective_rpc("ms_vllm_stats")[0]
        times[mtp] = h.best_of(lambda llm=llm: h.vllm_run(llm, prompts, n_new), repeats)
        tokens[mtp] = [list(o.outputs[0].token_ids) for o in h.vllm_run(llm, prompts, n_new)]
        after = llm.collective_rpc("ms_vllm_stats")[0]
        stats[mtp] = {k: after[k] - before[k] for k in ("drafts", "accepted", "steps", "eager_calls")}
        h.close(llm)
    rate = stats[True]["accepted"] / max(stats[True]["drafts"], 1)
    tok_s = {m: len(prompts) * n_new / times[m][0] for m in times}
    row = h.timing_row(f"trained: MTP k=1 vs none, compiled (acceptance {rate:.2f})", times[True], times[False])
    rows.append(
        dict(
            row,
            acceptance_rate=round(rate, 3),
            decode_tok_s=round(tok_s[True], 1),
            decode_tok_s_without_mtp=round(tok_s[False], 1),
            tokens_equal=tokens[True] == tokens[False],
            engine_steps=stats[True]["steps"],
            engine_steps_without_mtp=stats[False]["steps"],
        )
    )
    os.makedirs(os.path.join(root, "dsv3_trained_quant"), exist_ok=True)
    quant = h.quant_rows(
        path, os.path.join(root, "dsv3_trained_quant"), held_out=[p for p in prompts], label="trained dsv3"
    )
    rows += quant
    summary = {
        "trained_mtp_acceptance": round(rate, 3),
        "trained_mtp_over_none_tok_s": round(tok_s[True] / tok_s[False], 3),
        "trained_mtp_tokens_equal": tokens[True] == tokens[False],
        "trained_held_out_ppl": round(report["held_out_perplexity"], 3),
    }
    for r in quant[1:]:
        method = r["case"].split()[-1]
        summary[f"trained_{method}_ppl_over_float"] = round(r["perplexity"] / r["perplexity_float"], 4)
        summary[f"trained_{method}_bytes_over_float"] = round(r["weight_bytes"] / r["weight_bytes_float"], 4)
    return rows, summary
