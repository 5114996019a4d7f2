"""The worker's view of requests, and the flat batch one engine step feeds the model (numpy only).

vLLM's scheduler sends each request's data once (NewRequestData) and afterwards only the diff
(CachedRequestData: computed-token count, new block ids, how many outputs it kept). The worker
keeps each request's tokens, blocks and sampler state here, and turns one SchedulerOutput into
vLLM V1's flat layout that ms_models' `forward_paged` takes: the scheduled tokens of every request
back to back, their positions, cache slots (`block * block_size + offset`), block tables, context
lengths and `query_start_loc`. A request whose scheduled tokens stop short of its known tokens is
a prefill chunk (chunked prefill) and gets no sample; a prefix-cache hit just arrives with
`num_computed_tokens > 0`, so its cached positions are neither recomputed nor rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestState:
    """One request as the worker tracks it between steps."""

    req_id: str
    """vLLM's request id."""
    prompt_token_ids: list[int]
    """The prompt."""
    sampling_params: object
    """vllm.SamplingParams."""
    block_ids: list[int]
    """Cache blocks of the request, in order (one KV cache group)."""
    num_computed_tokens: int
    """Tokens whose keys/values are in the cache (set by the scheduler each step)."""
    output_token_ids: list[int] = field(default_factory=list)
    """Tokens generated so far."""
    generator: np.random.Generator | None = None
    """Per-request generator for seeded sampling."""
    lora_id: int = 0
    """vLLM's lora_int_id of the request's adapter (0: the base model)."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, position: int, spec: list[int]) -> int:
        """Token at `position` of prompt + outputs + this step's speculative tokens."""
        n_prompt = len(self.prompt_token_ids)
        if position < n_prompt:
            return self.prompt_token_ids[position]
        position -= n_prompt
        if position < len(self.output_token_ids):
            return self.output_token_ids[position]
        return spec[position - len(self.output_token_ids)]


@dataclass
class StepBatch:
    """The flat inputs of one forward call and where to read the logits back."""

    req_ids: list[str]
    """Scheduled requests in batch order."""
    input_ids: np.ndarray
    """[T] scheduled tokens, request after request."""
    positions: np.ndarray
    """[T] position of each token in its request."""
    slot_mapping: np.ndarray
    """[T] cache slot of each token."""
    block_tables: np.ndarray
    """[N, max_blocks] block ids (0-padded)."""
    seq_lens: np.ndarray
    """[N] context length after this step."""
    query_start_loc: np.ndarray
    """[N + 1] where each request's tokens start."""
    sample_rows: list[list[int]]
    """Per request: flat rows whose logits are sampled ([] for a prefill chunk; 1 + drafts with spec decode)."""
    spec_tokens: list[list[int]]
    """Per request: the draft tokens being verified this step."""

    @property
    def logits_indices(self) -> np.ndarray:
        return np.asarray([r for rows in self.sample_rows for r in rows], np.int32)


def slots_for(block_ids: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of each position of a request with these blocks."""
    table = np.asarray(block_ids, np.int64)
    if positions.size and positions.max() // block_size >= table.size:
        raise IndexError(f"position {int(positions.max())} is past the {table.size} blocks of the request")
    return table[positions // block_size] * block_size + positions % block_size


def build_batch(
    states: dict[str, RequestState],
    num_scheduled: dict[str, int],
    spec_tokens: dict[str, list[int]],
    block_size: int,
) -> StepBatch:
    """The flat batch for the requests scheduled this step (in `num_scheduled` order)."""
    ids, pos, slots, starts, lens, rows, specs, tables = [], [], [], [0], [], [], [], []
    for req_id, n in num_scheduled.items():
        st = states[req_id]
        spec = list(spec_tokens.get(req_id, ()))
        start = st.num_computed_tokens
        p = np.arange(start, start + n, dtype=np.int64)
        ids.extend(st.token_at(int(q), spec) for q in p)
        pos.append(p)
        slots.append(slots_for(st.block_ids, p, block_size))
        first = starts[-1]
        starts.append(first + n)
        lens.append(start + n)
        tables.append(st.block_ids)
        # The last scheduled non-draft token is sampled once every known token is in the cache;
        # before that the request is a prefill chunk. Each draft is verified at its own row.
        known_end = start + n - len(spec)
        if known_end < st.num_tokens:
            rows.append([])
        else:
            rows.append(list(range(first + n - 1 - len(spec), first + n)))
        specs.append(spec)
    width = max((len(t) for t in tables), default=1) or 1
    block_tables = np.zeros((len(tables), width), np.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = t
    return StepBatch(
        req_ids=list(num_scheduled),
        input_ids=np.asarray(ids, np.int32),
        positions=np.concatenate(pos).astype(np.int32) if pos else np.zeros(0, np.int32),
        slot_mapping=np.concatenate(slots).astype(np.int32) if slots else np.zeros(0, np.int32),
        block_tables=block_tables,
        seq_lens=np.asarray(lens, np.int32),
        query_start_loc=np.asarray(starts, np.int32),
        sample_rows=rows,
        spec_tokens=specs,
    )


def select_requests(batch: StepBatch, idx: list[int]) -> tuple[StepBatch, np.ndarray]:
    """The sub-batch of requests `idx` (flat rows renumbered from 0) and, for each of its rows, the
    row of `batch` it came from. A step run part by part computes what it computes whole: requests
    never read each other's cache slots within one step."""
    starts = batch.query_start_loc
    src = [np.arange(starts[i], starts[i + 1]) for i in idx]
    flat = np.concatenate(src).astype(np.int64) if src else np.zeros(0, np.int64)
    lens = [len(s) for s in src]
    new_starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    rows = [[r - int(starts[i]) + int(new_starts[k]) for r in batch.sample_rows[i]] for k, i in enumerate(idx)]
    sub = StepBatch(
        req_ids=[batch.req_ids[i] for i in idx],
        input_ids=batch.input_ids[flat],
        positions=batch.positions[flat],
        slot_mapping=batch.slot_mapping[flat],
        block_tables=batch.block_tables[idx],
        seq_lens=batch.seq_lens[idx],
        query_start_loc=new_starts,
        sample_rows=rows,
        spec_tokens=[batch.spec_tokens[i] for i in idx],
    )
    return sub, flat


@dataclass
class DraftBatch:
    """The MTP drafter's inputs after a step, built from that step's batch (numpy only).

    MTP input at position p = (the target's final hidden state at p, the token at p + 1), for every
    position whose next token is now known: a prefill chunk's positions, and a decode's positions up
    to its last accepted token. Deeper drafts continue from `last_rows`."""

    hidden_rows: np.ndarray
    """[M] rows of the step's hidden states the MTP layer takes, in order."""
    input_ids: np.ndarray
    """[M] the token one position ahead of each of those rows."""
    positions: np.ndarray
    """[M] their positions."""
    slot_mapping: np.ndarray
    """[M] their cache slots (the MTP caches use the target's block ids)."""
    block_tables: np.ndarray
    """[N, max_blocks] block tables of the step's requests."""
    seq_lens: np.ndarray
    """[N] MTP context length of each request after this pass."""
    query_start_loc: np.ndarray
    """[N + 1] where each request's rows start."""
    last_rows: np.ndarray
    """[R] row (in this batch) of the last known position of each request that got tokens."""
    owners: list[str]
    """[R] the requests the drafts are for."""
    owner_blocks: list[list[int]]
    """[R] their block ids (for the slots of deeper drafts)."""


def build_draft_batch(batch: StepBatch, states: dict[str, RequestState], sampled: list[list[int]]) -> DraftBatch:
    """The drafter's first-depth batch after `batch` ran and `sampled` tokens were accepted."""
    rows, ids, pos, slots, starts, lens, last, owners = [], [], [], [], [0], [], [], []
    for i, req_id in enumerate(batch.req_ids):
        st = states[req_id]
        q0, q1 = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
        start = int(batch.positions[q0]) if q1 > q0 else st.num_computed_tokens
        accepted = max(len(sampled[i]) - 1, 0)
        valid = (q1 - q0) - len(batch.spec_tokens[i]) + accepted
        p = np.arange(start, start + valid)
        rows.extend(range(q0, q0 + valid))
        ids.extend(st.token_at(int(x) + 1, []) for x in p)
        pos.append(p)
        slots.append(batch.slot_mapping[q0 : q0 + valid])
        starts.append(starts[-1] + valid)
        lens.append(start + valid)
        if sampled[i]:
            last.append(starts[-1] - 1)
            owners.append(req_id)
    return DraftBatch(
        hidden_rows=np.asarray(rows, np.int32),
        input_ids=np.asarray(ids, np.int32),
        positions=np.concatenate(pos).astype(np.int32) if pos else np.zeros(0, np.int32),
        slot_mapping=np.concatenate(slots).astype(np.int32) if slots else np.zeros(0, np.int32),
        block_tables=batch.block_tables,
        seq_lens=np.asarray(lens, np.int32),
        query_start_loc=np.asarray(starts, np.int32),
        last_rows=np.asarray(last, np.int64),
        owners=owners,
        owner_blocks=[list(states[r].block_ids) for r in owners],
    )


def stops_after(state: RequestState, token: int, max_model_len: int) -> bool:
    """Would the scheduler finish the request after this token? (worker-side check for multi-step)."""
    p = state.sampling_params
    n_out = len(state.output_token_ids)
    if p.max_tokens is not None and n_out >= p.max_tokens:
        return True
    if state.num_tokens >= max_model_len:
        return True
    if n_out < p.min_tokens:
        return False
    if token in (p.stop_token_ids or ()):
        return True
    return not p.ignore_eos and token in p.all_stop_token_ids


def pure_decode(batch: StepBatch) -> bool:
    """Every request of `batch` decodes one token, no drafts (a batch multi-step may repeat)."""
    return (
        all(len(r) == 1 for r in batch.sample_rows)
        and not any(batch.spec_tokens)
        and (len(batch.input_ids) == len(batch.req_ids))
    )
