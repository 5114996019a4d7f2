"""Shared fixtures: tiny checkpoints (ms_models.make_tiny), their reference generations, and
engines built once per module (a vLLM engine takes seconds to start on 2 cores)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

# The engine core runs in the test process: one MindSpore runtime, and no fork of a process that
# already loaded it. `vllm serve` (test_serve.py) covers the multi-process path.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

ARCHS = ("llama", "deepseek_v3")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """{arch: HF directory} written by ms_models.make_tiny."""
    from ms_models import make_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(arch, root / arch, seed=5) for arch in (*ARCHS, "qwen2")}


@pytest.fixture(scope="session")
def reference(tiny_dirs):
    """reference(arch, prompt, n): ms-models' greedy tokens (a full forward per token, no cache)."""
    import mindspore as ms

    from ms_models import from_pretrained, generate_greedy_recompute

    ms.set_device("CPU")
    models, memo = {}, {}

    def generate(arch: str, prompt: list[int], n: int) -> list[int]:
        key = (arch, tuple(prompt), n)
        if key not in memo:
            if arch not in models:
                models[arch] = from_pretrained(tiny_dirs[arch])
            memo[key] = generate_greedy_recompute(models[arch], list(prompt), n)
        return memo[key]

    return generate


def make_llm(path, **kwargs):
    """A vLLM engine on the tiny model with a small KV cache and block size 4 (so short prompts
    fill whole blocks and prefix caching has something to share)."""
    from vllm import LLM

    args = dict(
        model=str(path),
        max_model_len=96,
        block_size=4,
        max_num_seqs=8,
        kv_cache_memory_bytes=4 << 20,
        seed=0,
        enforce_eager=True,
    )
    args.update(kwargs)
    return LLM(**args)


def close_llm(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def token_prompts(prompts):
    return [{"prompt_token_ids": list(p)} for p in prompts]


JSON_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}
"""A schema a random tiny model can only answer by the grammar (tests/test_structured.py, test_serve.py)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forked_env(**extra: str) -> dict[str, str]:
    """This environment for a fresh vLLM process that never runs MindSpore itself (`vllm serve`'s
    API server, tp_generate.py): its engine cores and workers may be forked, not spawned (a DP2
    serve start took 32 s instead of 108 s here), whatever the platform told vLLM in this process,
    which has run MindSpore."""
    return dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD="fork", **extra)


@contextlib.contextmanager
def vllm_server(model, args, log, env=None, wait_s: float = 240):
    """`vllm serve MODEL --host 127.0.0.1 --port P ARGS...` until healthy -> its base URL; the
    process group is killed on exit. `log` receives its output (shown when it fails to start)."""
    import requests

    port = _free_port()
    cmd = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", str(model), "--host", "127.0.0.1",
           "--port", str(port), *args]  # fmt: skip
    env = forked_env(VLLM_ENABLE_V1_MULTIPROCESSING="1", **(env or {}))
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + wait_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"vllm serve not healthy after {wait_s} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
