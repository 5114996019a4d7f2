"""Shared fixtures. Framework fixtures import MindSpore/torch lazily so the core tests run without them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny seeded ms-models Llama checkpoint (HF layout) that transformers reads as is."""
    import mindspore as ms

    from ms_models import make_tiny

    ms.set_device("CPU")
    return make_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=3)


def chromium() -> str | None:
    """Path of a headless-capable Chromium, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(html_path, png_path, width=1400, height=1800) -> None:
    """Render an HTML file in headless Chromium and save a PNG."""
    exe = chromium()
    if exe is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install -y chromium)")
    cmd = [
        exe,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size={width},{height}",
        f"--screenshot={png_path}",
        f"file://{html_path}",
    ]
    subprocess.run(cmd, check=True, timeout=120, capture_output=True)
