"""The GRPO trainer: rollout -> rewards -> packs -> old/ref log-probs -> updates -> weight sync.

One process per rank; ranks are DP replicas of the training model and DP inference instances
(``rollout_instances`` per rank, run one after another). Per step:

1. the next N prompts from the PromptStream (same on every rank); N*n requests;
2. uniform sampling (sampling.py) places them on the W * I inference instances; each rank
   generates its instances' requests; completions are all-gathered and put back in group order;
3. rewards from the task, group-normalised advantages;
4. per mini-batch (``updates_per_rollout``): packs (or padded batches) spread over the ranks;
   old-policy log-probs (the rollout weights) and reference log-probs for this rank's rows;
5. per mini-batch: gradients of sum(w * l) over this rank's micro-batches, all-reduced by SUM
   over ranks, global-norm clipped, one Adam step on the master weights (this rank's shard with
   optimizer sharding);
6. ms-reshard moves the master weights into the training model after each update and into the
   rollout model after the step (and into the reference model every ``ref_sync_every`` steps).

Checkpoints hold the master shards, the reference shards, the Adam state, the data cursor, the
RNG states and the history; a resumed run loads them and reshards into the three models rather
than reading any model weights from disk again.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .. import checkpoint
from ..config import TrainConfig
from ..errors import CheckpointError, RLHFError
from ..sampling import split
from ..tasks import PromptStream, make_task
from . import elastic
from .experience import make_experience, micro_batches, weights_for
from .group import SingleProcessGroup, all_gather_objects, tp_and_dp_groups, world_group
from .pipelined import PipelinedActor, owners
from .policy import LossStats, PolicyFunctions, build_model, response_values, row_weights
from .rollout import Completion, EmbeddedEngine, Request
from .sync import WeightSync

log = logging.getLogger("ms_rlhf")


class GRPOTrainer:
    """GRPO on a verifiable task (see the module docstring); `group` defaults to ms_layout.comm's
    world when initialised, else a single process."""

    def __init__(self, config: TrainConfig, group=None, engine=None):
        import mindspore as ms
        from mindspore import Parameter, Tensor, nn

        from ms_models.parallel import training_shard

        self.config, cfg = config, config
        self.group = world_group(group)
        self.rank, self.world = int(self.group.rank), int(self.group.size)
        self.task = make_task(cfg.task.name, **cfg.task.params)
        self.tokenizer = self.task.tokenizer
        self.stream = PromptStream(self.task, cfg.seed, cfg.task.dataset_size)
        self._groups(cfg)
        model = build_model(cfg, self.tokenizer, cfg.seed)
        self.model_config = model.config
        full = {n: p.asnumpy() for n, p in model.parameters_and_names()}
        self.model = model if cfg.parallel.tp == 1 else training_shard(model, self.tp_group)
        # Only the training model starts from the initial weights; the other two start elsewhere
        # and get theirs through weight sync, which is what the tests check.
        self.infer_model = build_model(cfg, self.tokenizer, cfg.seed + 1000)
        self.ref_model = build_model(cfg, self.tokenizer, cfg.seed + 2000)
        self.actor, owner = None, None
        if cfg.parallel.pp > 1:  # micro-batches of one mini-batch: the pipeline's m
            rows, samples = cfg.packing.micro_batch_size, cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
            m = -(-samples // cfg.optimizer.updates_per_rollout // rows)
            self.actor = PipelinedActor(model, self.group, m, rows, cfg.packing.max_len, cfg)
            owner = owners(full, self.model_config.num_hidden_layers, self.actor.schedule)
        self.sync = WeightSync(self.model_config, self.group, cfg.parallel.optimizer_shard, cfg.parallel.tp, owner)
        self.master = {n: Parameter(Tensor(full[n][self.sync.master_slice(n)].copy()), name=f"master.{n}")
                       for n in self.sync.master if self.sync.held(n)}  # fmt: skip
        self.ref_shards = {n: p.asnumpy().copy() for n, p in self.master.items()}
        self.trainable = [p.name for p in self.model.trainable_params() if p.name in self.master]
        self.optimizer = nn.Adam([self.master[n] for n in self.trainable], learning_rate=cfg.optimizer.lr)
        # the TP shard's collectives run on the host, between compiled pieces: eager under tp > 1;
        # under pp > 1 the whole rollout model gives the old log-probs (the same weights)
        policy_model = self.infer_model if cfg.parallel.pp > 1 else self.model
        loss = cfg.loss
        self.policy = PolicyFunctions(policy_model, loss.clip_eps, loss.kl_coef, cfg.jit and cfg.parallel.tp == 1)
        self.reference = PolicyFunctions(self.ref_model, loss.clip_eps, loss.kl_coef, cfg.jit)
        rollout = cfg.rollout
        mode = rollout.mode if rollout.mode != "auto" else ("jit" if cfg.jit else "paged")
        if engine is None and rollout.engine == "vllm":
            from .vllm_engine import VllmEngine

            engine = VllmEngine.from_model(self.infer_model, self.tokenizer, cfg)
        self.engine = engine or EmbeddedEngine(self.infer_model, self.tokenizer.eos_id, rollout.temperature, mode,
                                               rollout.block_size)  # fmt: skip
        self.step_count, self.history, self.length_memory = 0, [], {}
        self.last_sync = self._sync_all(ref=True)
        self._ms = ms

    def _groups(self, cfg: TrainConfig) -> None:
        """DP, TP and PP sizes and groups of this run: DP replicas of tp consecutive ranks, or one
        pipeline over every rank."""
        tp, pp = cfg.parallel.tp, cfg.parallel.pp
        if self.world % tp or (pp > 1 and self.world != pp):
            raise RLHFError(f"config parallel.tp={tp}, parallel.pp={pp} do not fit the {self.world} ranks of this run "
                            "(tp must divide them; pipeline training runs on exactly pp ranks)")  # fmt: skip
        self.tp, self.pp = tp, pp
        self.dp = self.world // (tp * pp)
        self.dp_rank = self.rank // tp if pp == 1 else 0
        self.tp_group, self.dp_group = tp_and_dp_groups(self.group, tp)
        if pp > 1:
            self.dp_group = SingleProcessGroup()

    # ------------------------------------------------------------------------------- weight sync
    def _sync_all(self, ref: bool = False) -> dict:
        train = self.sync.run(self.master, dict(self.model.parameters_and_names()), to="train")
        infer = self.sync.run(self.master, self.engine.weight_targets())
        if ref:
            self.sync.run(self.ref_shards, dict(self.ref_model.parameters_and_names()))
        return {"sync_s": train.seconds + infer.seconds, "sync_received_bytes": infer.received_bytes}

    # ------------------------------------------------------------------------------- rollout
    def _rollout(self, batch) -> tuple[list, list, dict]:
        cfg = self.config.rollout
        n = cfg.samples_per_prompt
        prompts = [self.tokenizer.encode(p.text) for _, p in batch for _ in range(n)]
        requests = [Request(r, tuple(prompts[r]), (self.config.seed, self.step_count, r), cfg.max_new_tokens)
                    for r in range(len(prompts))]  # fmt: skip
        predicted = [self.length_memory.get(str(idx), cfg.max_new_tokens) for idx, _ in batch for _ in range(n)]
        instances = self.world * cfg.instances
        assignment = split(cfg.strategy, len(batch), n, instances, predicted)
        per_batch = -(-len(requests) // instances)
        mine, times = [], []
        for k in range(self.rank * cfg.instances, (self.rank + 1) * cfg.instances):
            start = time.perf_counter()
            mine.append(self.engine.generate([requests[r] for r in assignment.instances[k]], batch=per_batch))
            times.append(time.perf_counter() - start)
        gathered = all_gather_objects(self.group, [_encode(c) for out in mine for c in out])
        flat = [_decode(a) for rank_rows in gathered for a in rank_rows]
        per_instance, i = [], 0
        for inst in assignment.instances:
            per_instance.append(flat[i : i + len(inst)])
            i += len(inst)
        completions = assignment.restore(per_instance)
        inst_times = np.zeros(self.world * cfg.instances)
        inst_times[self.rank * cfg.instances : (self.rank + 1) * cfg.instances] = times
        self.group.all_reduce(inst_times)
        return prompts, completions, {"rollout_makespan_s": float(inst_times.max()),
                                      "rollout_sum_s": float(inst_times.sum())}  # fmt: skip

    # ------------------------------------------------------------------------------- one step
    def step(self) -> dict:
        """Run one GRPO step; returns its metrics."""
        cfg, t0 = self.config, time.perf_counter()
        n, updates, packing = cfg.rollout.samples_per_prompt, cfg.optimizer.updates_per_rollout, cfg.packing
        batch = self.stream.next(cfg.rollout.prompts_per_step)
        prompts, completions, metrics = self._rollout(batch)
        rewards = [self.task.reward(p, c.tokens) for (_, p), c in zip(_repeat(batch, n), completions)]
        exp = make_experience(prompts, completions, rewards, n)
        self._remember_lengths(batch, exp)
        t_train = time.perf_counter()
        total = len(exp.sequences)
        size = total // updates
        width = None  # eager: each micro-batch as wide as its rows
        if self.pp > 1 or (cfg.jit and packing.enabled):  # one shape: one pipeline, one compiled graph
            width = packing.max_len
        elif cfg.jit:
            width = max(len(p) for p in prompts) + cfg.rollout.max_new_tokens
        plans, pack_stats = [], {"packs": 0, "pack_lower_bound": 0, "row_tokens": 0, "pad_tokens": 0}
        for u in range(updates):
            samples = range(u * size, (u + 1) * size)
            mbs, stats = micro_batches(exp, samples, self.dp_rank, self.dp, packing.enabled, packing.max_len,
                                       packing.max_count, packing.micro_batch_size, width)  # fmt: skip
            for k in pack_stats:
                pack_stats[k] += stats[k]
            # old-policy and reference log-probs, before any update of this rollout
            olds = [self.policy.logprobs(mb.rows) for mb in mbs]
            refs = [self.reference.logprobs(mb.rows) for mb in mbs]
            plans.append((samples, mbs, olds, refs))
        mismatch = self._mismatch(exp, plans)
        sums = LossStats()
        for samples, mbs, olds, refs in plans:
            sums = sums + self._update(exp, samples, mbs, olds, refs)
        train_s = time.perf_counter() - t_train
        every = cfg.loss.ref_sync_every
        ref_sync = bool(every) and (self.step_count + 1) % every == 0
        if ref_sync:
            self.ref_shards = {n: p.asnumpy().copy() for n, p in self.master.items()}
        sync = self._sync_all(ref=ref_sync)
        self.step_count += 1
        tokens = int(sum(len(s) for s in exp.sequences))
        loss_tokens = max(int(exp.response_lens.sum()), 1)
        metrics.update(
            step=self.step_count,
            reward=float(exp.rewards.mean()),
            accuracy=float((exp.rewards == 1.0).mean()),
            loss=sums.loss / updates,
            pg=_per(sums.pg, updates),  # None under pp > 1 (the loss alone comes back)
            kl=_per(sums.kl, updates),
            clip_frac=_per(sums.clipped, loss_tokens * updates),
            response_len=float(exp.response_lens.mean()),
            train_s=train_s,
            train_tokens_per_s=tokens / train_s,
            step_s=time.perf_counter() - t0,
            tokens_per_s=tokens / (time.perf_counter() - t0),
            infer_train_logprob_maxdiff=mismatch,
            **pack_stats,
            **sync,
        )
        self.history.append(metrics)
        return metrics

    def _update(self, exp, samples, mbs, olds, refs) -> LossStats:
        cfg = self.config
        weights = weights_for(exp, samples, cfg.loss.aggregation)
        if self.actor is not None:  # the pipeline runs every micro-batch in one step
            w = [[row_weights(r, weights) for r in mb.rows] for mb in mbs]
            loss, by_name = self.actor.loss_and_grads(mbs, w, exp.advantages, olds, refs)
            acc = [by_name[n] for n in self.trainable]
            stats = LossStats(loss, None, None, None)  # the pipeline returns the loss alone
        else:
            acc, stats = self._micro_batch_grads(mbs, weights, exp.advantages, olds, refs)
        flat = np.concatenate([a.reshape(-1) for a in acc] + [stats.to_array().astype(np.float32)])
        self.dp_group.all_reduce(flat)  # SUM: the weights already hold the global 1/|s| and 1/S factors
        grads, offset = [], 0
        for a in acc:
            grads.append(flat[offset : offset + a.size].reshape(a.shape))
            offset += a.size
        stats = LossStats.from_array(flat[offset:].astype(np.float64))
        clip = cfg.optimizer.max_grad_norm
        if clip > 0:
            norm = self._grad_norm(grads)
            scale = min(1.0, clip / (norm + 1e-6))
            grads = [g * np.float32(scale) for g in grads] if scale < 1.0 else grads
        Tensor = self._ms.Tensor
        self.optimizer(tuple(Tensor(np.ascontiguousarray(g[self.sync.master_in_train(n)]))
                             for n, g in zip(self.trainable, grads)))  # fmt: skip
        self.sync.run(self.master, dict(self.model.parameters_and_names()), to="train")
        return stats

    def _micro_batch_grads(self, mbs, weights, adv, olds, refs) -> tuple[list, LossStats]:
        """Gradients and LossStats summed over this rank's micro-batches, one by one."""
        acc = [np.zeros(p.shape, np.float32) for p in self.policy.params]
        stats = LossStats()
        for mb, old, ref in zip(mbs, olds, refs):
            w = [row_weights(r, weights) for r in mb.rows]
            s, grads = self.policy.loss_and_grads(mb.rows, w, adv, list(old), list(ref))
            stats = stats + s
            for a, g in zip(acc, grads):
                a += g
        return acc, stats

    def _grad_norm(self, grads) -> float:
        """The global gradient norm: a TP-split gradient's squares summed over the TP ranks, a
        pipeline stage's over the stages' ranks, a replicated one's counted once."""
        whole, split = 0.0, np.zeros(1)
        for n, g in zip(self.trainable, grads):
            square = float(np.dot(g.reshape(-1).astype(np.float64), g.reshape(-1)))
            if self.pp > 1 or self.sync.tp_split(n):
                split[0] += square
            else:
                whole += square
        if self.pp > 1:
            self.group.all_reduce(split)
        elif self.tp > 1:
            self.tp_group.all_reduce(split)
        return float(np.sqrt(whole + split[0]))

    def _mismatch(self, exp, plans) -> float:
        """Largest |rollout log-prob - training log-prob| over this rank's tokens (should be ~1e-6:
        both models hold the same weights; a sync bug shows up here first)."""
        worst = 0.0
        for _, mbs, olds, _ in plans:
            for mb, old in zip(mbs, olds):
                for row, lp in zip(mb.rows, old):
                    mask = row.sample_of >= 0
                    if mask.any():
                        got = response_values(row, exp.rollout_logprobs)[mask]
                        worst = max(worst, float(np.abs(got - lp[mask]).max()))
        out = np.array([worst])
        self.group.all_reduce(out, op="max")
        return float(out[0])

    def _remember_lengths(self, batch, exp) -> None:
        n = self.config.rollout.samples_per_prompt
        for g, (idx, _) in enumerate(batch):
            self.length_memory[str(idx)] = float(exp.response_lens[g * n : (g + 1) * n].mean())

    # ------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str | None = None) -> str:
        """Write a checkpoint of the current step (collective over the ranks)."""
        directory = directory or self.config.checkpoint.dir
        if not directory:
            raise RLHFError("no checkpoint directory: set checkpoint.dir in the config")
        arrays = {f"master.{n}": p.asnumpy() for n, p in self.master.items()}
        arrays.update({f"ref.{n}": a for n, a in self.ref_shards.items()})
        arrays.update({f"optim.{n}": p.asnumpy() for n, p in self.optimizer.parameters_and_names()
                       if not n.startswith("master.")})  # fmt: skip
        state = None
        if self.rank == 0:
            np_state = np.random.get_state()
            state = {
                "step": self.step_count,
                "config": self.config.to_dict(),
                "stream": self.stream.state(),
                "numpy_global_rng": [np_state[0], np_state[1].tolist(), *map(float, np_state[2:])],
                "mindspore_rng": self._ms.get_rng_state().asnumpy().tolist(),
                "length_memory": self.length_memory,
                "history": self.history,
            }
        return checkpoint.save(directory, self.step_count, arrays, state, self.group, self.config.checkpoint.keep)

    def load_checkpoint(self, path: str) -> None:
        """Restore a checkpoint written by save_checkpoint, then reshard the restored weights into
        the training, rollout and reference models. A checkpoint of another number of ranks or
        optimizer sharding is resharded into this run's layout first (elastic.py)."""
        path = checkpoint.resolve(path)
        manifest = checkpoint.read_manifest(path)  # read once: both paths verify against it
        state = checkpoint.read_state(path, manifest)
        rank, layout = int(self.group.ranks[self.rank]), elastic.run_layout(self.config)
        saved = elastic.saved_layout(path, state, manifest["world_size"])
        if (manifest["world_size"], saved) == (self.world, layout):
            arrays = checkpoint.load_arrays(path, manifest, rank)
        else:
            arrays = elastic.load(path, manifest, state, self.model_config, rank, self.world, layout)
            log.info("resharded %s from %d to %d ranks", path, manifest["world_size"], self.world)
        try:
            self._restore(arrays, state)
        except RLHFError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:  # verified, but not ours
            raise CheckpointError(
                f"checkpoint {path!r} does not hold this run's state: {type(exc).__name__} {exc}"
            ) from None
        self.last_sync = self._sync_all(ref=True)

    def _restore(self, arrays: dict[str, np.ndarray], state: dict) -> None:
        Tensor = self._ms.Tensor
        for n, p in self.master.items():
            p.copy_(Tensor(arrays[f"master.{n}"]))
        self.ref_shards = {n: arrays[f"ref.{n}"].copy() for n in self.master}
        for n, p in self.optimizer.parameters_and_names():
            if not n.startswith("master."):
                # 0-d parameters (learning_rate, beta powers) come back from asnumpy as shape (1,)
                p.copy_(Tensor(arrays[f"optim.{n}"].reshape(tuple(p.shape))))
        self.step_count = int(state["step"])
        self.stream.load_state(state["stream"])
        kind, keys, pos, has_gauss, cached = state["numpy_global_rng"]
        np.random.set_state((kind, np.asarray(keys, np.uint32), int(pos), int(has_gauss), float(cached)))
        self._ms.set_rng_state(Tensor(np.asarray(state["mindspore_rng"], np.uint8)))
        self.length_memory = dict(state["length_memory"])
        self.history = list(state["history"])


def _per(total: float | None, count: float) -> float | None:
    return None if total is None else total / count


def _repeat(batch, n):
    return [b for b in batch for _ in range(n)]


def _encode(c: Completion) -> np.ndarray:
    bits = np.asarray(c.logprobs, np.float32).view(np.int32).astype(np.int64)
    return np.array([c.request_id, len(c.tokens), *c.tokens, *bits], np.int64)


def _decode(a: np.ndarray) -> Completion:
    n = int(a[1])
    bits = a[2 + n : 2 + 2 * n].astype(np.int32).view(np.float32)
    return Completion(int(a[0]), [int(t) for t in a[2 : 2 + n]], [float(x) for x in bits])
