"""The model runner: one vLLM SchedulerOutput in, one ModelRunnerOutput out, MindSpore in between.

Per engine step:
1. fold the scheduler's diff into the per-request states (batch.py);
2. build the flat paged batch and run the ms_models model over it (`CausalLM.forward_paged`,
   which writes every layer's paged cache and returns the logits of the rows that need a token and
   the final hidden states). With compilation on (compile_or_warm_up_model, unless vLLM's
   `enforce_eager`), the step is split and padded into shape buckets (buckets.py) and each part runs
   a compiled graph (compiled.py); a part that fits no bucket runs eagerly and is counted;
3. sample the logits (sampler.py), and verify draft
   tokens when speculative decoding scheduled some (a draft is kept while it equals the token the
   target samples at its position: exact for greedy, and the exact rejection rule for a one-hot
   draft under random sampling);
4. with multi-step on, run more decode iterations for a pure-decode batch before returning
   (multistep.py explains the scheduler side);
5. with MTP on, propose the next drafts from the hidden states (spec_decode.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from .batch import (
    RequestState,
    StepBatch,
    build_batch,
    build_draft_batch,
    pure_decode,
    select_requests,
    slots_for,
    stops_after,
)
from .buckets import BucketConfig, plan_step
from .lockstep import Lockstep, OneByOne, padding_forward
from .sampler import SamplingRow, logprobs_lists, sample_row
from .structured import apply_grammar_bitmask

logger = logging.getLogger(__name__)


class MindSporeModelRunner:
    """Request states, the paged KV cache and the step loop of one worker."""

    def __init__(self, vllm_config, model, multi_step: int = 1, drafter=None, lora=None, group=None):
        self.vllm_config = vllm_config
        self.model = model
        self.group = group
        """The tensor/expert-parallel group of a sharded model (ms_models.parallel), None in one process."""
        self.data_parallel = group is not None and vllm_config.parallel_config.data_parallel_size > 1
        """DP attention + EP: this rank serves its own requests; every forward exchanges expert tokens
        with the other ranks, so all ranks run the same number of forwards per engine step."""
        self.lockstep = Lockstep(group if self.data_parallel else None, self._dummy_forward)
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = vllm_config.model_config.max_model_len
        # The full vocabulary (under TP the model's own config holds one rank's slice of it).
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.multi_step = multi_step
        self.drafter = drafter
        if drafter is not None and self.data_parallel:  # its MTP layer's expert exchanges, paired
            drafter.pairing = OneByOne(group, lambda: drafter.padding_forward(self.num_blocks, self.block_size))
        self.lora = lora
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: list | None = None
        self.shared_rng = np.random.default_rng(vllm_config.model_config.seed or 0)
        self.pending_drafts = None
        self.pending_step = None
        """(batch, logits, hidden, start time) of a step whose sampling waits for a grammar bitmask."""
        self.compiled = None
        """CompiledSteps once compile() ran; None: every step runs eagerly (PyNative)."""
        self.stats = {
            "steps": 0,
            "forwards": 0,
            "tokens": 0,
            "drafts": 0,
            "accepted": 0,
            "compiled_calls": 0,
            "batched_prefill_calls": 0,
            "eager_calls": 0,
            "eager_reasons": {},
            "model_s": 0.0,
            "step_s": 0.0,
            "dummy_forwards": 0,
            "multi_step_rounds": 0,
            "peak_kv_blocks": 0,
        }
        """Counters since start: engine steps, model forward calls, tokens emitted, drafts verified/
        accepted, compiled model calls (those of several prefill chunks apart) and eager ones (with why
        each eager call had no bucket), forwards of no request run to pair with other DP ranks, extra
        multi-step decode rounds run, the most KV blocks its requests held at once (this rank's
        cache: under TP every rank holds every request's), and wall seconds inside model calls (logits
        to numpy included) and inside whole execute() calls."""

    # ------------------------------------------------------------------ KV cache
    def cache_bytes_per_block(self) -> int:
        shapes = self.model.kv_cache_shapes(1, self.block_size)
        if self.drafter is not None:
            shapes = shapes + self.drafter.cache_shapes(1, self.block_size)
        return int(sum(4 * np.prod(s) for layer in shapes for s in layer))

    def initialize_kv_cache(self, num_blocks: int, flat: bool = False) -> None:
        """Allocate the caches; `flat`: slot-major, which compiled steps write without copying the
        whole cache (ms_models.allocate_kv_caches)."""
        from ms_models import allocate_kv_caches

        # One block more than vLLM's count: block `num_blocks` is the scratch block that padding
        # tokens of compiled steps write; no request ever owns it.
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(self.model, num_blocks + 1, self.block_size, flat=flat)
        if self.drafter is not None:
            self.drafter.allocate(num_blocks + 1, self.block_size, flat=flat)
        logger.info("ms-vllm: %d KV blocks of %d tokens", num_blocks, self.block_size)

    # ------------------------------------------------------------------ request states
    def update_states(self, so) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            seed = getattr(params, "seed", None)
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids or []),
                sampling_params=params,
                block_ids=list(new.block_ids[0]),
                num_computed_tokens=new.num_computed_tokens,
                generator=np.random.default_rng(seed) if seed is not None else None,
                lora_id=0 if new.lora_request is None else new.lora_request.lora_int_id,
            )
            if new.lora_request is not None:
                if self.lora is None:
                    raise RuntimeError("a LoRA request reached an engine started without enable_lora")
                self.lora.add(new.lora_request)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests[req_id]
            st.num_computed_tokens = cached.num_computed_tokens[i]
            if i < len(cached.num_output_tokens):
                del st.output_token_ids[cached.num_output_tokens[i] :]
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_blocks[0])
            elif new_blocks is not None:
                st.block_ids.extend(new_blocks[0])
        held = sum(len(st.block_ids) for st in self.requests.values())
        self.stats["peak_kv_blocks"] = max(self.stats["peak_kv_blocks"], held)

    # ------------------------------------------------------------------ compilation
    def compile(
        self, config: BucketConfig | None = None, progress: bool = True, cache_dir: str | None = None
    ) -> dict[str, float]:
        """Compile the buckets (default: BucketConfig.default for this engine) -> seconds per bucket.
        With `cache_dir`, MindSpore's compile cache keeps the graphs on disk for the next start."""
        from .compiled import CompiledSteps, cache_key, use_compile_cache
        from .compiled_ep import CompiledEPSteps
        from .compiled_tp import CompiledTPSteps

        if self.kv_caches is None:
            raise RuntimeError("compile() needs the KV cache: call initialize_kv_cache first")
        if config is None:
            sched = getattr(self.vllm_config, "scheduler_config", None)
            max_seqs = int(getattr(sched, "max_num_seqs", 64) or 64)
            config = BucketConfig.default(max_seqs, self.max_model_len, self.block_size)
        if self.drafter is not None and not config.spec_width:  # verify buckets for 1 + k tokens a request
            config = dataclasses.replace(config, spec_width=self.drafter.k + 1)
        lora_shape = None
        if self.lora is not None:  # the graphs read the LoRA banks and token mask: size them first
            self.lora.reserve(max(b.tokens for b in config.buckets()))
            lora_shape = (self.lora.max_loras, self.lora.max_rank, self.lora.max_tokens)
        if cache_dir:
            tp = None if self.group is None else (self.group.rank, self.group.size)
            key = cache_key(self.model, config, self.num_blocks, self.block_size, (lora_shape, tp))
            path = use_compile_cache(cache_dir, key)
            logger.info("ms-vllm: compile cache in %s", path)
        if self.group is None:
            steps = CompiledSteps(self.model, self.kv_caches, config, self.block_size, self.num_blocks)
        elif self.data_parallel:  # graphs between the experts' all-to-alls
            steps = CompiledEPSteps(self.model, self.kv_caches, config, self.block_size, self.num_blocks, self.group)
        else:  # graphs between the collectives
            steps = CompiledTPSteps(self.model, self.kv_caches, config, self.block_size, self.num_blocks, self.group)
        steps.warm_up(progress)
        if self.drafter is not None:  # the MTP module's graphs: drafting buckets of the same config
            drafter = self.drafter.compile(
                config, self.block_size, self.num_blocks, progress, self.group, exchanged=self.data_parallel
            )
            steps.compile_s.update(drafter)
        self.compiled = steps
        return dict(steps.compile_s)

    # ------------------------------------------------------------------ forward
    def run_model(self, batch: StepBatch, need_hidden: bool = False, rounds: int = 0):
        """(logits [R, V] numpy of batch.logits_indices, hidden [T, H] MindSpore tensor or None);
        `rounds`: the multi-step decode rounds that will follow (announced to the DP ranks)."""
        t = time.perf_counter()
        if self.compiled is None:
            with self.lockstep.forwards(1, rounds):
                logits, hidden = self._eager(batch)
        else:
            logits, hidden = self._in_parts(batch, need_hidden, rounds)
        self.stats["model_s"] += time.perf_counter() - t
        return logits, hidden

    def _dummy_forward(self) -> None:
        """A forward of no request (lockstep.py): the smallest compiled bucket, else one padding token."""
        self.stats["dummy_forwards"] += 1
        if self.compiled is not None:
            self.compiled.dummy().asnumpy()
        else:
            padding_forward(self.model, self.kv_caches, self.num_blocks, self.block_size)

    def dummy_step(self) -> None:
        """An engine step with nothing scheduled here while other DP ranks run theirs (vLLM's
        execute_dummy_batch, which its DP engine loop also runs after a step of no tokens): this
        rank's part of their exchanges."""
        with self.lockstep.forwards(0):
            pass
        self.lockstep.settle()
        if self.drafter is not None:
            self.drafter.pairing.drain()

    def _eager(self, batch: StepBatch):
        from mindspore import Tensor

        rows = batch.logits_indices
        self._set_lora(batch)
        self.stats["forwards"] += 1
        self.stats["eager_calls"] += 1
        logits, hidden = self.model.forward_paged(
            Tensor(batch.input_ids), Tensor(batch.positions), self.kv_caches, batch.slot_mapping,
            batch.block_tables, batch.seq_lens, batch.query_start_loc,
            logits_indices=rows if rows.size else np.zeros(1, np.int32), return_hidden=True,
            block_size=self.block_size,
        )  # fmt: skip
        logits = logits.asnumpy()[: rows.size]
        return logits, hidden

    def _set_lora(self, batch: StepBatch) -> None:
        """Tell the LoRA layers which adapter each row of `batch` uses (rows past it: none)."""
        if self.lora is not None:
            per_req = [self.requests[r].lora_id for r in batch.req_ids]
            self.lora.set_batch(np.repeat(per_req, np.diff(batch.query_start_loc)))

    def _in_parts(self, batch: StepBatch, need_hidden: bool, rounds: int):
        """The step as compiled parts (and eager ones for shapes outside the buckets)."""
        q_lens = np.diff(batch.query_start_loc)
        parts = plan_step(q_lens, batch.seq_lens, [len(r) for r in batch.sample_rows], self.compiled.config)
        with self.lockstep.forwards(len(parts), rounds):
            return self._run_parts(batch, parts, need_hidden)

    def _run_parts(self, batch: StepBatch, parts, need_hidden: bool):
        from mindspore import ops

        order = {int(r): k for k, r in enumerate(batch.logits_indices)}
        logits = np.zeros((len(order), self.vocab_size), np.float32)
        hiddens, sources = [], []
        for part in parts:
            sub, flat = select_requests(batch, part.requests)
            if part.bucket is None:
                reasons = self.stats["eager_reasons"]
                reasons[part.reason] = reasons.get(part.reason, 0) + 1
                if self.group is None:
                    lg, h = self._eager(sub)
                else:  # the TP cells no longer communicate: the segments at this part's own shape
                    self.stats["forwards"] += 1
                    self.stats["eager_calls"] += 1
                    lg, h = self.compiled.run_exact(sub)
            else:
                self.stats["forwards"] += 1
                self.stats["compiled_calls"] += 1
                self.stats["batched_prefill_calls"] += part.bucket.kind == "prefill" and part.bucket.batch > 1
                self._set_lora(sub)
                lg, h = self.compiled.run(sub, part.bucket)
                lg = lg if isinstance(lg, np.ndarray) else lg.asnumpy()
            for k, r in enumerate(sub.logits_indices):
                logits[order[int(flat[r])]] = lg[k]
            if need_hidden:
                hiddens.append(h)
                sources.append(flat)
        hidden = None
        if need_hidden and hiddens:
            from mindspore import Tensor

            source = np.concatenate(sources)
            hidden = hiddens[0] if len(hiddens) == 1 else ops.cat(hiddens, 0)
            if not np.array_equal(source, np.arange(len(source))):  # (each op here is a PyNative dispatch)
                hidden = ops.gather(hidden, Tensor(np.argsort(source).astype(np.int32)), 0)
        return logits, hidden

    # ------------------------------------------------------------------ sampling
    def _row(self, st: RequestState) -> SamplingRow:
        return SamplingRow(st.sampling_params, st.generator, st.prompt_token_ids, st.output_token_ids)

    def sample(
        self, batch: StepBatch, logits: np.ndarray, limits: dict[str, int] | None = None
    ) -> tuple[list[list[int]], list[np.ndarray]]:
        """Tokens per request (drafts verified) and the logits row of each emitted token; `limits`
        caps how many leading drafts a request may accept (the grammar constrained only those)."""
        out, used, cursor = [], [], 0
        for req_id, rows, spec in zip(batch.req_ids, batch.sample_rows, batch.spec_tokens):
            st = self.requests[req_id]
            if limits is not None and req_id in limits:
                spec = spec[: limits[req_id]]
            emitted, kept_rows = [], []
            for j in range(len(rows)):
                row = logits[cursor + j]
                token = sample_row(row, self._row(st), self.shared_rng)
                emitted.append(token)
                kept_rows.append(row)
                st.output_token_ids.append(token)
                if j >= len(spec) or token != spec[j]:
                    break
                self.stats["accepted"] += 1
            cursor += len(rows)
            self.stats["drafts"] += len(spec)
            self.stats["tokens"] += len(emitted)
            out.append(emitted)
            vocab = logits.shape[-1]
            used.append(np.asarray(kept_rows, np.float32).reshape(len(kept_rows), vocab))
        return out, used

    # ------------------------------------------------------------------ the step
    def execute(self, so):
        """One engine step. With structured-output requests in it, the logits wait for the grammar
        bitmask the scheduler computes meanwhile: returns None, and vLLM calls `sample_tokens`."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        t = time.perf_counter()
        self.update_states(so)
        if not so.total_num_scheduled_tokens:
            # (under DP + EP vLLM follows a step of no tokens with execute_dummy_batch, which pairs)
            return EMPTY_MODEL_RUNNER_OUTPUT
        self.stats["steps"] += 1
        batch = build_batch(self.requests, so.num_scheduled_tokens, so.scheduled_spec_decode_tokens, self.block_size)
        structured = getattr(so, "has_structured_output_requests", False)
        rounds = self.multi_step - 1 if self.multi_step > 1 and pure_decode(batch) and not structured else 0
        logits, hidden = self.run_model(batch, need_hidden=self.drafter is not None, rounds=rounds)
        self.pending_step = (batch, logits, hidden, rounds, t)
        if structured:
            return None
        return self.sample_tokens(None)

    def sample_tokens(self, grammar_output):
        """Sample the pending step's logits, the grammar bitmask applied to its structured-output rows."""
        from vllm.v1.outputs import ModelRunnerOutput

        if self.pending_step is None:
            raise RuntimeError("sample_tokens without a pending execute_model step")
        (batch, logits, hidden, rounds, t), self.pending_step = self.pending_step, None
        limits = None
        if grammar_output is not None:
            logits = np.array(logits, np.float32)
            limits = apply_grammar_bitmask(logits, batch, grammar_output)
        sampled, rows = self.sample(batch, logits, limits)
        if rounds:
            self._more_decode_steps(batch, sampled, rows, rounds)
        self.lockstep.settle()
        if self.drafter is not None:
            draft = build_draft_batch(batch, self.requests, sampled)
            self.pending_drafts = self.drafter.propose(draft, hidden, self.block_size)
            self.drafter.pairing.drain()
        self.stats["step_s"] += time.perf_counter() - t
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
            sampled_token_ids=sampled,
            logprobs=logprobs_lists([self.requests[r].sampling_params.logprobs for r in batch.req_ids], sampled, rows),
        )

    # ------------------------------------------------------------------ multi-step
    def _more_decode_steps(self, batch: StepBatch, sampled: list[list[int]], rows: list[np.ndarray], rounds: int):
        """Up to `rounds` further decode iterations on the blocks the scheduler reserved ahead (under
        DP + EP each one a lockstep round; the rounds this rank skips, settle() runs empty)."""
        index = {r: i for i, r in enumerate(batch.req_ids)}
        for _ in range(rounds):
            live = []
            for req_id in batch.req_ids:
                st = self.requests[req_id]
                pos = st.num_tokens - 1
                last = st.output_token_ids[-1]
                if stops_after(st, last, self.max_model_len) or pos // self.block_size >= len(st.block_ids):
                    continue
                live.append(req_id)
            if not live:
                return
            for req_id in live:  # the previous token's keys/values are written by this iteration
                self.requests[req_id].num_computed_tokens = self.requests[req_id].num_tokens - 1
            step = build_batch(self.requests, {r: 1 for r in live}, {}, self.block_size)
            self.stats["multi_step_rounds"] += 1
            with self.lockstep.round():
                logits, _ = self.run_model(step)
            new, new_rows = self.sample(step, logits)
            for req_id, toks, r in zip(live, new, new_rows):
                sampled[index[req_id]].extend(toks)
                rows[index[req_id]] = np.concatenate([rows[index[req_id]], r])


__all__ = ["MindSporeModelRunner", "slots_for"]
