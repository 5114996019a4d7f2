"""Whether vLLM may fork this process: not once MindSpore's runtime runs in it.

vLLM starts its engine cores and workers by fork (the library's default) or spawn (`vllm serve`'s
default, unless VLLM_WORKER_MULTIPROC_METHOD says otherwise). A fork is fast, the child inherits the
imported vLLM; importing MindSpore starts no thread, but its first operation starts a runtime whose
thread pools a forked child would inherit with their locks. Pure Python: no vLLM import.
"""

from __future__ import annotations

import os
import sys

MINDSPORE_RUNTIME_THREADS = ("ActorThread", "KernelThread", "backend_queue", "frontend_queue")
"""Name prefixes of the threads MindSpore starts on its first operation (none on import)."""


def mindspore_runtime_started() -> bool:
    """Whether MindSpore's runtime threads run in this process (a forked child would inherit their
    locks). Read from /proc/self/task; without it, whether MindSpore is imported at all."""
    if "mindspore" not in sys.modules:
        return False
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # pragma: no cover - not Linux
        return True
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(MINDSPORE_RUNTIME_THREADS):
            return True
    return False


__all__ = ["MINDSPORE_RUNTIME_THREADS", "mindspore_runtime_started"]
