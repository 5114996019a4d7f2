"""Bounds on the sizes ms-rlhf reads from its input (configs, command lines, checkpoints).

Each one is an ``ms_layout.limits.Limit``: a value over it is an RLHFError naming the value, the
bound and the environment variable that raises it. docs/ms-rlhf.md lists them.
"""

from __future__ import annotations

from ms_layout.limits import Limit

MAX_PACK_SAMPLES = Limit("MS_RLHF_MAX_PACK_SAMPLES", 8192, "samples in one packing")
"""The greedy packers are quadratic in the number of samples: 5,000 took 3 s, 20,000 took 36 s."""
MAX_SEQ_LEN = Limit("MS_RLHF_MAX_SEQ_LEN", 1 << 20, "tokens per sequence")
"""packing.max_len, rollout.max_new_tokens and rollout.block_size: padded batches allocate rows of this length."""
MAX_ROLLOUT_SAMPLES = Limit("MS_RLHF_MAX_ROLLOUT_SAMPLES", 1 << 18, "samples per rollout")
"""rollout.prompts_per_step * rollout.samples_per_prompt, and packing.micro_batch_size."""
MAX_DATASET_SIZE = Limit("MS_RLHF_MAX_DATASET_SIZE", 1 << 20, "prompts in the dataset")
"""The prompt dataset is drawn and held in memory up front."""
MAX_ROLLOUT_INSTANCES = Limit("MS_RLHF_MAX_ROLLOUT_INSTANCES", 1024, "rollout instances per rank")
MAX_MODEL_DIM = Limit("MS_RLHF_MAX_MODEL_DIM", 1 << 16, "for one model size field")
"""Every integer of the config's `model` overrides (hidden_size, num_hidden_layers, ...)."""
MAX_TASK_LEN = Limit("MS_RLHF_MAX_TASK_LEN", 4096, "characters per task string")
"""The reverse task's max_len and alphabet."""
MAX_OPERAND = Limit("MS_RLHF_MAX_OPERAND", 10**9, "for the add task's operands")
MAX_NPROCS = Limit("MS_RLHF_MAX_NPROCS", 64, "local ranks")
"""`ms-rlhf train --nprocs` starts this many processes on this machine."""
MAX_CONFIG_BYTES = Limit("MS_RLHF_MAX_CONFIG_BYTES", 1 << 20, "bytes of a config file")
MAX_STATE_BYTES = Limit("MS_RLHF_MAX_STATE_BYTES", 1 << 30, "bytes of a checkpoint's state.json")
"""state.json holds the per-step history, so it grows with the run."""
