"""Compiled model steps: one `mindspore.jit` graph per shape bucket (buckets.py is the pure plan).

The graph is ms-models' `CausalLM.paged_step` (the body of `forward_paged`) with the paged
caches, Parameters written by `ops.scatter_nd_update`, captured by the closure, and the paged
metadata passed as plain tensors: under jit only tensors and tuples of them stay typed
(docs/mindspore-cpu.md §12). MindSpore keys its compiled graphs by input shapes, so each bucket
compiles once, at start-up (`warm_up`, with a progress bar) on an all-padding batch that writes
only the scratch block; a later call of the same bucket reuses the graph.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .batch import StepBatch
from .buckets import Bucket, BucketConfig, pad_part

logger = logging.getLogger(__name__)


class CompiledSteps:
    """The compiled paged step of one model and its caches, for every bucket of a BucketConfig."""

    def __init__(self, model, kv_caches, config: BucketConfig, block_size: int, scratch_block: int):
        import mindspore as ms

        self.model = model
        self.config = config
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.compile_s: dict[str, float] = {}
        """Seconds of the first (compiling) call of each bucket."""
        caches = tuple(kv_caches)

        def paged_graph(input_ids, positions, logits_rows, write_index, write_rows, context_slots, query_rows,
                        padded_rows, allowed):  # fmt: skip
            meta = (write_index, write_rows, context_slots, query_rows, padded_rows, allowed)
            return model.paged_step(input_ids, positions, caches, meta, logits_rows)

        self._graph = ms.jit(paged_graph)

    def run(self, batch: StepBatch, bucket: Bucket):
        """(logits of the part's sample rows [R_real, V], hidden [T_real, H]) of one part, compiled."""
        from mindspore import Tensor

        from ms_models import PagedMetadata

        rows = batch.logits_indices
        p = pad_part(
            batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens,
            batch.query_start_loc, rows, bucket, self.scratch_block, self.block_size,
        )  # fmt: skip
        meta = PagedMetadata.build(
            p.positions, p.slot_mapping, p.block_tables, p.seq_lens, p.query_start_loc, self.block_size,
            query_len=bucket.query, context_len=bucket.context,
        )  # fmt: skip
        logits, hidden = self._graph(Tensor(p.input_ids), Tensor(p.positions), Tensor(p.logits_rows), *meta.tensors())
        return logits[: len(rows)], hidden[: len(batch.input_ids)]

    def warm_up(self, progress: bool = True) -> dict[str, float]:
        """Compile every bucket (on all-padding batches: only the scratch block is written)."""
        buckets = self.config.buckets()
        bar = _progress(buckets, progress)
        for bucket in bar:
            none = np.zeros(0, np.int32)
            empty = StepBatch([], none, none, none, np.zeros((0, 1), np.int32), none, np.zeros(1, np.int32), [], [])
            t = time.perf_counter()
            logits, _ = self.run(empty, bucket)
            logits.asnumpy()
            self.compile_s[str(bucket)] = round(time.perf_counter() - t, 3)
        total = sum(self.compile_s.values())
        logger.info("ms-vllm: compiled %d buckets in %.1f s", len(buckets), total)
        return dict(self.compile_s)


def _progress(items, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency of vLLM
        return items
    return tqdm(items, desc="ms-vllm: compiling buckets", unit="graph")
