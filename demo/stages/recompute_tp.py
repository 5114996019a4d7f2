"""Stage "recompute": paired recompute with real communication, a tiny Llama trained with tensor
parallelism 2 on 2 local ranks (ms-recompute over ms-models' TP shards, ms-pipeline's runtime).

The pretrain stage's DeepSeek-V3 has no tensor parallelism, so its recompute pairs have nothing to
overlap (``comms=0``). Here the two ranks (``ms_layout.comm.run_local``, gloo) are one TP=2 group:
``ms_recompute.runtime.tp_model`` cuts each decoder layer of a tiny Llama into Megatron's shards
(``ms_models.parallel``; embedding, final norm and head whole on both ranks), and
``tp_stage_blocks`` makes the four layers one ``TPStackBlock`` between the compiled embedding and
head of a one-stage ``PipelineRuntime`` (1F1B, jit). Every layer is fully recomputed: the forward
keeps only each layer's input, the backward runs it again, compiled segments (``mindspore.jit``)
between the layer's real all-reduces, which are asynchronous:

* ``paired``: layers (2, 3) and (0, 1) recompute together in the ping-pong order, one layer's
  all-reduce in flight while its partner computes; in the backward each f all-reduce is in flight
  while the same sublayer's weight gradients compute;
* ``sequential``: each layer recomputes alone and every all-reduce is waited for at once.

Over the same weights and batch both give the step's gradients: paired must equal sequential bit
for bit (the same graphs on the same values), and every gradient (a sharded weight's against the
same shard) must match the single-process model's -- no recompute, no TP, PyNative -- within
float32 rounding of its scale (demo/tolerance.py). (A third, compiled run without recompute would
add half a minute of compiling to the demo; ms-recompute's tests and bench_recompute compare it.)
The recorded recompute order must be the ping-pong order. Then paired and sequential steps
alternate to time the recompute part of the backward (the time spent inside recomputes, slowest
rank, minimum over repetitions; the whole step beside it, whose backward differs too: paired keeps
its f all-reduces in flight under the weight gradients): reported, not asserted. Last the paired
model trains a few Adam steps on the demo text (the loss must fall, the ranks agree).

Loopback makes communication free, so where network namespaces can be made (root, ``ip``, ``tc``)
the ranks run in their own namespaces over links held to ``RecomputeConfig.rate`` by a tbf qdisc
(``ms_layout.comm.netns.ShapedNetwork``); elsewhere over loopback. The stage records which.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from common import TEXT, StageResult, batches, setup_mindspore, timed, tokenize

PLANS = {
    "sequential": dict(recompute=True, paired=False, overlap=False),
    "paired": dict(recompute=True, paired=True, overlap=True),
}


@dataclass(frozen=True)
class RecomputeConfig:
    """The TP model, its data and the shaped link."""

    hidden: int = 256
    """Hidden size (4 heads of 64, 2 KV heads; MLP width 4 x hidden)."""
    layers: int = 4
    """Decoder layers: two recompute pairs."""
    micro_batch: int = 4
    """Samples per step (one microbatch)."""
    seq: int = 64
    """Tokens per sample."""
    steps: int = 4
    """Adam steps of the paired model."""
    lr: float = 3e-3
    """Adam learning rate."""
    reps: int = 4
    """Timed repetitions of each of sequential and paired (after one warm-up)."""
    rate: str = "200mbit"
    """Link rate of the shaped network, per direction. One layer's all-reduce (micro_batch x seq x
    hidden float32: 256 KiB at the defaults; gloo's ring on 2 ranks sends that much each way)
    takes about 10 ms there, 0.4 of one layer's recompute on loopback (about 25 ms on one CPU
    thread): bench_recompute's setting, communication a third to a half of a layer's compute.
    "" runs over loopback."""
    data_seed: int = 1
    """Seed of the batch offsets."""
    seed: int = 0
    """Seed of the initial weights."""
    timeout: float = 600.0
    """Seconds before the ranks are given up."""

    def model_overrides(self) -> dict:
        heads = 4
        return dict(
            num_hidden_layers=self.layers, hidden_size=self.hidden, num_attention_heads=heads,
            num_key_value_heads=2, head_dim=self.hidden // heads, intermediate_size=4 * self.hidden,
            tie_word_embeddings=False,
        )  # fmt: skip


def ping_pong(layers: int) -> list[str]:
    """The order a paired backward recomputes in, written out: pairs (a, a+1) from the last,
    each layer's attention all-reduce issued (>) and in flight while the partner computes (c),
    waited (<) before the layer's MLP segment -- ms_recompute.pairing's Step notation."""
    out = []
    for a in range(layers - 2, -1, -2):
        b = a + 1
        out += [f"{b}c0", f"{b}>0", f"{a}c0", f"{a}>0", f"{b}<0", f"{b}c1", f"{a}<0", f"{a}c1"]
    return out


def one_at_a_time(layers: int) -> list[str]:
    """The sequential order: each layer alone, its all-reduce waited for at once."""
    return [s for i in reversed(range(layers)) for s in (f"{i}c0", f"{i}>0", f"{i}<0", f"{i}c1")]


def _reference(model, ids, labels) -> tuple[float, dict[str, np.ndarray]]:
    """The single-process model's loss and gradients of one batch (PyNative ``value_and_grad``)."""
    import mindspore as ms
    from mindspore import ops

    params = model.trainable_params()

    def loss_fn():
        logits = model(ids)
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    loss, grads = ms.value_and_grad(loss_fn, None, params)()
    return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(params, grads)}


def _rank(group, config_data: dict, init_dir: str) -> dict:
    """One TP rank: the step's gradients under both plans, the reference's shard of them,
    the recompute orders, a few paired training steps and the timed repetitions."""
    import time

    import mindspore as ms
    from mindspore import device_context

    import ms_models
    import ms_pipeline as mp
    from ms_layout import shard
    from ms_recompute.runtime import TPStackBlock, tp_model, tp_stage_blocks

    t0 = time.perf_counter()
    setup_mindspore(1)
    device_context.cpu.op_tuning.threads_num(1)  # one compute thread per rank: 2 ranks on 2 cores
    config = RecomputeConfig(**config_data)
    data = batches(tokenize(init_dir, TEXT), config.steps + 1, 1, config.micro_batch, config.seq, config.data_seed)
    data = [[(ms.Tensor(x), ms.Tensor(y)) for x, y in step] for step in data]
    full = ms_models.from_pretrained(init_dir)
    ref_loss, ref = _reference(full, *data[0][0])
    net, layouts = tp_model(full, group)
    ref = {k: shard(g, layouts[k], group.rank) if k in layouts else g for k, g in ref.items()}

    phases = {"reference_s": time.perf_counter() - t0}
    solo = group.split([[r] for r in range(group.size)])  # a one-stage pipeline per rank
    schedule = mp.build("1f1b", 1, 1)
    shape = (config.micro_batch, config.seq, config.hidden)
    runtimes, stacks = {}, {}
    for name, options in PLANS.items():  # the same parameters under both plans
        (blocks,) = tp_stage_blocks(net, [config.layers], group, **options)
        opt = None
        if name == "paired":
            params = {id(p): p for b in blocks for p in b.trainable_params()}
            opt = ms.nn.Adam(list(params.values()), learning_rate=config.lr)
        runtimes[name] = mp.runtime.PipelineRuntime(
            schedule, {0: blocks}, solo, activation_shape=shape, jit=True, optimizer=opt
        )
        stacks[name] = next(b for b in blocks if isinstance(b, TPStackBlock)).pipeline_passes().stack

    # the step's gradients under each plan, from the same weights and batch (nothing applied yet)
    ids, labels = ([x] for x in data[0][0])
    grads, losses1, orders = {}, {}, {}
    for name, runtime in runtimes.items():
        start = time.perf_counter()
        losses1[name] = runtime.step(ids, labels).loss
        phases[f"first_step_{name}_s"] = time.perf_counter() - start
        grads[name] = runtime.grads()
        orders[name] = [str(s) for s in stacks[name].order]
        runtime.zero_grads()

    began = time.perf_counter()
    # time the recompute part: sequential and paired steps alternate (a warm-up, then reps)
    timing = {"sequential": [], "paired": []}
    for rep in range(1 + config.reps):
        for name in ("sequential", "paired") if rep % 2 == 0 else ("paired", "sequential"):
            group.barrier()
            start = time.perf_counter()
            runtimes[name].step(ids, labels)
            step_s = time.perf_counter() - start
            runtimes[name].zero_grads()
            stack = stacks[name]
            blocked = sum(e.end - e.start for e in stack.events if e.op == "wait")
            if rep:
                timing[name].append((stack.recompute_s, step_s, blocked))
    for name, rows in timing.items():
        arr = np.array(rows, dtype=np.float64)
        group.all_reduce(arr, op="max")  # the slowest rank decides a step
        timing[name] = {"min": arr.min(axis=0).tolist(), "median": np.median(arr, axis=0).tolist()}
    buf = np.ones(config.micro_batch * config.seq * config.hidden, np.float32)
    ar = []
    for _ in range(4):
        group.barrier()
        start = time.perf_counter()
        group.all_reduce(buf)
        ar.append(time.perf_counter() - start)

    phases["timed_s"] = time.perf_counter() - began
    began = time.perf_counter()
    # train: the paired model, Adam, on the steps' batches
    paired, losses = runtimes["paired"], []
    for step in data[1:]:
        losses.append(paired.step([step[0][0]], [step[0][1]]).loss)
        paired.optimizer_step()
    phases["train_s"] = time.perf_counter() - began
    return {
        "phases_s": {k: round(v, 2) for k, v in phases.items()},
        "rank": group.rank,
        "ref_loss": ref_loss,
        "ref": ref,
        "losses1": losses1,
        "grads": grads,
        "orders": orders,
        "timing": timing,
        "allreduce_ms": 1e3 * float(np.median(ar[1:])),
        "losses": losses,
        "sharded": sorted(layouts),
    }


def _train(config: RecomputeConfig, init_dir: str) -> tuple[list[dict], dict]:
    """Run the two ranks over the shaped link where namespaces can be made, else over loopback."""
    from ms_layout.comm import run_local
    from ms_layout.comm.netns import ShapedNetwork, available

    args = dict(backend="gloo", args=(asdict(config), init_dir), timeout=config.timeout, env={"OMP_NUM_THREADS": "1"})
    ok, why = available() if config.rate else (False, "no rate configured")
    if ok:
        with ShapedNetwork(2, rate=config.rate) as net:
            ranks = run_local(_rank, 2, network=net, **args)
            sent = [net.sent_bytes(r) for r in range(2)]
        return ranks, {"link": f"shaped {config.rate} per direction (network namespaces, tbf)", "sent_bytes": sent}
    return run_local(_rank, 2, **args), {"link": "loopback", "why_not_shaped": why}


def run(config: RecomputeConfig, work: Path) -> StageResult:
    from tolerance import float32_rtol

    import ms_models

    result = StageResult("recompute")
    with timed(result):
        init_dir = ms_models.make_tiny("llama", work / "recompute_init", seed=config.seed, **config.model_overrides())
        ranks, link = _train(config, init_dir)
        vocab = ms_models.load_config(init_dir).vocab_size
        tokens = config.micro_batch * config.seq
        # the step vs the single-process model: one pass of forward and backward through
        # embedding, layers and head, reductions at most max(hidden, MLP, vocab, seq) long
        rtol = float32_rtol(
            layers=config.layers + 2, widest=max(4 * config.hidden, vocab, config.seq), tokens=tokens, passes=1
        )

        bitwise, worst, worst_name, names_ok = True, 0.0, "", True
        for r in ranks:
            g = r["grads"]
            names_ok &= set(g["paired"]) == set(r["ref"]) == set(g["sequential"])
            for key in g["paired"]:
                bitwise &= np.array_equal(g["paired"][key], g["sequential"][key])
                want, got = np.asarray(r["ref"][key], np.float64), np.asarray(g["paired"][key], np.float64)
                scale = max(np.abs(want).max(), np.abs(got).max())
                rel = float(np.abs(want - got).max() / scale) if scale > 0 else 0.0
                if rel > worst:
                    worst, worst_name = rel, f"rank {r['rank']} {key}"
        n_grads = len(ranks[0]["grads"]["paired"])
        result.check(
            "paired recompute's gradients == sequential recompute's, bit for bit",
            bitwise and names_ok,
            f"{n_grads} gradients per rank ({len(ranks[0]['sharded'])} of them TP shards), both ranks",
        )
        loss_rel = max(abs(r["losses1"][p] - r["ref_loss"]) / abs(r["ref_loss"]) for r in ranks for p in PLANS)
        result.check(
            "gradients and loss == the single-process model's (no recompute) within float32 rounding of their scale",
            names_ok and worst <= rtol.value and loss_rel <= rtol.value,
            f"worst gradient {worst:.2e} ({worst_name}), loss {loss_rel:.2e};"
            f" rtol {rtol.value:.2e} = {rtol.derivation}",
        )
        pp, seq_order = ping_pong(config.layers), one_at_a_time(config.layers)
        result.check(
            "the pairs recomputed in the ping-pong order, sequential one layer at a time",
            all(r["orders"]["paired"] == pp and r["orders"]["sequential"] == seq_order for r in ranks),
            " ".join(ranks[0]["orders"]["paired"]),
        )
        if "sent_bytes" in link:  # the TP all-reduces crossed the shaped links, not some other path
            # per step 20 all-reduces of the activation (per layer: 2 forward, 1 recompute, 2 backward);
            # on 2 ranks each sends at least half of it (a ring's reduce-scatter and all-gather)
            steps = len(PLANS) + 2 * (1 + config.reps) + config.steps
            least = steps * 5 * config.layers * tokens * config.hidden * 4 // 2
            result.check(
                "the all-reduces crossed the shaped link",
                min(link["sent_bytes"]) >= least,
                f"sent {link['sent_bytes']} bytes per rank's namespace, at least {least} expected",
            )
        losses = ranks[0]["losses"]
        result.check(
            "paired TP training: the ranks agree and the loss falls",
            all(r["losses"] == losses for r in ranks) and np.isfinite(losses).all() and losses[-1] < losses[0],
            f"{losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} Adam steps",
        )
        t = ranks[0]["timing"]
        seq_s, pair_s = t["sequential"]["min"][0], t["paired"]["min"][0]
        result.numbers = {
            **link,
            "model": f"llama, {config.layers} layers, hidden {config.hidden}, MLP {4 * config.hidden}, TP=2",
            "tokens_per_step": tokens,
            "allreduce_MB": round(tokens * config.hidden * 4 / 2**20, 3),
            "allreduce_ms": round(ranks[0]["allreduce_ms"], 2),
            "recompute_ms_sequential": round(seq_s * 1e3, 1),
            "recompute_ms_paired": round(pair_s * 1e3, 1),
            "recompute_paired_over_sequential": round(pair_s / seq_s, 3),
            "recompute_median_ms_sequential": round(t["sequential"]["median"][0] * 1e3, 1),
            "recompute_median_ms_paired": round(t["paired"]["median"][0] * 1e3, 1),
            "step_ms_sequential": round(t["sequential"]["min"][1] * 1e3, 1),
            "step_ms_paired": round(t["paired"]["min"][1] * 1e3, 1),
            "step_paired_over_sequential": round(t["paired"]["min"][1] / t["sequential"]["min"][1], 3),
            "blocked_ms_sequential": round(t["sequential"]["median"][2] * 1e3, 1),
            "blocked_ms_paired": round(t["paired"]["median"][2] * 1e3, 1),
            "timed_reps": config.reps,
            "rank0_phases_s": ranks[0]["phases_s"],
            "paired_order": " ".join(ranks[0]["orders"]["paired"]),
            "max_relative_grad_err": worst,
            "rtol": rtol.value,
            "losses": losses,
            "first_loss": losses[0],
            "last_loss": losses[-1],
        }
    return result
