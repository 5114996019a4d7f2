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


def _python_first_env(**extra: str) -> dict[str, str]:
    """msrun starts `python` from PATH, so this interpreter's folder goes first."""
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **extra)


def _supervise(cmds: list[list[str]], outs: list[Path], env: dict[str, str], timeout: float) -> list[int]:
    """Run the launcher commands side by side; their exit codes. Every process they started is
    killed on the way out: msrun starts workers in their own sessions and leaves them alive if it
    is killed, so they are collected by pid while it runs."""
    procs, files, children = [], [], set()
    try:
        for cmd, out in zip(cmds, outs):
            files.append(open(out, "w"))
            procs.append(subprocess.Popen(cmd, stdout=files[-1], stderr=subprocess.STDOUT, env=env))
        launchers = [psutil.Process(p.pid) for p in procs]
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            for launcher in launchers:
                try:
                    children |= set(launcher.children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
            if time.monotonic() > deadline:
                pytest.fail(f"msrun did not finish in {timeout:.0f} s; logs in {outs[0].parent}")
            time.sleep(0.5)
        return [p.returncode for p in procs]
    finally:
        for p in [*(psutil.Process(q.pid) for q in procs if q.poll() is None), *children]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        for f in files:
            f.close()


def run_msrun(script: Path, args: list[str], workers: int, log_dir: Path, timeout: float) -> int:
    """Run `msrun` with `workers` local workers; kill every process it started on the way out."""
    cmd = [
        "msrun", f"--worker_num={workers}", f"--local_worker_num={workers}",
        f"--master_port={free_port()}", f"--log_dir={log_dir}", "--join=True",
        f"--cluster_time_out={int(timeout)}", str(script), *args,
    ]  # fmt: skip
    return _supervise([cmd], [log_dir / "msrun.out"], _python_first_env(), timeout)[0]


def run_msrun_nodes(net, script: Path, args: list[str], log_dir: Path, timeout: float) -> list[int]:
    """Run a multi-node `msrun` job on a shaped network, one node (one worker) per namespace; each
    node's logs in ``log_dir/node<i>``. Returns each node's msrun exit code."""
    dirs = [log_dir / f"node{node}" for node in range(net.nranks)]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    cmds = [
        net.msrun_argv(node, script, args, log_dir=dirs[node], cluster_timeout=int(timeout))
        for node in range(net.nranks)
    ]
    return _supervise(cmds, [d / "msrun.out" for d in dirs], _python_first_env(**net.node_env()), timeout)


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
