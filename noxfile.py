"""Every task of the monorepo: tests, integration, lint, bench.

Each package is tested in its own virtual environment holding only that package, the local
packages it declares, and its `test` extra, so a missing dependency fails here and not on a
user's machine. Packages with a `test-core` extra get a second run without the heavy
frameworks, proving their pure algorithms import numpy only (markers `needs_torch` and
`needs_mindspore` deselect the rest), and their full run then takes only the tests marked so: each
test runs once (the framework-free ones where they must work without the frameworks); run twice,
they had taken about 6 minutes of a 54-minute CI. uv makes the repeated MindSpore + torch environments cheap.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "integration"]
nox.options.reuse_existing_virtualenvs = True

# uv does not read pip's configuration: hand it the folder of local wheels (a CPU build of torch)
# that pip is told about, or it would download PyPI's multi-GB CUDA build of torch.
if os.environ.get("PIP_FIND_LINKS") and not os.environ.get("UV_FIND_LINKS"):
    os.environ["UV_FIND_LINKS"] = os.environ["PIP_FIND_LINKS"]
# ... and hold it to the versions tested here (that CPU torch, MindSpore 2.10, numpy<2).
os.environ.setdefault("UV_CONSTRAINT", str(ROOT / "constraints.txt"))


def _pyproject(package: str) -> dict:
    return tomllib.loads((PACKAGES_DIR / package / "pyproject.toml").read_text())


def _packages() -> list[str]:
    return sorted(p.parent.name for p in PACKAGES_DIR.glob("*/pyproject.toml"))


def _local_deps(package: str, extra: str | None = None, seen: set[str] | None = None) -> list[str]:
    """Local packages that `package` (with `extra`) depends on, dependencies first; they are
    installed from packages/ because they are not on PyPI yet. A dependency's own extras are not
    followed, so a `test-core` environment never pulls in what only the full `test` extra needs."""
    seen = set() if seen is None else seen
    local = set(_packages())
    project = _pyproject(package)["project"]
    requirements = list(project.get("dependencies", []))
    if extra:
        requirements += project.get("optional-dependencies", {}).get(extra, [])
    out: list[str] = []
    for requirement in requirements:
        name = re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0]
        if name in local and name != package and name not in seen:
            seen.add(name)
            out += _local_deps(name, None, seen) + [name]
    return out


def _variants() -> list[str]:
    out = []
    for package in _packages():
        out.append(package)
        if "test-core" in _pyproject(package)["project"].get("optional-dependencies", {}):
            out.append(f"{package}-core")
    return out


def _preinstall(session: nox.Session, package: str) -> None:
    """Installs a package declares it needs before its own, e.g. vLLM without its CUDA stack:
    `[tool.ms-toolkit] nox-preinstall = [["--no-deps", "vllm==0.33.0"]]` in its pyproject.toml."""
    for args in _pyproject(package).get("tool", {}).get("ms-toolkit", {}).get("nox-preinstall", []):
        session.install(*args)


#: pytest-xdist workers of `nox -s integration` (its files are multi-process jobs and start-ups)
INTEGRATION_WORKERS = 2
#: pytest-xdist workers of a package's `-core` tests (framework-free, single-threaded: on the 2-core CI
#: box 2 workers took 7 core suites from ~400 s to ~330 s, ms-reshard 63 -> 39 s, ms-monitor 82 -> 60 s)
CORE_WORKERS = 2


def _test_workers(package: str) -> int:
    """How many pytest-xdist workers a package's tests take: `[tool.ms-toolkit] test-workers = 2` in
    its pyproject.toml, for a suite of long, mostly single-threaded tests (compiles, engine start-ups)."""
    return int(_pyproject(package).get("tool", {}).get("ms-toolkit", {}).get("test-workers", 1))


def _xdist(workers: int) -> list[str]:
    """pytest arguments for `workers` workers; `loadfile` keeps each file's tests (and its module
    fixtures: a server, a demo run) on one worker."""
    return ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []


def _install_package(session: nox.Session, package: str, extra: str) -> None:
    for dep in _local_deps(package, extra):
        _preinstall(session, dep)
        session.install("-e", str(PACKAGES_DIR / dep))
    if extra != "test-core":
        _preinstall(session, package)
    session.install("-e", f"{PACKAGES_DIR / package}[{extra}]")


@nox.session
@nox.parametrize("variant", _variants(), ids=_variants())
def tests(session: nox.Session, variant: str) -> None:
    """Unit tests of one package in an environment of its own. A package with a `-core` variant
    splits its tests: `-core` runs the unmarked ones without torch/MindSpore, the full variant the
    ones marked `needs_torch` or `needs_mindspore`."""
    core = variant.endswith("-core")
    package = variant.removesuffix("-core")
    _install_package(session, package, "test-core" if core else "test")
    if core:
        args = ["-m", "not needs_torch and not needs_mindspore"]
    elif f"{package}-core" in _variants():
        args = ["-m", "needs_torch or needs_mindspore"]
    else:
        args = []
    if core:
        # The core variant must not even see the frameworks.
        session.run(
            "python",
            "-c",
            "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('torch', 'mindspore')))",
        )
    # The core tests are single-threaded Python (schedules, planners, packers): one per core.
    workers = _xdist(CORE_WORKERS if core else _test_workers(package))
    if workers:
        session.install("pytest-xdist>=3.5")
    session.run("pytest", str(PACKAGES_DIR / package / "tests"), *args, *workers, "--durations=8", *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """Tests that compose several packages and processes (msrun launches, multi-rank runs)."""
    for package in _packages():
        _install_package(session, package, "test")
    session.install("psutil", "pytest-xdist>=3.5")  # psutil: to collect the workers msrun leaves behind
    session.run(
        "pytest", str(ROOT / "integration_tests"), *_xdist(INTEGRATION_WORKERS), "--durations=25", *session.posargs
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def bench(session: nox.Session) -> None:
    """Run every benchmarks/bench_*.py, print a table, write benchmarks/results/*.json."""
    for package in _packages():
        _install_package(session, package, "test")
    session.install("rich>=13")
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    for script in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        name = script.stem.removeprefix("bench_")
        session.run("python", str(script), "--out", str(results / f"{name}.json"), *session.posargs)
        if name == "vllm":  # the offline comparison and `vllm serve` under `vllm bench serve`, per model
            for model in ("tiny", "mid"):
                out = results / f"vllm_{model}.json"
                session.run("python", str(script), "--model", model, "--out", str(out), *session.posargs)
                out = results / f"vllm_serve_{model}.json"
                session.run("python", str(script), "--serve", model, "--out", str(out), *session.posargs)
            out = results / "vllm_dp_ep.json"
            session.run("python", str(script), "--serve", "dp-ep", "--out", str(out), *session.posargs)
    summary = ROOT / "benchmarks" / "summary.py"
    session.run("python", str(summary), str(results), "--markdown", str(ROOT / "docs" / "benchmarks.md"))


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: the whole stack composed on CPU (demo/run.py; posargs such as --out DIR, --quick)."""
    for package in _packages():
        _install_package(session, package, "test")
    session.install("rich>=13", "tqdm", "matplotlib")
    session.run("python", str(ROOT / "demo" / "run.py"), *session.posargs, env={"OMP_NUM_THREADS": "1"})
