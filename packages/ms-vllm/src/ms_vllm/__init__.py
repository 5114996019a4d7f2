"""ms-vllm: a vLLM V1 platform plugin that serves ms-models with MindSpore.

Installed next to vLLM (`pip install --no-deps vllm==0.33.0`), it is found through vLLM's entry
points: `vllm.platform_plugins` -> `register_platform` (the MindSpore platform and worker),
`vllm.general_plugins` -> `register_models` (Llama/Qwen2/DeepSeek-V3 architectures mapped to
MindSpore models). vLLM keeps its scheduler, KV block manager, prefix cache, LLM API and OpenAI
server; the worker computes with MindSpore.
"""

from __future__ import annotations

import importlib.util

from .parallel import ParallelError, ShardPlan

__version__ = "0.2.0"

__all__ = ["PLATFORM", "ParallelError", "ShardPlan", "register_models", "register_platform"]

PLATFORM = "ms_vllm.platform.MindSporePlatform"


def register_platform() -> str | None:
    """vllm.platform_plugins entry point: our platform when MindSpore is installed, else None."""
    if importlib.util.find_spec("mindspore") is None:
        return None
    return PLATFORM


def register_models() -> None:
    """vllm.general_plugins entry point: register the MindSpore model classes with vLLM."""
    from .models import register_models as _register

    _register()
