"""Rollouts through vLLM with the ms-vllm plugin (vLLM's scheduler, paged KV cache and sampler;
MindSpore computes).

The engine core must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here before
vLLM is imported) so that weight sync can write the new policy straight into the MindSpore
Parameters of the model vLLM serves: ``weight_targets`` fetches them from the worker through
``LLM.collective_rpc``, and ms-reshard writes them in place like any other target. vLLM's KV
cache holds no weights, and prefix caching is switched off so no cached block outlives a weight
update.

Sampling: each request gets ``SamplingParams(seed=...)`` derived from its key, so vLLM's seeded
per-request generators make rollouts reproducible too -- but vLLM draws differently from the
embedded engine, so the two engines produce different (equally valid) samples for one key.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence

import numpy as np

from ..errors import RLHFError
from .rollout import Completion, Request


def _named_parameters(worker) -> dict:
    """Run inside vLLM's worker (collective_rpc): the served MindSpore model's Parameters by name."""
    return dict(worker.runner.model.parameters_and_names())


def request_seed(key: Sequence[int]) -> int:
    """A 63-bit seed from a request key (numpy's SeedSequence hashing, stable across runs)."""
    return int(np.random.SeedSequence(list(key)).generate_state(2, np.uint32).astype(np.uint64) @ [1 << 31, 1])


class VllmEngine:
    """The RolloutEngine interface over a vllm.LLM serving an ms_models checkpoint."""

    def __init__(self, llm, eos_id: int, temperature: float = 1.0):
        self.llm, self.eos_id, self.temperature = llm, eos_id, temperature
        self._targets = None

    @classmethod
    def from_model(cls, model, tokenizer, config, workdir: str | None = None, **llm_kwargs) -> VllmEngine:
        """Write `model` as an HF directory and serve it with vLLM (its weights are replaced by the
        first weight sync anyway; the directory only gives vLLM the architecture)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RLHFError("VllmEngine needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (weights are synced in process)")
        try:
            from vllm import LLM

            import ms_vllm  # noqa: F401  (the plugin must be installed for vLLM to find MindSpore)
        except ImportError as exc:
            raise RLHFError(f"rollout.engine='vllm' needs vllm and ms-vllm installed: {exc}") from None
        import ms_models

        path = workdir or tempfile.mkdtemp(prefix="ms_rlhf_vllm_")
        ms_models.save_safetensors(model, path)
        longest = 64 + config.rollout.max_new_tokens
        args = dict(
            model=path,
            skip_tokenizer_init=True,  # the task's char tokenizer is not an HF one: token ids in and out
            max_model_len=longest,
            block_size=config.rollout.block_size,
            max_num_seqs=config.rollout.prompts_per_step * config.rollout.samples_per_prompt,
            kv_cache_memory_bytes=16 << 20,
            enable_prefix_caching=False,
            enforce_eager=True,
            seed=config.seed,
        )
        args.update(llm_kwargs)
        return cls(LLM(**args), tokenizer.eos_id, config.rollout.temperature)

    def weight_targets(self) -> dict[str, object]:
        if self._targets is None:
            self._targets = self.llm.collective_rpc(_named_parameters)[0]
        return self._targets

    def generate(self, requests: Sequence[Request], batch: int | None = None) -> list[Completion]:
        """Completions in request order (vLLM's scheduler batches them: `batch` is not needed)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not requests:
            return []
        if any(r.stop_after is not None for r in requests):
            raise RLHFError("VllmEngine does not support scripted lengths (stop_after); use the embedded engine")
        params = [
            SamplingParams(temperature=self.temperature, max_tokens=r.max_new_tokens, seed=request_seed(r.key),
                           stop_token_ids=[self.eos_id], logprobs=0, detokenize=False)
            for r in requests
        ]  # fmt: skip
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        completions = []
        for r, out in zip(requests, outs):
            seq = out.outputs[0]
            tokens = [int(t) for t in seq.token_ids]
            logprobs = [float(step[t].logprob) for step, t in zip(seq.logprobs or [], tokens)]
            completions.append(Completion(r.request_id, tokens, logprobs))
        return completions
