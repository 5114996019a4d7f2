"""Build the MindSpore model a worker serves from vLLM's config: an HF directory of safetensors."""

from __future__ import annotations

import logging

# under "vllm.": vLLM configures that logger tree, so the plan line shows in its start-up log
logger = logging.getLogger("vllm.ms_vllm.loader")


def check_loadable(method: str) -> str:
    from .quant_checks import METHODS

    if method not in METHODS:
        raise ValueError(f"quantization={method!r}; ms-vllm loads {METHODS} (made by `ms-vllm quantize`)")
    return method


def load_ms_model(vllm_config, group=None):
    """The ms_models model of `model_config.model` (float32 on MindSpore's CPU kernels); with a
    process group (tensor or DP + expert parallel), this rank's shard of it (ms_models.parallel,
    cut by parallel.plan_of)."""
    import ms_models

    model_config = vllm_config.model_config
    path = model_config.model
    method = model_config.quantization
    if group is not None:
        from ms_models.parallel import build_tp_model

        from .parallel import plan_of

        plan = plan_of(vllm_config, group)
        logger.info("ms-vllm: %s%s", plan.describe(), f", {method}" if method else "")
        if method:
            from .quant_load import load_quantized_shard

            model = load_quantized_shard(path, check_loadable(method), plan, group)
        else:
            model = build_tp_model(path, plan, group)
    elif method:
        from .quant_load import load_quantized

        model = load_quantized(path, check_loadable(method))
    else:
        model = ms_models.from_pretrained(path)
    model.set_train(False)
    if str(model_config.dtype) not in ("torch.float32", "float32"):
        # bf16 matmuls have no MindSpore CPU kernel; the weights were read as float32.
        logger.info("ms-vllm computes in float32 (model_config.dtype=%s)", model_config.dtype)
    return model
