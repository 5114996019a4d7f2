"""Shared helpers of the integration tests: launching real jobs under MindSpore's msrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SCRIPTS = Path(__file__).parent / "scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_msrun(script: Path, args: list[str], workers: int, log_dir: Path, timeout: float) -> int:
    """Run `msrun` with `workers` local workers; kill every process it started on the way out.

    msrun starts `python` from PATH, so this interpreter's folder goes first; it starts workers in
    their own sessions and leaves them alive if it is killed, so they are collected by pid.
    """
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    cmd = [
        "msrun", f"--worker_num={workers}", f"--local_worker_num={workers}",
        f"--master_port={free_port()}", f"--log_dir={log_dir}", "--join=True",
        f"--cluster_time_out={int(timeout)}", str(script), *args,
    ]  # fmt: skip
    with open(log_dir / "msrun.out", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        launcher = psutil.Process(proc.pid)
        children: set[psutil.Process] = set()
        try:
            while True:
                try:
                    children |= set(launcher.children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
                try:
                    return proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    timeout -= 0.5
                    if timeout <= 0:
                        pytest.fail(f"msrun did not finish; logs in {log_dir}")
        finally:
            for p in [launcher, *children]:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass


def logs(log_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(log_dir.glob("*")) if p.is_file())


def wait_for(cond, timeout: float, what: str):
    """Poll ``cond`` until it returns something truthy (returned), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
