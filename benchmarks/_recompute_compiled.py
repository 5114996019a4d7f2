"""bench_recompute's compiled rows: ms_recompute.runtime.CompiledTPStack on 2 gloo ranks.

The same stack of TP Llama layers as the PyNative rows, trained by compiled segments (one
``mindspore.jit`` graph between two collectives). Three plans alternate, a repetition each:
``none`` keeps every layer's values (no recompute), ``sequential`` recomputes each layer alone and
waits for every all-reduce at once (the backward's too), ``paired`` recomputes layers in pairs in
the ping-pong order and keeps each backward all-reduce in flight while the same sublayer's weight
gradients compute. Figures are per step, slowest rank: the recompute part, the whole backward, and
the time blocked in ``wait``.
"""

from __future__ import annotations

import time

import numpy as np

PLANS = {
    "none": dict(recompute=False, paired=False, overlap=False),
    "sequential": dict(recompute=True, paired=False, overlap=False),
    "paired": dict(recompute=True, paired=True, overlap=True),
}


def tp_stack(size, layers: int, batch: int, seq: int, group):
    """This rank's TP copy of a Llama stack of `size` = (hidden, heads, kv heads, MLP width), and a
    fixed input (x, cos, sin, allowed) and output gradient of batch x seq tokens."""
    import mindspore as ms

    import ms_models
    from ms_recompute.runtime import tp_model

    hidden, heads, kv, inter = size
    config = ms_models.tiny_config(
        "llama",
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        head_dim=hidden // heads,
    )
    model, _ = tp_model(ms_models.from_config(config, seed=0), group)
    rng = np.random.default_rng(0)
    x = ms.Tensor(rng.normal(size=(batch, seq, hidden)).astype(np.float32))
    dout = ms.Tensor(rng.normal(size=(batch, seq, hidden)).astype(np.float32))
    cos, sin = model.model.rotary_emb(ms.Tensor(np.tile(np.arange(seq, dtype=np.int32), (batch, 1))))
    allowed = ms.Tensor(np.tril(np.ones((seq, seq), bool))[None, None])
    return model, (x, cos, sin, allowed), dout


def measure(group, size, layers: int, batch: int, seq: int, warm: int, reps: int, keep_trace: bool) -> dict:
    """Per plan: min and median over repetitions of (recompute s, backward s, blocked s), slowest
    rank; the executed recompute order of the paired plan; optionally the last repetition's events."""
    from ms_recompute.runtime import CompiledTPStack

    model, inputs, dout = tp_stack(size, layers, batch, seq, group)
    shards = [layer.layer for layer in model.model.layers]
    stacks = {name: CompiledTPStack(shards, group, **kwargs) for name, kwargs in PLANS.items()}
    measured = {name: [] for name in PLANS}
    traces, orders = {}, {}
    names = list(PLANS)
    for rep in range(warm + reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            stack = stacks[name]
            group.barrier()
            _, kept = stack.forward(*inputs)
            group.barrier()
            start = time.perf_counter()
            dx, _ = stack.backward(kept, dout)
            dx.asnumpy()
            backward_s = time.perf_counter() - start
            waits = sum(e.end - e.start for e in stack.events if e.op == "wait" and e.start >= start)
            if rep >= warm:
                measured[name].append((stack.recompute_s, backward_s, waits))
            orders[name] = [str(s) for s in stack.order]
            if keep_trace and rep == warm + reps - 1:
                traces[name] = [
                    {"rank": group.rank, "layer": e.layer, "op": e.op, "index": e.index, "start": e.start, "end": e.end}
                    for e in stack.events
                    if e.start >= start
                ]
    out = {}
    for name in PLANS:
        arr = np.array(measured[name], dtype=np.float64)
        group.all_reduce(arr, op="max")  # the slowest rank decides a step
        out[name] = {"median": np.median(arr, axis=0).tolist(), "min": arr.min(axis=0).tolist()}
    out["orders"], out["traces"] = orders, traces
    return out


def recompute_columns(hidden: int, tokens: int, layers: int, ar_ms: float, seq: dict, pair: dict) -> dict:
    """The columns every recompute row has (PyNative and compiled): the all-reduce, the recompute
    part sequential vs paired (min, median) and the time blocked in wait."""
    return {
        "hidden": hidden,
        "tokens": tokens,
        "allreduce_MB": round(tokens * hidden * 4 / 2**20, 2),
        "allreduce_ms": round(ar_ms, 2),
        "recompute_ms_sequential": round(seq["min"][0] * 1e3, 1),
        "recompute_ms_paired": round(pair["min"][0] * 1e3, 1),
        "paired/sequential": round(pair["min"][0] / seq["min"][0], 3),
        "comm_bound_%": round(100 * layers * ar_ms / (seq["min"][0] * 1e3), 1),
        "median_ms_sequential": round(seq["median"][0] * 1e3, 1),
        "median_ms_paired": round(pair["median"][0] * 1e3, 1),
        "blocked_ms_sequential": round(seq["median"][2] * 1e3, 1),
        "blocked_ms_paired": round(pair["median"][2] * 1e3, 1),
    }


def rows(sizes, results, layers: int, tokens: int, allreduce_ms: list[float]) -> list[dict]:
    """Per size: recompute part and backward, sequential vs paired (min over repetitions), with the
    no-recompute backward beside them; ``comm_bound_%``: the recompute's all-reduces timed alone over
    the sequential recompute part."""
    out = []
    for size, r, ar_ms in zip(sizes, results, allreduce_ms):
        seq, pair, none = r["sequential"], r["paired"], r["none"]
        out.append(
            {
                **recompute_columns(size[0], tokens, layers, ar_ms, seq, pair),
                "backward_ms_none": round(none["min"][1] * 1e3, 1),
                "backward_ms_sequential": round(seq["min"][1] * 1e3, 1),
                "backward_ms_paired": round(pair["min"][1] * 1e3, 1),
                "backward paired/sequential": round(pair["min"][1] / seq["min"][1], 3),
            }
        )
    return out
