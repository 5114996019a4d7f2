"""Compiled steps of a DP-attention + EP rank: the paged forward cut at the experts' all-to-all.

Under vLLM's `--data-parallel-size N --enable-expert-parallel` each rank serves its own requests
with attention, dense MLPs, shared experts and vocabulary whole (no collective there) and holds
1/N of the routed experts (ms_models.parallel.DispatchMoE). A step is one `mindspore.jit` graph per
layer and shape bucket, cut where the routed experts' tokens leave the rank:

    embed      the token embeddings
    layer[i]   x + the previous layer's routed output, attention over the layer's cache, then
               a dense layer's MLP; an MoE layer's router and shared experts, returning
               (expert ids, weights, normed h, x) for the host
    exchange   host: the real rows' h to their experts' ranks (all-to-all), the local experts as
               one compiled graph per row capacity (`experts[i]`, powers of two), results back
               (all-to-all), summed per token: the next graph adds them (ms_models.parallel.dispatch)
    head       x + the last routed output, final norm, the rows' logits

Padding rows of a bucket stay on their rank (they are never dispatched). Every rank must run the
same number of forwards per engine step, real or not (the runner agrees on it first), because each
MoE layer's exchange pairs up across the ranks.
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, jit, nn, ops

from ms_models.parallel import DispatchMoE
from ms_models.parallel.dispatch import capacity, exchange, route

from .buckets import BucketConfig
from .compiled import compile_each, empty_batch
from .compiled_tp import EmbedSegment, HeadSegment, SegmentedSteps, _Cache


class _LayerSegment(nn.Cell):
    def __init__(self, rotary, layer, cache):
        super().__init__()
        self.rotary, self.layer, self.cache = rotary, layer, _Cache(cache)

    def _attend(self, x, delta, positions, meta):
        x = x + delta
        cos, sin = self.rotary(positions)
        a = self.layer.self_attn.forward_paged(self.layer.input_layernorm(x), cos, sin, self.cache.get(), meta)
        x = x + a
        return x, self.layer.post_attention_layernorm(x)


class DenseLayerSegment(_LayerSegment):
    """A layer with a dense MLP, whole: x -> x."""

    @jit
    def construct(self, x, delta, positions, write_index, write_rows, context_slots, query_rows, padded_rows,
                  allowed, write_slots):  # fmt: skip
        meta = (write_index, write_rows, context_slots, query_rows, padded_rows, allowed, write_slots)
        x, h = self._attend(x, delta, positions, meta)
        return x + self.layer.mlp(h)


class MoELayerSegment(_LayerSegment):
    """A DispatchMoE layer up to its exchange: (expert ids, weights, h, x + shared experts)."""

    @jit
    def construct(self, x, delta, positions, write_index, write_rows, context_slots, query_rows, padded_rows,
                  allowed, write_slots):  # fmt: skip
        meta = (write_index, write_rows, context_slots, query_rows, padded_rows, allowed, write_slots)
        x, h = self._attend(x, delta, positions, meta)
        moe = self.layer.mlp
        weights, indices = moe.gate(h)
        if moe.shared_experts is not None:
            x = x + moe.shared_experts(h)
        return indices, weights, h, x


class ExpertSegment(nn.Cell):
    """The rank's routed experts on the rows that arrived: rows [n, H], mix [n, E_local] -> [n, H]."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    @jit
    def construct(self, rows, mix):
        return self.experts.mix(rows, mix)

    def __call__(self, rows: np.ndarray, mix: np.ndarray) -> np.ndarray:  # numpy in and out (dispatch.exchange)
        return super().__call__(Tensor.from_numpy(rows), Tensor.from_numpy(mix)).asnumpy()


def routed_output(group, moe, experts: ExpertSegment, indices, weights, h, real: int) -> tuple[Tensor, dict]:
    """The routed experts' output [M, H] of a segment's (expert ids, weights, normed h): the first
    `real` rows exchanged with the experts' ranks, the padding rows zero (they never leave the rank);
    and the exchange's stats (ms_models.parallel.dispatch.exchange)."""
    plan = route(indices.asnumpy()[:real], weights.asnumpy()[:real], group.size, moe.per_rank)
    out, stats = exchange(group, h.asnumpy()[:real], plan, experts)
    full = np.zeros((h.shape[0], h.shape[1]), np.float32)
    full[:real] = out
    return Tensor.from_numpy(full), stats


class CompiledEPSteps(SegmentedSteps):
    """One DP rank's compiled segments for every bucket of a BucketConfig (same interface as CompiledSteps)."""

    def __init__(self, model, kv_caches, config: BucketConfig, block_size: int, scratch_block: int, group):
        self.config, self.group = config, group
        self.block_size, self.scratch_block = block_size, scratch_block
        self.compile_s: dict[str, float] = {}
        """Seconds of the first (compiling) call of each bucket (all its segments), and of the experts' graphs."""
        self.exchange_stats = {"exchanges": 0, "sent_rows": 0, "received_rows": 0, "padded_rows": 0}
        """Exchanges run; routed rows this rank sent and received; rows of the padded buffers it sent."""
        m = model.model
        self.hidden = model.config.hidden_size
        self.embed = EmbedSegment(m.embed_tokens)
        self.layers, self.experts = [], []
        for layer, cache in zip(m.layers, kv_caches):
            moe = layer.mlp if isinstance(layer.mlp, DispatchMoE) else None
            cls = DenseLayerSegment if moe is None else MoELayerSegment
            self.layers.append(cls(m.rotary_emb, layer, cache))
            self.experts.append(None if moe is None else (moe, ExpertSegment(moe.experts)))
        self.head = HeadSegment(model, None)

    def _routed(self, layer: int, indices, weights, h, real: int):
        moe, graph = self.experts[layer]
        routed, stats = routed_output(self.group, moe, graph, indices, weights, h, real)
        s = self.exchange_stats
        s["exchanges"] += 1
        s["sent_rows"] += stats["sent_rows"]
        s["received_rows"] += stats["received_rows"]
        s["padded_rows"] += stats["cap"] * self.group.size
        return routed

    def _forward(self, ids, positions, rows, meta, real: int):
        """The segments and exchanges of one padded (or exact) flat batch -> (logits [R, V], hidden)."""
        x = self.embed(ids)
        zero = delta = ops.zeros(x.shape, x.dtype)
        for i, segment in enumerate(self.layers):
            if self.experts[i] is None:
                x, delta = segment(x, delta, positions, *meta), zero
            else:
                indices, weights, h, x = segment(x, delta, positions, *meta)
                delta = self._routed(i, indices, weights, h, real)
        return self.head(x, delta, rows)

    def dummy(self):
        """A forward of no request in the smallest bucket: this rank's part of the other ranks' exchanges."""
        smallest = min(self.config.buckets(), key=lambda b: (b.tokens, b.context))
        return self.run(empty_batch(), smallest)[0]

    def warm_up(self, progress: bool = True) -> dict[str, float]:
        """Compile every bucket's segments on all-padding batches (every rank runs the same buckets in
        the same order, so the exchanges pair up), then the experts' graph of every row capacity a
        bucket can need (local: no exchange)."""
        run = lambda bucket: self.run(empty_batch(), bucket)[0]  # noqa: E731
        buckets = self.config.buckets()
        self.compile_s.update(compile_each(buckets, run, progress))
        n, caps = self.group.size, []
        cap = 1
        while cap <= capacity(max(b.tokens for b in buckets)):
            caps.append(cap)
            cap *= 2
        for i, entry in enumerate(self.experts):
            if entry is None:
                continue
            moe, graph = entry

            def run_experts(cap, graph=graph, width=moe.per_rank):
                return graph(np.zeros((n * cap, self.hidden), np.float32), np.zeros((n * cap, width), np.float32))

            times = compile_each(caps, run_experts, False)
            self.compile_s.update({f"experts[{i}] cap {cap}": s for cap, s in times.items()})
        return dict(self.compile_s)
