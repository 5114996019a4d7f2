"""The MindSpore side of ms-rlhf: rollout engines, weight sync, the GRPO trainer, checkpoints.

Importing anything here loads MindSpore, ms-models, ms-reshard and ms-layout.
"""
