"""Shared fixtures: tiny checkpoints written once per session, and the HF reference loader."""

from __future__ import annotations

import numpy as np
import pytest

ARCHS = ("llama", "qwen2", "deepseek_v3")


@pytest.fixture(scope="session", autouse=True)
def _mindspore_cpu():
    import mindspore as ms

    ms.set_device("CPU")


@pytest.fixture(params=["plain", "fused"])
def kernels(request):
    """Run a test with the explicit passes on MindSpore's own ops and again on the fused CPU
    kernels (ms_models.fused; skipped where they cannot be built); automatic again afterwards."""
    from ms_models import fused

    if request.param == "fused":
        try:
            fused.build.library()
        except fused.BuildError as e:
            pytest.skip(f"fused kernels unavailable: {e}")
    fused.enable(request.param == "fused")
    yield request.param
    fused.enable(None)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """{arch: directory} of tiny seeded checkpoints written by make_tiny."""
    from ms_models import make_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(arch, root / arch, seed=7) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    """{arch: model} loaded with from_pretrained (shared: tests must not change their weights)."""
    from ms_models import from_pretrained

    return {arch: from_pretrained(path) for arch, path in tiny_dirs.items()}


def hf_model(path):
    """The HF transformers model of a checkpoint directory, eager attention, float32, eval mode."""
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), attn_implementation="eager", dtype="float32"
    ).eval()


def rel_err(ours, ref) -> float:
    """max |ours - ref| / max |ref|."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def random_ids(batch, seq, vocab=320, seed=0):
    return np.random.default_rng(seed).integers(4, vocab, size=(batch, seq)).astype(np.int32)
