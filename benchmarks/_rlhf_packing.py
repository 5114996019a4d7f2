"""bench_rlhf's packing section: packs against next-fit (mindrlhf's grouping) and the lower bound,
with the token cap binding (the usual RL setting) and with the sample-count cap binding.

Length distributions are synthetic: RL response lengths are long-tailed with a spike at the length
limit; we draw log-normal responses clipped at the limit plus a uniform prompt. "reasoning" is
median 1500 / cap 8192 tokens, "chat" median 300 / cap 2048, "uniform" U(1, cap).
"""

from __future__ import annotations

import time

import numpy as np

DISTRIBUTIONS = {  # name: (median response tokens, sigma, cap)
    "reasoning": (1500, 0.9, 8192),
    "chat": (300, 0.7, 2048),
    "uniform": (None, None, 2048),
}
COUNT_CAPS = (2, 3, 4, 5, 6, 8, 12, 16)
"""max_pack_count values of the count-binding cases."""


def lengths(rng, n, median, sigma, cap, prompt=(64, 512)):
    """prompt + response lengths: log-normal responses clipped at `cap` (uniform when median is None)."""
    if median is None:
        resp = rng.integers(1, cap + 1, n)
    else:
        resp = np.clip(rng.lognormal(np.log(median), sigma, n).astype(int), 1, cap)
    return (rng.integers(prompt[0], prompt[1] + 1, n) + resp).astype(int)


def _token_binding(quick):
    from ms_rlhf import next_fit, padding_ratio, plan_packs

    rng = np.random.default_rng(0)
    rows = []
    for name, (median, sigma, cap) in DISTRIBUTIONS.items():
        n = 256 if quick else 512
        lens = lengths(rng, n, median, sigma, cap)
        max_len = 2 * (cap + 512)  # verl/MindSpeed-RL advice: token budget >= 2x (prompt + response)
        start = time.perf_counter()
        plan = plan_packs(lens, max_len, 64)
        pack_ms = (time.perf_counter() - start) * 1e3
        nf = next_fit(lens, max_len, 64)
        rows.append(
            {
                "section": "packing",
                "case": f"{name}: {n} samples, pack {max_len} tok",
                "metric": "packs",
                "ours": plan.num_packs,
                "baseline": len(nf),
                "vs": "next-fit (mindrlhf)",
                "ratio": plan.num_packs / len(nf),
                "lower_bound": plan.lower_bound,
                "note": f"ceil(tokens/len)={plan.token_bound}, {pack_ms:.0f} ms",
            }
        )
        # padding: fixed-shape packs vs padded micro-batches of 8 samples (to their longest / to the cap)
        padded = [list(range(i, min(i + 8, n))) for i in range(0, n, 8)]
        batch_pad = 1 - lens.sum() / sum(8 * max(lens[b]) for b in padded)
        rows.append(
            {
                "section": "packing",
                "case": f"{name}: padding share",
                "metric": "pad share",
                "ours": 1 - plan.fill(),
                "baseline": batch_pad,
                "vs": "batches of 8 padded to longest",
                "ratio": (1 - plan.fill()) / batch_pad,
                "note": f"padded to cap+prompt: {padding_ratio(lens, [[i] for i in range(n)], cap + 512):.2f}",
            }
        )
    return rows


def _greedy_decreasing(lens, cap, count):
    """The packer before the fixed-count method: the better of first-fit and best-fit decreasing."""
    from ms_rlhf.packing import _greedy

    return min(len(_greedy(lens, cap, count, False)), len(_greedy(lens, cap, count, True)))


def _count_binding(quick):
    """Random lognormal batches (the property test's distribution) where ceil(n / count) >= the
    token bound: packs over the lower bound for ours, next-fit and first/best-fit decreasing."""
    from ms_rlhf import next_fit, plan_packs, token_bound

    rng = np.random.default_rng(7)
    gaps = {"ours": [], "next-fit": [], "ffd/bfd": []}
    seconds, cases = [], 0
    while cases < (40 if quick else 150):
        n = int(rng.integers(40, 1200))
        count, cap = int(rng.choice(COUNT_CAPS)), int(rng.choice([1024, 2048, 4096, 8192]))
        lens = np.minimum(rng.lognormal(rng.uniform(4, 7.5), rng.uniform(0.3, 1.3), n).astype(int) + 1, cap)
        if -(-n // count) < token_bound(lens, cap):
            continue
        cases += 1
        start = time.perf_counter()
        plan = plan_packs(lens, cap, count)
        seconds.append(time.perf_counter() - start)
        bound = plan.lower_bound
        for name, packs in (
            ("ours", plan.num_packs),
            ("next-fit", len(next_fit(lens, cap, count))),
            ("ffd/bfd", _greedy_decreasing(lens, cap, count)),
        ):
            gaps[name].append(packs / bound - 1)
    rows = []
    for baseline in ("next-fit", "ffd/bfd"):
        rows.append(
            {
                "section": "packing",
                "case": f"count cap binds: {cases} lognormal batches of 40-1200 samples, count cap 2-16",
                "metric": "mean packs over bound",
                "ours": float(np.mean(gaps["ours"])),
                "baseline": float(np.mean(gaps[baseline])),
                "vs": baseline,
                "ratio": (1 + np.mean(gaps["ours"])) / (1 + np.mean(gaps[baseline])),
                "max_over_bound": float(np.max(gaps["ours"])),
                "baseline_max_over_bound": float(np.max(gaps[baseline])),
                "note": f"worst: ours +{np.max(gaps['ours']):.1%}, {baseline} +{np.max(gaps[baseline]):.1%}; "
                f"plan median {np.median(seconds) * 1e3:.0f} ms, max {np.max(seconds) * 1e3:.0f} ms",
            }
        )
    return rows


def bench_packing(quick):
    return _token_binding(quick) + _count_binding(quick)
