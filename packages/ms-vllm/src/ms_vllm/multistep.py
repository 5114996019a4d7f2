"""Multi-step decoding: several decode iterations per engine step, with vLLM V1's scheduler.

vLLM V1 dropped V0's multi-step scheduler (docs/vllm-cpu.md §5), so this is plugin-side,
split in two halves that must agree:

* the worker (model_runner.py), on a batch where every request decodes one token, runs up to
  K - 1 more iterations itself, feeding each sampled token back in, and returns up to K tokens per
  request. It stops a request early where the scheduler would finish it (max_tokens, a stop token,
  max_model_len) or where its reserved blocks end;
* this scheduler reserves those K - 1 extra slots (vLLM's lookahead slots, the mechanism spec
  decoding uses) and, after a step, marks the keys/values of the extra tokens as computed: the
  worker wrote the cache for every token it fed back, so only the last token is scheduled next.

Tokens are exactly those of K single steps (same model, same sampler, same per-request generator);
what is saved is K - 1 scheduler round trips per K tokens.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

from .platform import multi_step_from


class MultiStepScheduler(Scheduler):
    """vLLM's scheduler with K - 1 lookahead slots and multi-token decode steps."""

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        self.multi_step = multi_step_from(vllm_config)
        self.num_lookahead_tokens = max(self.num_lookahead_tokens, self.multi_step - 1)

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        spec = scheduler_output.scheduled_spec_decode_tokens
        for req_id, i in model_runner_output.req_id_to_index.items():
            extra = len(model_runner_output.sampled_token_ids[i]) - 1
            request = self.requests.get(req_id)
            if extra <= 0 or req_id in spec or request is None or request.is_finished():
                continue
            # The worker fed `extra` sampled tokens back through the model: their keys/values are
            # in the cache, so only the newest token remains to be computed.
            request.num_computed_tokens = request.num_tokens - 1
        return outputs
