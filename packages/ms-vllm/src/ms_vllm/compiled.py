"""Compiled model steps: one `mindspore.jit` graph per shape bucket (buckets.py is the pure plan).

The graph is ms-models' `CausalLM.paged_step` (the body of `forward_paged`) run by `PagedStep`, a
Cell holding the model and the paged caches (Parameters written by `ops.scatter_nd_update`), with
the paged metadata passed as plain tensors: under jit only tensors and tuples of them stay typed
(docs/mindspore-cpu.md §12). MindSpore keys its compiled graphs by input shapes, so each bucket
compiles once, at start-up (`warm_up`, with a progress bar) on an all-padding batch that writes
only the scratch block; a later call of the same bucket reuses the graph.

MindSpore's on-disk compile cache (MS_COMPILER_CACHE_ENABLE / MS_COMPILER_CACHE_PATH) is used when
a cache directory is given ($MS_VLLM_COMPILE_CACHE or additional_config["compile"]["cache_dir"]):
the graphs go to a sub-directory keyed by everything they depend on (model config, buckets, cache
blocks, block size, versions), because MindSpore numbers cached graphs by compile order. With the
caches held by a Cell the cached graphs gave the eager logits; a plain function that captured the
caches in a closure loaded from the cache gave NaN logits (docs/mindspore-cpu.md §12).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import numpy as np
from mindspore import ParameterTuple, jit, nn

from .batch import StepBatch
from .buckets import Bucket, BucketConfig, pad_part

logger = logging.getLogger(__name__)


class PagedStep(nn.Cell):
    """model.paged_step over the caches it holds, compiled (one graph per input shape)."""

    def __init__(self, model, kv_caches):
        super().__init__()
        self.lm = model
        per_layer = [tuple(c) if isinstance(c, (tuple, list)) else (c,) for c in kv_caches]
        self.per = len(per_layer[0])
        self.n_layers = len(per_layer)
        self.single = not isinstance(kv_caches[0], (tuple, list))
        self.flat = ParameterTuple([p for layer in per_layer for p in layer])

    @jit
    def construct(self, input_ids, positions, logits_rows, write_index, write_rows, context_slots, query_rows,
                  padded_rows, allowed, write_slots):  # fmt: skip
        if self.single:
            caches = tuple(self.flat[i] for i in range(self.n_layers))
        else:
            caches = tuple(tuple(self.flat[i * self.per + j] for j in range(self.per)) for i in range(self.n_layers))
        meta = (write_index, write_rows, context_slots, query_rows, padded_rows, allowed, write_slots)
        return self.lm.paged_step(input_ids, positions, caches, meta, logits_rows)


def cache_key(model, config: BucketConfig, num_blocks: int, block_size: int, lora=None) -> str:
    """What the compiled graphs depend on, hashed (the compile-cache sub-directory); `lora`: the
    LoRA banks' (slots, rank, token capacity), None without LoRA."""
    import mindspore

    from . import __version__

    cfg = model.config
    fields = cfg.to_dict() if hasattr(cfg, "to_dict") else vars(cfg)
    blob = json.dumps(
        [type(model).__name__, fields, config.buckets().__repr__(), num_blocks, block_size, mindspore.__version__,
         __version__, lora], sort_keys=True, default=str,
    )  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def use_compile_cache(root: str, key: str) -> str:
    """Point MindSpore's compile cache at root/key (made if missing); returns that directory."""
    path = os.path.join(os.path.abspath(root), key)
    os.makedirs(path, exist_ok=True)
    os.environ["MS_COMPILER_CACHE_ENABLE"] = "1"
    os.environ["MS_COMPILER_CACHE_PATH"] = path
    return path


class CompiledSteps:
    """The compiled paged step of one model and its caches, for every bucket of a BucketConfig."""

    def __init__(self, model, kv_caches, config: BucketConfig, block_size: int, scratch_block: int):
        self.model = model
        self.config = config
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.compile_s: dict[str, float] = {}
        """Seconds of the first (compiling) call of each bucket."""
        self._graph = PagedStep(model, kv_caches)

    def run(self, batch: StepBatch, bucket: Bucket):
        """(logits of the part's sample rows [R_real, V] numpy, hidden [T_real, H]) of one part, compiled.

        The logits, the output the graph computes last, are read first: the call returns before its
        graph has run, and any other read (or a PyNative op on the hidden states) would busy-wait the
        host thread against the kernels meanwhile (docs/mindspore-cpu.md §15; with MTP, whose
        drafter slices the hidden states, a decode step took twice as long)."""
        ids, positions, rows, meta = batch_inputs(batch, bucket, self.scratch_block, self.block_size)
        logits, hidden = self._graph(ids, positions, rows, *meta)
        logits = logits.asnumpy()[: batch.logits_indices.size]
        return logits, hidden[: len(batch.input_ids)]

    def warm_up(self, progress: bool = True) -> dict[str, float]:
        """Compile every bucket (on all-padding batches: only the scratch block is written)."""
        buckets = self.config.buckets()
        self.compile_s.update(compile_each(buckets, lambda b: self.run(empty_batch(), b)[0], progress))
        logger.info("ms-vllm: compiled %d buckets in %.1f s", len(buckets), sum(self.compile_s.values()))
        return dict(self.compile_s)


def padded_inputs(ids, positions, slots, tables, seq_lens, starts, rows, bucket: Bucket, scratch_block: int,
                  block_size: int):  # fmt: skip
    """A part's flat inputs padded to `bucket` (padding writes only `scratch_block`), as every
    compiled graph takes them: (ids, positions, logits rows) tensors and the PagedMetadata tensors."""
    from mindspore import Tensor

    from ms_models import PagedMetadata

    p = pad_part(ids, positions, slots, tables, seq_lens, starts, rows, bucket, scratch_block, block_size)
    meta = PagedMetadata.build(
        p.positions, p.slot_mapping, p.block_tables, p.seq_lens, p.query_start_loc, block_size,
        query_len=bucket.query, context_len=bucket.context,
    )  # fmt: skip
    return Tensor(p.input_ids), Tensor(p.positions), Tensor(p.logits_rows), meta.tensors()


def batch_inputs(batch: StepBatch, bucket: Bucket, scratch_block: int, block_size: int):
    """padded_inputs of one StepBatch."""
    return padded_inputs(
        batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens,
        batch.query_start_loc, batch.logits_indices, bucket, scratch_block, block_size,
    )  # fmt: skip


def empty_batch() -> StepBatch:
    """A batch of no request: run in a bucket, it is all padding (the warm-up's compiling call)."""
    none = np.zeros(0, np.int32)
    return StepBatch([], none, none, none, np.zeros((0, 1), np.int32), none, np.zeros(1, np.int32), [], [])


def compile_each(items, run, progress: bool, desc: str = "ms-vllm: compiling buckets") -> dict[str, float]:
    """Call run(item) for every item (the first call of a graph compiles it), waiting on what it
    returns: {str(item): seconds}."""
    out = {}
    for item in _progress(items, progress, desc):
        t = time.perf_counter()
        result = run(item)
        if hasattr(result, "asnumpy"):
            result.asnumpy()
        out[str(item)] = round(time.perf_counter() - t, 3)
    return out


def _progress(items, enabled: bool, desc: str = "ms-vllm: compiling buckets"):
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency of vLLM
        return items
    return tqdm(items, desc=desc, unit="graph")
