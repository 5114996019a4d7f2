"""Compile the fused kernels' source into a shared library, once per machine, and cache it.

The library is built with the system C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``)
for the host's own instruction set (``-march=native``), so the cache key holds the source, the
flags, the compiler's version and the CPU's feature flags: a cache directory shared by different
machines (a cluster's home) never hands one machine another's build. Several processes building
at once (the ranks of one job) each write a private file and rename it into place.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.cc")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC")
"""``-ffast-math`` lets the compiler vectorize ``exp`` (glibc's vector math library)."""


class BuildError(RuntimeError):
    """The fused kernels cannot be built here (no compiler, or it failed): the reason."""


def compiler() -> str | None:
    """The C++ compiler to use, or None."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((path for name in names if (path := shutil.which(name))), None)


def cache_dir() -> Path:
    """``$MS_MODELS_CACHE/kernels``, else ``$XDG_CACHE_HOME/ms_models/kernels`` (``~/.cache``)."""
    if os.environ.get("MS_MODELS_CACHE"):
        return Path(os.environ["MS_MODELS_CACHE"]) / "kernels"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ms_models" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def _version(cxx: str) -> str:
    """``cxx --version`` (once per compiler and process: every block's passes ask for the library)."""
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout


def _key(cxx: str) -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (" ".join(FLAGS), _version(cxx), _cpu_flags(), platform.machine()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def library() -> Path:
    """The built library's path, building it if this machine has none cached yet."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set $CXX, or install g++ or clang++)")
    out = cache_dir() / f"ms_models_fused_{_key(cxx)}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, str(SOURCE), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent builder's identical file is replaced whole
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
