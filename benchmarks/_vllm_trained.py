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
    num_hidden_layers=6,
)  # fmt: skip
"""The trained model's size: hidden 256 and 6 layers, so that the target model's work, not per-step
overhead, sets a decode step's time, and the one MTP layer is a fraction of it (DeepSeek-V3: 1 MTP
layer beside 61). With make_tiny's 3 layers the MTP graph cost 0.6x a target step on this CPU, and
MTP k=1 (acceptance 0.97) ran at 0.91x the tokens/s of no MTP."""
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


def train_or_reuse(root: str, quick: bool, trained_dir: str | None) -> tuple[str, dict, float | None]:
    """(model directory, training report, training seconds or None when reused): `trained_dir` with a
    training.json is reused as it is (rerunning the serving rows without training again)."""
    import json

    from ms_models.train_tiny import train_tiny

    path = trained_dir or os.path.join(root, "dsv3_trained")
    report_file = os.path.join(path, "training.json")
    if trained_dir and os.path.isfile(report_file):
        with open(report_file) as f:
            return path, json.load(f), None
    start = time.perf_counter()
    report = train_tiny("deepseek_v3", path, steps=150 if quick else 400, seed=0, **WIDE)
    return path, report, time.perf_counter() - start


def mtp_rows(path: str, quick: bool, h) -> tuple[list[dict], dict]:
    """MTP k=1 against no MTP on the trained model, compiled: 8 requests at once, and one request
    at a time (the latency case speculative decoding is for). Both engines live side by side and
    the variants alternate, best of the rounds (this box's step times drift by up to 1.5x)."""
    prompts = held_out_prompts(path, 8, 24)
    n_new, rounds = (16, 1) if quick else (48, 4)
    single = prompts[:2]
    engines = {}
    for mtp in (False, True):
        kw = dict(speculative_config=MTP) if mtp else {}
        engines[mtp] = h.vllm_engine(path, enforce_eager=False, additional_config=FEW_BUCKETS, **kw)
        h.vllm_run(engines[mtp], prompts, 2)
    before = {m: llm.collective_rpc("ms_vllm_stats")[0] for m, llm in engines.items()}
    times, alone = {False: None, True: None}, {False: None, True: None}
    for _ in range(rounds):
        for mtp, llm in engines.items():
            run = h.best_of(lambda llm=llm: h.vllm_run(llm, prompts, n_new), 1)
            one = h.best_of(lambda llm=llm: [h.vllm_run(llm, [p], n_new) for p in single], 1)
            times[mtp] = run if times[mtp] is None or run[0] < times[mtp][0] else times[mtp]
            alone[mtp] = one if alone[mtp] is None or one[0] < alone[mtp][0] else alone[mtp]
    tokens, stats = {}, {}
    for mtp, llm in engines.items():
        after = llm.collective_rpc("ms_vllm_stats")[0]
        stats[mtp] = {k: (after[k] - before[mtp][k]) / rounds for k in ("drafts", "accepted", "steps", "eager_calls")}
        tokens[mtp] = [list(o.outputs[0].token_ids) for o in h.vllm_run(llm, prompts, n_new)]
        h.close(llm)
    rate = stats[True]["accepted"] / max(stats[True]["drafts"], 1)
    tok_s = {m: len(prompts) * n_new / times[m][0] for m in times}  # wall clock
    tok_s_alone = {m: len(single) * n_new / alone[m][0] for m in alone}
    case = f"trained: MTP k=1 vs none, 8 requests, compiled (acceptance {rate:.2f})"
    row = h.timing_row(case, times[True], times[False])
    row["ratio"] = round(times[False][0] / times[True][0], 3)  # wall (the engine core and worker share the process)
    rows = [
        dict(
            row,
            acceptance_rate=round(rate, 3),
            decode_tok_s=round(tok_s[True], 1),
            decode_tok_s_without_mtp=round(tok_s[False], 1),
            tokens_equal=tokens[True] == tokens[False],
            engine_steps_per_round=stats[True]["steps"],
            engine_steps_per_round_without_mtp=stats[False]["steps"],
        ),
        dict(
            h.timing_row("trained: MTP k=1 vs none, one request at a time, compiled", alone[True], alone[False]),
            ratio=round(alone[False][0] / alone[True][0], 3),
            decode_tok_s=round(tok_s_alone[True], 1),
            decode_tok_s_without_mtp=round(tok_s_alone[False], 1),
        ),
    ]
    summary = {
        "trained_mtp_acceptance": round(rate, 3),
        "trained_mtp_over_none_tok_s": round(tok_s[True] / tok_s[False], 3),
        "trained_mtp_over_none_tok_s_one_request": round(tok_s_alone[True] / tok_s_alone[False], 3),
        "trained_mtp_tokens_equal": tokens[True] == tokens[False],
    }
    return rows, summary


def trained_rows(root: str, quick: bool, h, trained_dir: str | None = None) -> tuple[list[dict], dict]:
    """Rows and summary entries; `h` carries bench_vllm's helpers (vllm_engine, vllm_run, best_of,
    timing_row, quant_rows, close)."""
    path, report, train_s = train_or_reuse(root, quick, trained_dir)
    rows = [
        dict(
            case="trained DeepSeek-V3, hidden 256 (ms-models train-tiny --set ..., synthetic corpus)",
            ours=f"held-out ppl {report['held_out_perplexity']:.2f} after {report['steps']} steps",
            baseline=f"first-step loss {report['first_loss']:.2f} (ppl {np.exp(report['first_loss']):.0f})",
            ratio=round(float(np.exp(report["first_loss"]) / report["held_out_perplexity"]), 1),
            train_s=None if train_s is None else round(train_s, 1),
        )
    ]
    mtp, summary = mtp_rows(path, quick, h)
    rows += mtp
    prompts = held_out_prompts(path, 8, 24)
    os.makedirs(os.path.join(root, "dsv3_trained_quant"), exist_ok=True)
    quant = h.quant_rows(
        path, os.path.join(root, "dsv3_trained_quant"), held_out=[p for p in prompts], label="trained dsv3"
    )
    rows += quant
    summary["trained_held_out_ppl"] = round(report["held_out_perplexity"], 3)
    for r in quant[1:]:
        method = r["case"].split()[-1]
        summary[f"trained_{method}_ppl_over_float"] = round(r["perplexity"] / r["perplexity_float"], 4)
        summary[f"trained_{method}_bytes_over_float"] = round(r["weight_bytes"] / r["weight_bytes_float"], 4)
    return rows, summary
