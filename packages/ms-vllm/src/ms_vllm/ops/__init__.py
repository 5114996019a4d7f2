"""Fused operators as MindSpore functions: a CPU implementation everywhere and the Ascend kernel
where one is present (`ascend_available()`), so the same call site runs on both."""

from __future__ import annotations

import functools
import glob
import os


@functools.lru_cache(maxsize=1)
def ascend_available() -> bool:
    """True when MindSpore has its Ascend plugin and the host has an NPU (the fused kernels need both).

    Checked from files, not by loading the plugin: on a CPU build that load fails noisily."""
    import mindspore

    plugin = glob.glob(os.path.join(os.path.dirname(mindspore.__file__), "lib", "plugin", "*ascend*"))
    return bool(plugin) and bool(glob.glob("/dev/davinci[0-9]*"))
