"""The live dashboard rendered by headless Chromium: rows, plot lines and alerts of 4 ranks, and a screenshot."""

import os
import re
import shutil
import subprocess

import pytest
from conftest import Ranks, get_json, wait_for

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (Debian: apt-get install -y chromium)"
)


def chromium(*args, timeout=90):
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--window-size=1280,900",
        "--virtual-time-budget=5000",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_dashboard_shows_every_rank_and_the_slow_one(daemon, tmp_path):
    ranks = Ranks(daemon.agent_addrs[0], ranks=(0, 1, 2, 3), step_s=0.01, slow={3: 0.02}, sync=True)
    try:
        wait_for(
            lambda: any(a["kind"] == "slow_rank" for a in get_json(daemon.http_url + "/api/status")["alerts"]),
            what="a slow-rank alert",
        )
        dom = chromium("--dump-dom", daemon.http_url + "/").stdout
        shot = tmp_path / "dashboard.png"
        chromium(f"--screenshot={shot}", daemon.http_url + "/")
    finally:
        ranks.close()
    assert sorted(map(int, re.findall(r'<tr data-rank="(\d+)"', dom))) == [0, 1, 2, 3]
    assert sorted(map(int, re.findall(r'<path data-rank="(\d+)"', dom))) == [0, 1, 2, 3]
    assert re.search(r'<li data-kind="slow_rank" data-rank="3"', dom)
    assert re.search(r"<div id=\"meta\">4 ranks, \d+ samples received", dom)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    keep = os.environ.get("MS_MONITOR_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)
