"""Shape buckets for compiled steps, and the plan that pads one engine step into them (numpy only).

A `mindspore.jit` graph has fixed input shapes, so the runner compiles one graph per bucket, as
vLLM captures one CUDA graph per batch size:

- a decode bucket (B, C): B single-token requests whose contexts fit in C positions;
- a prefill bucket (Q, C, n): n requests' chunks of up to Q tokens each, their contexts up to C
  (Q <= C): n = 1, and with `batch_tokens` also n = batch_tokens // Q, so that short prompts share
  one graph (a GEMM over n * Q rows instead of n GEMMs over Q);
- with speculative decoding (`spec_width` W = 1 + drafts per step), a verify bucket (B, C, W): B
  requests of up to W tokens whose every row is sampled (the target checking its drafts), and for
  the drafter a draft bucket (B, C, W): the same tokens with one row per request (the MTP module
  over the accepted positions, its draft taken at the last).

`plan_step` splits a step's flat batch into parts: the single-token requests (in pieces of at most
the largest decode size), and the longer chunks, grouped by the prefill size they round up to, n at
a time (a remainder of fewer than n / 2 runs one by one). Requests never read each other's cache
blocks within a step, so running the parts one after another is the same computation. A part
that fits no bucket (a chunk longer than the largest prefill size, a verification wider than W)
runs eagerly and is counted.

`pad_part` pads a part to its bucket: padding tokens write a scratch block that no request owns
(the runner allocates one block more than vLLM's count), padding requests have an empty query, and
the logits rows are padded by repeating row 0. Padding therefore never writes a real cache slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class BucketError(ValueError):
    """A bucket configuration or a padding request that cannot work."""


def _pow2_upto(lo: int, hi: int) -> tuple[int, ...]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    return tuple(out + [hi]) if hi >= lo else (hi,)


@dataclass(frozen=True)
class BucketConfig:
    """The graph shapes compiled at start-up."""

    decode_sizes: tuple[int, ...]
    """Batch sizes B of the decode graphs (single-token requests)."""
    prefill_sizes: tuple[int, ...]
    """Token counts T of the prefill graphs (one request's chunk)."""
    context_sizes: tuple[int, ...]
    """Context lengths C (positions attended) the graphs are built for."""
    batch_tokens: int = 0
    """Padded tokens of a batched prefill graph (batch_tokens // Q chunks of up to Q); 0: none."""
    spec_width: int = 0
    """Tokens per request of a speculative decode step (1 + drafts per step): verify and draft
    buckets of this width for every decode size; 0: no speculative decoding."""

    def __post_init__(self) -> None:
        for name in ("decode_sizes", "prefill_sizes", "context_sizes"):
            sizes = getattr(self, name)
            if not sizes or any(int(s) <= 0 for s in sizes) or list(sizes) != sorted(set(sizes)):
                raise BucketError(f"{name}={sizes!r}: expected positive sizes in increasing order")
        if int(self.batch_tokens) < 0:
            raise BucketError(f"batch_tokens={self.batch_tokens!r}: expected 0 (no batched prefill) or more")
        if int(self.spec_width) < 0 or int(self.spec_width) == 1:
            raise BucketError(f"spec_width={self.spec_width!r}: expected 0 (none) or 1 + the drafts per step")
        if self.prefill_sizes[0] > self.context_sizes[-1]:
            raise BucketError(
                f"prefill size {self.prefill_sizes[0]} exceeds the largest context size {self.context_sizes[-1]}"
            )

    @classmethod
    def default(cls, max_num_seqs: int, max_model_len: int, block_size: int) -> BucketConfig:
        """Powers of two: decode 1..min(max_num_seqs, 64), prefill 16..max_model_len, context
        128..max_model_len (rounded up to whole blocks); batched prefills of 256 tokens."""
        ctx_max = -(-max_model_len // block_size) * block_size
        return cls(
            decode_sizes=_pow2_upto(1, min(max_num_seqs, 64)),
            prefill_sizes=_pow2_upto(min(16, ctx_max), ctx_max),
            context_sizes=_pow2_upto(min(128, ctx_max), ctx_max),
            batch_tokens=256,
        )

    @classmethod
    def from_dict(cls, spec: dict, fallback: BucketConfig) -> BucketConfig:
        """additional_config["compile"] = {"decode_sizes": [...], "prefill_sizes": [...], "context_sizes": [...],
        "batch_tokens": n}."""
        unknown = set(spec) - {"decode_sizes", "prefill_sizes", "context_sizes", "batch_tokens"}
        if unknown:
            raise BucketError(
                f"unknown compile options {sorted(unknown)}; expected decode/prefill/context_sizes, batch_tokens"
            )
        sizes = ("decode_sizes", "prefill_sizes", "context_sizes")
        kw = {k: tuple(int(v) for v in spec.get(k, getattr(fallback, k))) for k in sizes}
        return cls(**kw, batch_tokens=int(spec.get("batch_tokens", fallback.batch_tokens)))

    def prefill_batch(self, query: int) -> int:
        """Requests of a batched prefill graph of chunks up to `query` tokens (1: no batching)."""
        return max(1, int(self.batch_tokens) // query)

    def buckets(self, drafting: bool = False) -> list[Bucket]:
        """Every bucket compiled at start-up: decode (B, C) for all pairs, prefill (T, C) with T <= C,
        and with spec_width the verify buckets (the draft buckets instead, for the drafter's graphs)."""
        out = [Bucket("decode", b, c) for c in self.context_sizes for b in self.decode_sizes]
        for c in self.context_sizes:
            for t in (t for t in self.prefill_sizes if t <= c):
                out += [Bucket("prefill", t, c, n) for n in sorted({1, self.prefill_batch(t)})]
        if self.spec_width:
            kind = "draft" if drafting else "verify"
            out += [Bucket(kind, b, c, width=self.spec_width) for c in self.context_sizes for b in self.decode_sizes]
        return out

    def decode_bucket(self, n_seqs: int, context: int, kind: str = "decode") -> Bucket | None:
        """The decode bucket (or, with kind "verify" / "draft", the spec_width one) of n_seqs requests."""
        b, c = _ceil_in(n_seqs, self.decode_sizes), _ceil_in(context, self.context_sizes)
        if b is None or c is None:
            return None
        return Bucket(kind, b, c) if kind == "decode" else Bucket(kind, b, c, width=self.spec_width)

    def prefill_bucket(self, n_tokens: int, context: int, batch: int = 1) -> Bucket | None:
        """The bucket of `batch` (1 or prefill_batch) chunks of up to n_tokens, contexts up to `context`."""
        c = _ceil_in(context, self.context_sizes)
        t = _ceil_in(n_tokens, [s for s in self.prefill_sizes if c is not None and s <= c])
        return None if t is None or c is None else Bucket("prefill", t, c, batch)


def _ceil_in(n: int, sizes) -> int | None:
    for s in sizes:
        if s >= n:
            return int(s)
    return None


@dataclass(frozen=True)
class Bucket:
    """One compiled shape."""

    kind: str
    """"decode", "prefill", "verify" or "draft"."""
    size: int
    """Requests B (decode, verify, draft) or tokens per request Q (prefill)."""
    context: int
    """Context positions C."""
    batch: int = 1
    """Requests n of a prefill bucket (1 for the others)."""
    width: int = 1
    """Tokens per request of a verify or draft bucket (1 for the others)."""

    @property
    def tokens(self) -> int:
        """Tokens of the padded flat batch."""
        return self.size * (self.batch if self.kind == "prefill" else self.width)

    @property
    def seqs(self) -> int:
        """Requests of the padded batch."""
        return self.batch if self.kind == "prefill" else self.size

    @property
    def query(self) -> int:
        """Longest query (Q axis)."""
        return self.size if self.kind == "prefill" else self.width

    @property
    def rows(self) -> int:
        """Logits rows computed in the graph (every token of a verify bucket, else one per request)."""
        return self.tokens if self.kind == "verify" else self.seqs

    def __str__(self) -> str:
        if self.kind == "prefill":
            return f"prefill[T={self.size},C={self.context}" + (f",n={self.batch}]" if self.batch > 1 else "]")
        width = f",W={self.width}" if self.kind in ("verify", "draft") else ""
        return f"{self.kind}[B={self.size},C={self.context}{width}]"


@dataclass
class Part:
    """Some requests of a step, run by one model call."""

    requests: list[int]
    """Indices (in batch order) of the part's requests."""
    bucket: Bucket | None
    """Its compiled shape; None: it runs eagerly."""
    reason: str = ""
    """Why it has no bucket (for the eager-fallback counters)."""


def plan_step(q_lens, seq_lens, n_sample_rows, config: BucketConfig, drafting: bool = False) -> list[Part]:
    """Split a step (per request: query length, context length after the step, sampled rows) into
    parts. `drafting`: the drafter's step, whose requests of 2..spec_width tokens (one row each)
    take draft buckets."""
    q_lens, seq_lens, n_rows = (np.asarray(a, np.int64) for a in (q_lens, seq_lens, n_sample_rows))
    parts: list[Part] = []
    width = int(config.spec_width)
    single = [i for i in range(len(q_lens)) if q_lens[i] == 1 and n_rows[i] <= 1]
    verify = [i for i in range(len(q_lens)) if 1 < n_rows[i] == q_lens[i] <= width]
    draft = [i for i in range(len(q_lens)) if drafting and 1 < q_lens[i] <= width and n_rows[i] <= 1]
    biggest = config.decode_sizes[-1]
    for kind, members in (("decode", single), ("verify", verify), ("draft", draft)):
        for k in range(0, len(members), biggest):
            idx = members[k : k + biggest]
            bucket = config.decode_bucket(len(idx), int(seq_lens[idx].max()), kind)
            parts.append(Part(idx, bucket, "" if bucket else f"context {int(seq_lens[idx].max())} > largest bucket"))
    decodes = set(single) | set(verify) | set(draft)
    groups: dict[tuple[int, int], list[int]] = {}  # (prefill size, context size) -> requests
    for i in range(len(q_lens)):
        if i in decodes or q_lens[i] == 0:
            continue
        if n_rows[i] > 1:
            parts.append(Part([i], None, f"{int(n_rows[i])} sampled rows (draft verification) beyond spec_width"))
            continue
        bucket = config.prefill_bucket(int(q_lens[i]), int(seq_lens[i]))
        if bucket is None:
            reason = f"chunk of {int(q_lens[i])} tokens, context {int(seq_lens[i])}: no bucket"
            parts.append(Part([i], None, reason))
        else:
            groups.setdefault((bucket.size, bucket.context), []).append(i)
    for (size, context), idx in groups.items():
        n = config.prefill_batch(size)
        for k in range(0, len(idx), n):
            chunk = idx[k : k + n]
            if n > 1 and 2 * len(chunk) >= n:
                parts.append(Part(chunk, Bucket("prefill", size, context, n)))
            else:  # a small remainder: padding requests would cost as much as real ones
                parts += [Part([i], Bucket("prefill", size, context)) for i in chunk]
    return parts


@dataclass
class PaddedPart:
    """A part's inputs padded to its bucket (arrays for PagedMetadata.build and the graph)."""

    input_ids: np.ndarray
    """[T] token ids (0 for padding)."""
    positions: np.ndarray
    """[T] positions (0 for padding)."""
    slot_mapping: np.ndarray
    """[T] cache slots (padding: slots of the scratch block)."""
    block_tables: np.ndarray
    """[N, W] block tables (padding requests: the scratch block)."""
    seq_lens: np.ndarray
    """[N] context lengths (0 for padding requests)."""
    query_start_loc: np.ndarray
    """[N + 1] query starts (padding requests: empty queries at the end)."""
    logits_rows: np.ndarray
    """[R] flat rows whose logits the graph returns (padding: row 0)."""


def pad_part(
    input_ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc, logits_rows,
    bucket: Bucket, scratch_block: int, block_size: int,
) -> PaddedPart:  # fmt: skip
    """Pad one part's flat inputs to `bucket`; padding writes only `scratch_block`."""
    t, n = len(input_ids), len(seq_lens)
    if t > bucket.tokens or n > bucket.seqs or len(logits_rows) > bucket.rows:
        raise BucketError(f"{t} tokens / {n} requests / {len(logits_rows)} rows do not fit bucket {bucket}")
    if n and int(np.max(np.diff(query_start_loc))) > bucket.query:
        raise BucketError(f"a chunk of {int(np.max(np.diff(query_start_loc)))} tokens does not fit bucket {bucket}")
    if n and int(np.max(seq_lens)) > bucket.context:
        raise BucketError(f"context {int(np.max(seq_lens))} does not fit bucket {bucket}")
    if np.any(np.asarray(block_tables) == scratch_block):
        raise BucketError(f"a request owns the scratch block {scratch_block}")
    extra_t, extra_n = bucket.tokens - t, bucket.seqs - n
    scratch = scratch_block * block_size + np.arange(extra_t) % block_size
    tables = np.asarray(block_tables, np.int32)
    tables = tables.reshape(n, tables.shape[-1] if tables.ndim == 2 else 0)
    width = max(tables.shape[1], 1)
    padded_tables = np.full((bucket.seqs, width), scratch_block, np.int32)
    padded_tables[:n, : tables.shape[1]] = tables
    rows = np.zeros(bucket.rows, np.int32)
    rows[: len(logits_rows)] = logits_rows
    return PaddedPart(
        input_ids=np.concatenate([np.asarray(input_ids, np.int32), np.zeros(extra_t, np.int32)]),
        positions=np.concatenate([np.asarray(positions, np.int32), np.zeros(extra_t, np.int32)]),
        slot_mapping=np.concatenate([np.asarray(slot_mapping, np.int32), scratch.astype(np.int32)]),
        block_tables=padded_tables,
        seq_lens=np.concatenate([np.asarray(seq_lens, np.int32), np.zeros(extra_n, np.int32)]),
        query_start_loc=np.concatenate([np.asarray(query_start_loc, np.int32), np.full(extra_n, t, np.int32)]),
        logits_rows=rows,
    )
