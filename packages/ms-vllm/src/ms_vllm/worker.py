"""The vLLM worker: the process-level object vLLM's executor drives through `collective_rpc`.

vLLM calls, in order: `init_device`, `load_model`, `get_kv_cache_spec`,
`determine_available_memory`, `initialize_from_config` (the block count the engine settled on),
`compile_or_warm_up_model`, then `execute_model` once per engine step (and `take_draft_token_ids`
after it when speculative decoding is on). With tensor/expert parallelism vLLM's multiprocessing
executor starts one such worker per rank and sends every call to all of them; each runs it on its
shard (ms_models.parallel) and rank 0's ModelRunnerOutput is the one vLLM reads.
"""

from __future__ import annotations

import logging
import os

import torch
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from .platform import guard_accelerator_cache, multi_step_from

logger = logging.getLogger(__name__)

KV_CACHE_BYTES_ENV = "MS_VLLM_KV_CACHE_BYTES"
DEFAULT_KV_CACHE_BYTES = 256 << 20
COMPILE_CACHE_ENV = "MS_VLLM_COMPILE_CACHE"
"""A directory for MindSpore's on-disk compile cache (off when unset)."""
"""KV cache size when neither kv_cache_memory_bytes nor $MS_VLLM_KV_CACHE_BYTES is given."""


def compile_disabled_reason(vllm_config) -> str:
    """Why this engine's steps run eagerly ("" when they are compiled)."""
    if vllm_config.model_config.enforce_eager:
        return "enforce_eager"
    return ""


class MindSporeWorker(WorkerBase):
    """Runs ms-models with MindSpore for vLLM's V1 engine (one process per TP/EP rank)."""

    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str, is_driver_worker=False):
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.runner = None
        guard_accelerator_cache()

    # ------------------------------------------------------------------ set-up
    def init_device(self) -> None:
        import mindspore as ms

        from .ops import ascend_available

        self.device = torch.device("cpu")
        ascend = ascend_available()
        ms.set_device("Ascend" if ascend else "CPU")
        if not ascend:
            # What stays eager runs op by op: on CPU, MindSpore's asynchronous op queue only makes
            # Python wait on each .shape / .dtype (docs/mindspore-cpu.md §14); on Ascend the
            # queue is what keeps the device busy, so it stays on there.
            ms.set_context(pynative_synchronize=True)
        threads = os.environ.get("MS_VLLM_THREADS")
        if threads:
            ms.set_context(runtime_num_threads=int(threads))
        self.group = None
        from .parallel import expert_data_parallel

        if self.parallel_config.world_size > 1 or expert_data_parallel(self.vllm_config):
            self.group = self._init_parallel()

    def _init_parallel(self):
        """Join vLLM's process groups (its bookkeeping: process titles, group ranks) and the
        ms_layout.comm world that carries the model's collectives.

        vLLM hands every worker the same rendezvous (a file store, `distributed_init_method`; under
        data parallel, the DP master's address); vLLM's init_distributed_environment makes
        torch.distributed's gloo world from it, over all DP x TP ranks, and ms_layout.comm's gloo
        backend adopts that world (same ranks, no second rendezvous)."""
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

        from ms_layout import comm

        p = self.parallel_config
        init_distributed_environment(p.world_size, self.rank, self.distributed_init_method, self.local_rank, "gloo")
        ensure_model_parallel_initialized(p.tensor_parallel_size, p.pipeline_parallel_size)
        rank, size = p.data_parallel_rank * p.world_size + self.rank, p.world_size * p.data_parallel_size
        group = comm.init_process_group("gloo", rank, size)
        if (group.rank, group.size) != (rank, size):
            raise RuntimeError(f"ms_layout.comm joined as rank {group.rank} of {group.size}; vLLM: {rank} of {size}")
        return group

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        from .model_runner import MindSporeModelRunner
        from .models import resolve_model_class

        cls = resolve_model_class(self.model_config)
        wrapper = cls(vllm_config=self.vllm_config, group=self.group)
        model = wrapper.ms_model
        drafter = None
        spec = self.vllm_config.speculative_config
        if spec is not None:
            from .spec_decode import MTPDrafter

            drafter = MTPDrafter(model, spec)
        lora = None
        if self.vllm_config.lora_config is not None:
            from .lora import LoRAManager

            cfg = self.vllm_config.lora_config
            tokens = int(self.vllm_config.scheduler_config.max_num_batched_tokens)
            # TP: each rank's slice of every adapter; DP + EP: the attention and dense layers LoRA
            # adapts are whole on every DP rank, and so are the adapters
            tp = self.group is not None and self.vllm_config.parallel_config.data_parallel_size == 1
            shard = (self.group.rank, self.group.size) if tp else (0, 1)
            lora = LoRAManager(model, cfg.max_loras, cfg.max_lora_rank, max_tokens=tokens, shard=shard)
        self.runner = MindSporeModelRunner(
            self.vllm_config, model, multi_step_from(self.vllm_config), drafter=drafter, lora=lora, group=self.group
        )
        self.model_wrapper = wrapper

    def get_model(self):
        return self.model_wrapper

    def get_kv_cache_spec(self) -> dict:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

        model = self.runner.model
        bs = self.cache_config.block_size
        out = {}
        for i, shapes in enumerate(model.kv_cache_shapes(1, bs)):
            name = f"model.layers.{i}.self_attn.attn"
            if len(shapes) == 1:  # MLA: one latent cache [blocks, block_size, rank + rope]
                out[name] = MLAAttentionSpec(
                    block_size=bs, num_kv_heads=1, head_size=shapes[0][-1], dtype=torch.float32
                )
            else:
                _, _, heads, dim = shapes[0]
                out[name] = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=dim, dtype=torch.float32)
        return out

    def determine_available_memory(self) -> int:
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is None:
            explicit = int(os.environ.get(KV_CACHE_BYTES_ENV, DEFAULT_KV_CACHE_BYTES))
        # The engine divides this among the layers it knows (the main model's); the runner's extra
        # caches (the MTP layer) are taken out of it here so the total stays within the budget.
        runner = self.runner
        main = runner.cache_bytes_per_block() if runner.drafter is None else None
        if main is None:
            with_draft = runner.cache_bytes_per_block()
            drafter, runner.drafter = runner.drafter, None
            main = runner.cache_bytes_per_block()
            runner.drafter = drafter
            return int(explicit * main / with_draft)
        return int(explicit)

    def initialize_from_config(self, kv_cache_config) -> None:
        flat = not compile_disabled_reason(self.vllm_config)  # the layout compiled steps write cheaply
        self.runner.initialize_kv_cache(kv_cache_config.num_blocks, flat=flat)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        """Compile the prefill and decode buckets (compiled.py) unless the engine runs eagerly."""
        from .buckets import BucketConfig

        reason = compile_disabled_reason(self.vllm_config)
        if reason:
            logger.info("ms-vllm: steps run eagerly (%s)", reason)
            return CompilationTimes(language_model=0.0, encoder=0.0)
        runner = self.runner
        sched = self.vllm_config.scheduler_config
        default = BucketConfig.default(int(sched.max_num_seqs), runner.max_model_len, runner.block_size)
        spec = dict((getattr(self.vllm_config, "additional_config", None) or {}).get("compile") or {})
        cache_dir = spec.pop("cache_dir", None) or os.environ.get(COMPILE_CACHE_ENV)
        config = BucketConfig.from_dict(spec, default)
        times = runner.compile(config, progress=self.rank == 0, cache_dir=cache_dir)
        return CompilationTimes(language_model=float(sum(times.values())), encoder=0.0)

    def get_supported_tasks(self):
        return ("generate",)

    def check_health(self) -> None:
        return None

    # ------------------------------------------------------------------ steps
    def execute_model(self, scheduler_output):
        return self.runner.execute(scheduler_output)

    def sample_tokens(self, grammar_output):
        """The step's tokens once vLLM's grammar bitmask is ready (structured outputs, structured.py)."""
        return self.runner.sample_tokens(grammar_output)

    def execute_dummy_batch(self) -> None:
        """vLLM's DP engines call this on a rank with nothing to run while another DP rank steps:
        under DP attention + EP this rank still takes part in the experts' exchanges."""
        self.runner.dummy_step()

    def take_draft_token_ids(self):
        from vllm.v1.outputs import DraftTokenIds

        drafts, self.runner.pending_drafts = self.runner.pending_drafts, None
        if drafts is None:
            return None
        req_ids, tokens = drafts
        return DraftTokenIds(req_ids, tokens)

    def ms_vllm_stats(self) -> dict:
        """The runner's counters (for tests and benchmarks: `llm.collective_rpc("ms_vllm_stats")`),
        with `compile_s`: seconds per compiled bucket ({} when the steps run eagerly)."""
        stats = dict(self.runner.stats)
        stats["eager_reasons"] = dict(stats["eager_reasons"])
        if self.runner.drafter is not None:
            calls = self.runner.drafter.calls
            stats["draft_compiled_calls"], stats["draft_eager_calls"] = calls["compiled"], calls["eager"]
        compiled = self.runner.compiled
        stats["compile_s"] = dict(compiled.compile_s) if compiled is not None else {}
        if hasattr(compiled, "exchange_stats"):  # DP attention + EP: the experts' all-to-alls
            stats["exchange"] = dict(compiled.exchange_stats)
        return stats

    def ms_vllm_shard_info(self) -> dict:
        """What this rank holds (`llm.collective_rpc("ms_vllm_shard_info")`): its rank in the
        TP (or DP x EP) group, parameter elements, weight bytes as stored (int8 / packed int4 for
        quantized layers), quantized cells and the shape of layer 0's KV cache tensors."""
        from .quant import weight_bytes

        runner = self.runner
        model = runner.model
        # the [blocks, block_size, ...] shape of layer 0's first cache tensor, whatever its layout
        first = model.kv_cache_shapes(runner.num_blocks + 1, runner.block_size)[0][0]
        group = self.group
        return {
            "rank": self.rank if group is None else group.rank,
            "world_size": self.parallel_config.world_size if group is None else group.size,
            "data_parallel_rank": self.parallel_config.data_parallel_rank,
            "params": int(model.num_params()),
            "weight_bytes": int(weight_bytes(model)),
            "quantized_cells": sum(type(c).__name__.startswith(("W8A8", "W4A16")) for _, c in model.cells_and_names()),
            "kv_cache_shape": tuple(int(d) for d in first),
            "kv_bytes_per_block": int(runner.cache_bytes_per_block()),
            "compiled": runner.compiled is not None,
        }

    # ------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request) -> bool:
        return self._lora().add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora().remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return lora_id in self._lora().list()

    def list_loras(self) -> set[int]:
        return self._lora().list()

    def _lora(self):
        if self.runner is None or self.runner.lora is None:
            raise RuntimeError("LoRA is not enabled: start the engine with enable_lora=True")
        return self.runner.lora

    def shutdown(self) -> None:
        self.runner = None
        if self.group is not None:
            from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

            from ms_layout import comm

            destroy_model_parallel()
            destroy_distributed_environment()
            comm.destroy()
            self.group = None
