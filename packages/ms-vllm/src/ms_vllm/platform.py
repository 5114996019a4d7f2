"""The MindSpore platform: how vLLM's engine learns to use our worker instead of its CUDA one.

vLLM picks exactly one out-of-tree platform returned by a `vllm.platform_plugins` entry point over
its built-ins (docs/vllm-cpu.md §2). The platform routes the engine to
`ms_vllm.worker.MindSporeWorker`, turns off what only makes sense for torch models on a GPU
(torch.compile, CUDA graphs, async scheduling), checks the parallel settings (parallel.py) and,
when multi-step decoding is asked for, swaps in the plugin's scheduler. MindSpore itself is not
imported here: this module is loaded in the API server process too, which never computes.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from .forking import mindspore_runtime_started
from .parallel import check_vllm_parallel

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

MULTI_STEP_ENV = "MS_VLLM_MULTI_STEP"
"""Decode iterations per engine step (vLLM V1 has no such option; read in every process)."""


def multi_step_from(vllm_config) -> int:
    """Decode iterations per engine step: additional_config["multi_step"], else $MS_VLLM_MULTI_STEP, else 1."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    value = extra.get("multi_step", os.environ.get(MULTI_STEP_ENV, 1))
    steps = int(value)
    if steps < 1:
        raise ValueError(f"multi_step={value!r}; expected an int >= 1")
    return steps


def guard_accelerator_cache() -> None:
    """vLLM's shutdown calls torch.accelerator.empty_cache() on every non-CPU platform, which raises
    on a CPU-only torch ("Cannot access accelerator device when none is available"). Make the two
    cache flushes no-ops when torch has no accelerator; with one, they stay untouched."""
    accel = getattr(torch, "accelerator", None)
    if accel is None or accel.is_available() or getattr(accel, "_ms_vllm_guarded", False):
        return
    for name in ("empty_cache", "empty_host_cache"):
        if hasattr(accel, name):
            setattr(accel, name, lambda *args, **kwargs: None)
    accel._ms_vllm_guarded = True


class MindSporePlatform(Platform):
    """vLLM platform whose worker runs ms-models with MindSpore (CPU here, Ascend where present)."""

    _enum = PlatformEnum.OOT
    # vLLM builds torch devices named f"{device_name}:{index}" for an out-of-tree platform's process
    # groups (tensor parallel); MindSpore owns the model, torch only sees host tensors.
    device_name = "cpu"
    # vLLM builds its own host-side tensors (sampling metadata, LoRA bookkeeping) on this torch
    # device; MindSpore owns the model and the KV cache.
    device_type = "cpu"
    dispatch_key = "CPU"
    ray_device_key = ""
    simple_compile_backend = "eager"
    dist_backend = "gloo"
    supported_quantization: list[str] = ["ms_w8a8", "ms_w4a16"]  # noqa: RUF012 - vLLM's own attribute shape

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        # bf16 matmuls have no MindSpore CPU kernel; the models compute in float32.
        return [torch.float32]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "mindspore-cpu"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        import psutil

        return int(psutil.virtual_memory().total)

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        import psutil

        return float(psutil.Process().memory_info().rss)

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def set_device(cls, device) -> None:
        pass

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        # Attention runs inside the MindSpore model over its own paged cache; vLLM's torch backends
        # are never built. The CPU backend's name satisfies code that only wants a class path.
        return "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"

    @classmethod
    def get_punica_wrapper(cls) -> str:
        # LoRA is applied by ms_vllm.lora inside the MindSpore model; vLLM's punica kernels are unused.
        return "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm.config import CompilationMode

        guard_accelerator_cache()
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = "ms_vllm.worker.MindSporeWorker"
        # Tensor/expert parallel runs one worker process per rank under vLLM's "mp" executor;
        # what is not built is refused here, at start-up, rather than mid-request (parallel.py).
        check_vllm_parallel(vllm_config)
        # vLLM forks its engine cores and workers (the library's default; `vllm serve` asks for
        # spawn unless VLLM_WORKER_MULTIPROC_METHOD says otherwise). A fork is fast (the child
        # inherits the imported vLLM) and safe while this process has not started MindSpore's
        # runtime; a fork of a process running its thread pools is not, so then they are spawned
        # (measured: ~1.5 min more engine start-up here).
        if mindspore_runtime_started() and os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn":
            logger.info("ms-vllm: MindSpore's runtime runs in this process; its children are spawned")
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE
        compilation.cudagraph_capture_sizes = []
        try:
            from vllm.config import CUDAGraphMode

            compilation.cudagraph_mode = CUDAGraphMode.NONE
        except ImportError:  # pragma: no cover - older vLLM
            pass
        scheduler = vllm_config.scheduler_config
        scheduler.async_scheduling = False
        if vllm_config.model_config is not None and multi_step_from(vllm_config) > 1:
            scheduler.scheduler_cls = "ms_vllm.multistep.MultiStepScheduler"
        cache = vllm_config.cache_config
        if cache is not None and not cache.user_specified_block_size:
            cache.block_size = 16

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return False


guard_accelerator_cache()
