"""`nox -s demo` end to end: the demo runs as a subprocess, every stage's checks pass, and its HTML
report renders in headless Chromium.

The demo runs with `--quick` (3 pretraining steps and 3 GRPO steps instead of 6 and 4): the same
stages, checks and report, in less of the integration suite's time on 2 shared cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("pretrain", "probe", "reshard", "serve", "grpo", "recompute")

pytestmark = pytest.mark.timeout(1500)


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if path := shutil.which(name):
            return path
    return None


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    pytest.importorskip("vllm", reason="the demo serves through vLLM (pip install --no-deps vllm==0.33.0)")
    out = tmp_path_factory.mktemp("demo")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "demo" / "run.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=1400, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    return proc, out


def test_every_stage_passes_and_the_report_path_is_printed(demo):
    proc, out = demo
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    match = re.search(r"^report: (.+\.html)$", proc.stdout, re.MULTILINE)
    assert match, tail
    assert Path(match.group(1)) == out / "report.html" and (out / "report.html").stat().st_size > 20_000
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["stages"]] == list(STAGES)
    for stage in summary["stages"]:
        assert stage["passed"] and stage["checks"], stage
        assert all(c["passed"] for c in stage["checks"]), stage


def test_stage_numbers_hold_against_their_references(demo):
    _, out = demo
    stages = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["stages"]}
    pre = stages["pretrain"]["numbers"]
    assert pre["last_loss"] < pre["first_loss"]
    probe = stages["probe"]["numbers"]
    assert probe["first_divergence"] is None and probe["first_divergence_step1"] is None
    # within float32 rounding of each tensor's scale: the bound n * u, not a looser one
    assert probe["rtol"] < 1e-3 and probe["max_relative_grad_err"] <= probe["rtol"]
    assert probe["max_relative_update_err"] <= probe["update_rtol"] < 1e-5
    # step 1 dumped on the pipeline ranks: every pass of the schedule seen, nothing diverges
    assert probe["pipelined_first_divergence"] is None and probe["pipelined_passes"] == ["B", "F", "W"]
    assert probe["pipelined_compared_modules"] > 0
    answers = stages["serve"]["numbers"]["answers"]
    assert answers and all(a["tokens"] == a["reference"] and a["tokens"] for a in answers)
    serve = stages["serve"]["numbers"]
    assert serve["logprob_max_abs_diff"] <= serve["logprob_tolerance"] < 1e-2
    grpo = stages["grpo"]["numbers"]
    assert grpo["resumed_losses"] == grpo["losses"][-len(grpo["resumed_losses"]) :]
    # paired recompute with the TP all-reduces: the ping-pong order, gradients within float32
    # rounding of the single-process model's, over the shaped link where namespaces can be made
    rc = stages["recompute"]["numbers"]
    assert rc["paired_order"] == "3c0 3>0 2c0 2>0 3<0 3c1 2<0 2c1 1c0 1>0 0c0 0>0 1<0 1c1 0<0 0c1"
    assert rc["max_relative_grad_err"] <= rc["rtol"] < 1e-3
    assert rc["last_loss"] < rc["first_loss"]
    from ms_layout.comm.netns import available

    if available()[0]:
        assert rc["link"].startswith("shaped ") and min(rc["sent_bytes"]) > 0, rc["link"]
    else:
        assert rc["link"] == "loopback", rc["link"]
    # measured, not asserted faster: both parts timed, the ratio reported
    assert rc["recompute_ms_paired"] > 0 and rc["recompute_ms_sequential"] > 0
    ratio = rc["recompute_ms_paired"] / rc["recompute_ms_sequential"]  # of the rounded ms: within 1e-2
    assert abs(rc["recompute_paired_over_sequential"] - ratio) < 1e-2, (rc["recompute_paired_over_sequential"], ratio)


@pytest.mark.parametrize(
    ("fault", "check", "module"),
    [
        # noise of 1 % on one weight of rank 1's stage: step 1's dump diverges at that Linear
        ("perturb-weight", "step 1: every compared tensor within float32 rounding of its scale",
         "model.layers.2.self_attn.o_proj"),
        # microbatch 1's weight gradients dropped on every stage: every gradient is off, the
        # first in the model's order is the embedding's
        ("lose-microbatch", "step 1: every gradient within float32 rounding of its scale", "model.embed_tokens"),
    ],
    ids=["perturb-weight", "lose-microbatch"],
)  # fmt: skip
def test_the_probe_check_fails_on_a_bug_injected_into_the_pipelined_step(tmp_path, fault, check, module):
    """The checks that pass on the clean run catch a real bug, and name where it starts."""
    pytest.importorskip("mindspore")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "demo" / "run.py"), "--quick", "--only", "probe", "--fault", fault,
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=1400, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 1, tail
    stages = {s["name"]: s for s in json.loads((tmp_path / "summary.json").read_text())["stages"]}
    assert list(stages) == ["pretrain", "probe"] and stages["pretrain"]["passed"]
    checks = {c["name"]: c for c in stages["probe"]["checks"]}
    failed = checks[check]
    assert not failed["passed"], failed
    assert f"the first in module {module} (" in failed["detail"], failed["detail"]
    # by orders of magnitude, not by a hair: the bound separates rounding from a bug
    worst = float(re.search(r"worst max\|diff\| / max\|value\| = (\S+)", failed["detail"]).group(1))
    assert worst > 10 * stages["probe"]["numbers"]["rtol"], failed["detail"]
    if fault == "perturb-weight":  # named in the pipelined dump with its stage, microbatch and pass
        numbers = stages["probe"]["numbers"]
        assert numbers["pipelined_first_divergence"].startswith(f"Cell.{module}."), numbers
        assert numbers["pipelined_first_divergence_where"] == {"stage": 1, "microbatch": 0, "pass": "F"}, numbers
        assert not checks["step 1 on the pipeline ranks: ms-probe finds no diverging module"]["passed"]


def test_report_renders_in_headless_chromium(demo):
    _, out = demo
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install -y chromium)")
    png = out / "report.png"
    cmd = [
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,2400",
        f"--screenshot={png}", f"file://{out / 'report.html'}",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=180, capture_output=True)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    pixels = _decode(png)
    # not blank: many distinct colours (text, tables, the embedded plots), not one background
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 50


def _decode(png: Path) -> np.ndarray:
    import matplotlib.image

    return (matplotlib.image.imread(str(png))[..., :3] * 255).astype(np.uint8)
