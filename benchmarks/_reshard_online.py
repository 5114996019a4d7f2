"""bench_reshard section 3: the online executor on 2 and 4 gloo ranks against transport floors.

A Llama-like model (hidden 512, 4 layers) resharded from data parallel with optimizer sharding
(and tp=2 on 4 ranks) to tensor parallel with fused qkv/gate_up, on CPU processes over gloo.
Every repeat runs, in turn and on every rank, the reshard (bucketed, then per tensor) and the
baselines, so that each repeat's ratios compare runs made under the same load; the rows give the
median over repeats of the slowest rank's time and of each ratio.

"The same bytes" (docs/ms-reshard.md, Reading the numbers): the reshard receives the plan's bytes
from its peers and also copies its own overlap of source and target shards (on 2 ranks 38.5 MB a
rank against 3.9 MB received). One all-to-all of the same bytes moves both: torch/gloo's
all_to_all_single copies the caller's own chunk locally, so the baseline `all_to_all_same_bytes`
sends every peer exactly what the plan sends it and gives the rank's own chunk the size of its
local copies (uneven splits). The older baselines stay: `all_to_all` (the received bytes in equal
parts to every other rank, no local part), `+copy` (that plus one memcpy of the copied bytes, run
after it), `ring` (the received bytes as one message around a ring) and a one-process memcpy.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from ms_layout import ParallelConfig
from ms_reshard import DEFAULT_FUSIONS, model_plan, param_specs

GB, MB = 1e9, 1e6


def llama_shapes(layers=4, hidden=512, inter=1408, vocab=8192) -> dict[str, tuple[int, ...]]:
    s = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        s |= {p + n: (hidden,) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
        s |= {p + f"self_attn.{n}_proj.weight": (hidden, hidden) for n in "qkvo"}
        s |= {p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden)}
        s[p + "mlp.down_proj.weight"] = (hidden, inter)
    return s


ONLINE = {  # ranks -> (train, serve): both on the same ranks, fused qkv/gate_up when serving
    2: (ParallelConfig(dp=2, optimizer_shard=True), ParallelConfig(tp=2)),
    4: (ParallelConfig(dp=2, tp=2, optimizer_shard=True), ParallelConfig(tp=4)),
}
MODES = ("bucketed", "per_tensor")
FLOORS = ("all_to_all_same_bytes", "all_to_all", "ring", "copy")


def online_plan(nprocs: int = 4):
    shapes = llama_shapes()
    train, serve = ONLINE[nprocs]
    src = param_specs(shapes, train, num_layers=4)
    dst = param_specs(shapes, serve, num_layers=4, fusions=DEFAULT_FUSIONS)
    return shapes, src, dst, model_plan(src, dst)


def traffic(mp, n: int) -> tuple[np.ndarray, np.ndarray]:
    """([n, n] bytes rank i sends rank j, [n] bytes each rank copies locally), over every move."""
    sent, copied = np.zeros((n, n), dtype=np.int64), np.zeros(n, dtype=np.int64)
    for m in mp.moves:
        p = m.plan
        ranks = p.ranks
        sent[np.ix_(ranks, ranks)] += p.traffic_matrix()
        elems = np.prod(p.copy_box[:, :, 1] - p.copy_box[:, :, 0], axis=1)
        np.add.at(copied, ranks[p.copy_id], elems * p.itemsize)
    return sent, copied


def online_rank(group, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from ms_layout.comm import P2POp
    from ms_reshard.exchange import run_plans

    me, n = group.rank, len(group.ranks)
    shapes, src, dst, mp = online_plan(n)
    rng = np.random.default_rng(0)
    weights = {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
    shards = {k: np.ascontiguousarray(weights[k][s.layout.global_slice(s.shape, me)]) for k, s in src.items()}
    out = {k: np.empty(s.layout.shard_shape(s.shape), np.float32) for k, s in dst.items() if me in s.layout.ranks}
    items = []
    for m in mp.moves:
        p = m.plan
        n_src, n_dst = p.src.shard_shape(p.shape)[m.dim], p.dst.shard_shape(p.shape)[m.dim]
        s_part = shards[m.src_name][m.src_offset : m.src_offset + n_src] if me in p.src.ranks else None
        d_part = out[m.dst_name][m.dst_offset : m.dst_offset + n_dst] if me in p.dst.ranks else None
        items.append((p, s_part, d_part, None))
    sent, copied = traffic(mp, n)
    # all_to_all_same_bytes: to every peer what the plan sends it, the rank's own chunk its copies
    in_split = [int(copied[me]) // 4 if q == me else int(sent[me, q]) // 4 for q in range(n)]
    out_split = [int(copied[me]) // 4 if q == me else int(sent[q, me]) // 4 for q in range(n)]
    a2a_in, a2a_out = torch.ones(sum(in_split)), torch.empty(sum(out_split))
    # the older floors: the rank's share of the received bytes (moved / n) in equal parts
    size = mp.bytes_moved() // n // 4
    send, recv = np.ones(size, np.float32), np.empty(size, np.float32)
    part = size // (n - 1)
    a, b = np.ones(int(copied[me]) // 4, np.float32), np.empty(int(copied[me]) // 4, np.float32)

    def ring():
        ops = [P2POp("send", send, (me + 1) % n), P2POp("recv", recv, (me - 1) % n)]
        for work in group.batch_isend_irecv(ops):
            work.wait()

    def all_to_all():
        ops = []
        for k, peer in enumerate(q for q in range(n) if q != me):
            piece = slice(k * part, (k + 1) * part)
            ops += [P2POp("send", send[piece], peer), P2POp("recv", recv[piece], peer)]
        for work in group.batch_isend_irecv(ops):
            work.wait()

    runs = {
        "bucketed": lambda: run_plans(items, group, collectives=False),
        "per_tensor": lambda: run_plans(items, group, collectives=False, bucket_bytes=None),
        "all_to_all_same_bytes": lambda: dist.all_to_all_single(a2a_out, a2a_in, out_split, in_split),
        "all_to_all": all_to_all,
        "ring": ring,
        "copy": lambda: np.copyto(b, a),
    }
    for fn in runs.values():  # warm up: op lists, gloo pairs, page faults
        group.barrier()
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            group.barrier()
            t0 = time.perf_counter()
            fn()
            if name != "copy":  # the copy is this rank's alone
                group.barrier()
            times[name].append(time.perf_counter() - t0)
    ok = all(np.array_equal(out[k], _expected(k, s, weights, me)) for k, s in dst.items() if me in s.layout.ranks)
    return {"times": times, "ok": ok, "copied": int(copied[me]), "received": int(sent[:, me].sum())}


def _expected(name, spec, weights, rank):
    """Reference shard: a fused parameter holds its parts' shards side by side."""
    if name in weights:
        return weights[name][spec.layout.global_slice(spec.shape, rank)]
    prefix, module, _ = name.rsplit(".", 2)
    rule = next(r for r in DEFAULT_FUSIONS if r.fused == module)
    parts = [weights[f"{prefix}.{p}.weight"] for p in rule.parts]
    return np.concatenate([w[spec.layout.global_slice(w.shape, rank)] for w in parts])


def bench_online(repeats: int, short, nprocs_list=(2, 4)) -> list[dict]:
    from ms_layout.comm import run_local

    rows = []
    for nprocs in nprocs_list:
        load = os.getloadavg()[0]
        results = run_local(online_rank, nprocs=nprocs, backend="gloo", timeout=300, args=(repeats,))
        load = (load + os.getloadavg()[0]) / 2
        _, _, _, mp = online_plan(nprocs)
        moved = mp.bytes_moved()
        if not all(r["ok"] for r in results):
            raise SystemExit("online reshard gave wrong shards")
        # per repeat, the slowest rank (the reshard is done when its last rank is)
        slowest = {k: [max(r["times"][k][i] for r in results) for i in range(repeats)] for k in MODES + FLOORS}
        a = np.ones(moved // 4, np.float32)
        b = np.empty_like(a)
        memcpy = min(_timed(lambda a=a, b=b: np.copyto(b, a)) for _ in range(5))  # one process, same bytes

        train, serve = ONLINE[nprocs]
        for mode in MODES:
            seconds = statistics.median(slowest[mode])
            rows.append(
                {
                    "section": "online",
                    "case": f"Llama h512 x4 layers, {short(train)} -> {short(serve)} fused, {nprocs} gloo ranks, "
                    f"{mode.replace('_', ' ')}",
                    "moved_MB": round(moved / MB, 1),
                    "lower_bound_MB": round(mp.lower_bound_total() / MB, 1),
                    "copied_MB_per_rank": round(max(r["copied"] for r in results) / MB, 1),
                    "seconds": round(seconds, 4),
                    "GB/s": round(moved / seconds / GB, 3),
                    "memcpy_GB/s": round(moved / memcpy / GB, 3),
                    "reshard/memcpy_time": round(seconds / memcpy, 1),
                    "gloo_ring_GB/s": round(moved / statistics.median(slowest["ring"]) / GB, 3),
                    "reshard/gloo_ring_time": _ratio(slowest, mode, "ring"),
                    "reshard/all_to_all_time": _ratio(slowest, mode, "all_to_all"),
                    "reshard/(all_to_all+copy)_time": _ratio(slowest, mode, "all_to_all", "copy"),
                    "all_to_all_same_bytes_s": round(statistics.median(slowest["all_to_all_same_bytes"]), 4),
                    "reshard/all_to_all_same_bytes_time": _ratio(slowest, mode, "all_to_all_same_bytes"),
                    "repeats": repeats,
                    "load_avg_1m": round(load, 2),
                }
            )
    return rows


def _ratio(slowest: dict[str, list[float]], mode: str, *floors: str) -> float:
    """Median over repeats of the mode's time over the floors' summed time in the same repeat."""
    per_repeat = [t / sum(slowest[f][i] for f in floors) for i, t in enumerate(slowest[mode])]
    return round(statistics.median(per_repeat), 2)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
