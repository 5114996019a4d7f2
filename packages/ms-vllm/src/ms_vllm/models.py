"""Model registration: vLLM's ModelRegistry maps the HF architectures to MindSpore-backed classes.

`register_models()` is the `vllm.general_plugins` entry point, run in every vLLM process. Each
registered class satisfies vLLM's model protocol (constructor taking `vllm_config`, `forward`,
`embed_input_ids`, `compute_logits`) so the registry's interface inspection (text generation,
LoRA support) answers as for a native model, but its work is done by the ms-models MindSpore model
it holds in `.ms_model`. The worker resolves the architecture through the registry and builds this
class, so the registry decides what runs, as in vLLM. MindSpore is imported only when a model is
built, never in the API server process.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from torch import nn

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "DeepseekV3ForCausalLM")


class MindSporeCausalLM(nn.Module):
    """A vLLM-facing wrapper around an ms_models causal LM (MindSpore, float32)."""

    supports_lora: ClassVar[bool] = True  # applied by ms_vllm.lora
    supports_pp: ClassVar[bool] = False
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}
    embedding_modules: ClassVar[dict[str, str]] = {}

    def __init__(self, *, vllm_config, prefix: str = "", group=None) -> None:
        super().__init__()
        from .loader import load_ms_model

        self.vllm_config = vllm_config
        self.ms_model = load_ms_model(vllm_config, group)

    # vLLM's protocol, for callers holding torch tensors (the worker calls the MindSpore model directly).
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.ms_model.model.embed_tokens.weight.asnumpy()
        return torch.from_numpy(table[input_ids.numpy()])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **kwargs) -> torch.Tensor:
        """Training-path hidden states of one sequence (no cache): [T] ids -> [T, H]."""
        from mindspore import Tensor

        ids = Tensor(input_ids.numpy().astype(np.int32)[None])
        pos = Tensor(positions.numpy().astype(np.int32)[None])
        return torch.from_numpy(self.ms_model.hidden_states(ids, pos).asnumpy()[0])

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        from mindspore import Tensor

        return torch.from_numpy(self.ms_model.compute_logits(Tensor(hidden_states.numpy())).asnumpy())


class MsLlamaForCausalLM(MindSporeCausalLM):
    """LlamaForCausalLM served by ms_models.LlamaForCausalLM."""


class MsQwen2ForCausalLM(MindSporeCausalLM):
    """Qwen2ForCausalLM served by ms_models.Qwen2ForCausalLM."""


class MsDeepseekV3ForCausalLM(MindSporeCausalLM):
    """DeepseekV3ForCausalLM served by ms_models.DeepseekV3ForCausalLM (its MTP module is the drafter)."""


_CLASSES = {
    "LlamaForCausalLM": MsLlamaForCausalLM,
    "Qwen2ForCausalLM": MsQwen2ForCausalLM,
    "DeepseekV3ForCausalLM": MsDeepseekV3ForCausalLM,
}


def register_models() -> None:
    """vllm.general_plugins entry point: route the HF architectures to the MindSpore classes."""
    from vllm import ModelRegistry

    for arch, cls in _CLASSES.items():
        ModelRegistry.register_model(arch, cls)
    from .quant import register_vllm_quantization

    register_vllm_quantization()


def resolve_model_class(model_config) -> type[MindSporeCausalLM]:
    """The class vLLM's registry gives for the checkpoint's architecture (ours after registration)."""
    from vllm import ModelRegistry

    cls, arch = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    if not (isinstance(cls, type) and issubclass(cls, MindSporeCausalLM)):
        raise ValueError(
            f"architecture {arch!r} resolves to {cls!r}, not a MindSpore model; ms-vllm serves {ARCHITECTURES}"
        )
    return cls
