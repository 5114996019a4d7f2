"""Each package installs alone in a fresh venv and its README's first example runs.

As a new user would: a fresh `uv venv`, only that package (with the extra its README's install
line names for the example) plus the local packages it declares (they are not on PyPI yet, so
they come from packages/ too), then the README's first ```python block saved to a file and run
with that venv's python in an empty folder. The output must contain what the README says it
prints; each expected string is also checked to be in the README, so the two cannot drift apart.

uv makes the venvs cheap from a warm cache (seconds); the constraints file and the local wheel
folder keep torch on its CPU build, as in the noxfile. Examples that train or serve are marked
`slow_readme` (about a minute each on two busy cores; the whole file took 5.6 minutes at a load
average of 20). The mark is not registered in pytest.ini yet, so pytest warns about it once.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"


@dataclass(frozen=True)
class Example:
    """What one README's first example needs and shows."""

    extras: str = ""
    """The extras of the README's install line for the example ("" for the bare package)."""
    expect: tuple[str, ...] = ()
    """Strings the example prints, each also written in the README."""
    timeout: float = 120
    """Seconds the example may run (installing is not counted)."""
    slow: bool = False
    """Trains or serves a model: minutes on a busy box, deselect with -m 'not slow_readme'."""


EXAMPLES = {
    "ms-layout": Example(expect=("(0, (1, 2))",)),
    "ms-models": Example(expect=("(1, 20, 320)", "True")),
    "ms-monitor": Example(expect=('ms_monitor_last_step{rank="0"',)),
    "ms-pipeline": Example(
        expect=(
            "rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7B0 7W0 7F1",
            "1F1B bubble 0.273, ZBV 0.059 (0.000 as the authors count)",
            "peak activations per rank: (4.0, 3.0, 2.0, 1.0) (4.0, 4.0, 4.0, 4.0)",
        )
    ),
    "ms-probe": Example(extras="mindspore,torch", expect=("Cell.act.LeakyBug.forward.0",)),
    "ms-recompute": Example(
        extras="runtime",
        expect=("tape keeps 3.83 MiB without recompute, 1.82 MiB with the plan", "same gradients: True"),
    ),
    "ms-reshard": Example(expect=("moved 256 B, lower bound 256 B",)),
    "ms-rlhf": Example(
        extras="runtime", expect=("[[0, 5], [1, 4], [2, 3]]", "((0, 2, 4, 6), (1, 3, 5, 7))"), timeout=300, slow=True
    ),
    "ms-vllm": Example(expect=("Paged attention keeps", "The quick brown fox"), timeout=300, slow=True),
}


def _pyproject(package: str) -> dict:
    return tomllib.loads((PACKAGES / package / "pyproject.toml").read_text())


def _requirement_names(package: str, extras: str) -> list[str]:
    project = _pyproject(package)["project"]
    requirements = list(project.get("dependencies", []))
    for extra in filter(None, extras.split(",")):
        requirements += project["optional-dependencies"][extra]
    return [re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0] for r in requirements]


def local_deps(package: str, extras: str = "") -> list[str]:
    """The local packages `package[extras]` pulls in, transitively (their base dependencies)."""
    local = {p.parent.name for p in PACKAGES.glob("*/pyproject.toml")}
    out: list[str] = []
    todo = [name for name in _requirement_names(package, extras) if name in local]
    while todo:
        name = todo.pop()
        if name != package and name not in out:
            out.append(name)
            todo += [n for n in _requirement_names(name, "") if n in local]
    return sorted(out)


def first_python_block(readme: str) -> str:
    match = re.search(r"^```python\n(.*?)^```", readme, re.S | re.M)
    assert match, "README has no ```python block"
    return match.group(1)


def _uv_env() -> dict:
    env = dict(os.environ)
    if env.get("PIP_FIND_LINKS") and not env.get("UV_FIND_LINKS"):
        env["UV_FIND_LINKS"] = env["PIP_FIND_LINKS"]  # the CPU torch wheel (uv ignores pip's config)
    env.setdefault("UV_CONSTRAINT", str(ROOT / "constraints.txt"))
    env.pop("VIRTUAL_ENV", None)
    return env


def fresh_venv(package: str, extras: str, where: Path) -> Path:
    """A new venv holding `package[extras]` and its local dependencies; returns its python."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    env = _uv_env()
    venv = where / "venv"
    subprocess.run([uv, "venv", "-q", "-p", "3.11", str(venv)], check=True, env=env)
    python = venv / "bin" / "python"
    pip = [uv, "pip", "install", "-q", "--python", str(python)]
    for name in [*local_deps(package, extras), package]:
        for args in _pyproject(name).get("tool", {}).get("ms-toolkit", {}).get("nox-preinstall", []):
            subprocess.run([*pip, *args], check=True, env=env)  # e.g. vLLM without its CUDA stack
    target = f"{PACKAGES / package}[{extras}]" if extras else str(PACKAGES / package)
    subprocess.run([*pip, *(str(PACKAGES / d) for d in local_deps(package, extras)), target], check=True, env=env)
    return python


def _params():
    for package, example in EXAMPLES.items():
        marks = [pytest.mark.slow_readme] if example.slow else []
        yield pytest.param(package, example, id=package, marks=marks)


def test_every_package_has_an_example():
    assert sorted(EXAMPLES) == sorted(p.parent.name for p in PACKAGES.glob("*/pyproject.toml"))


@pytest.mark.parametrize("package", sorted(EXAMPLES))
def test_readme_links_its_docs_page(package: str):
    readme = (PACKAGES / package / "README.md").read_text()
    assert f"](../../docs/{package}.md)" in readme
    assert (ROOT / "docs" / f"{package}.md").is_file()


@pytest.mark.parametrize(("package", "example"), list(_params()))
def test_readme_first_example(package: str, example: Example, tmp_path: Path):
    readme = (PACKAGES / package / "README.md").read_text()
    install = f'pip install "{package}[{example.extras}]"' if example.extras else f"pip install {package}"
    assert install in readme, f"README does not show the install line the example needs: {install}"
    for text in example.expect:
        assert text in readme, f"expected output {text!r} is not written in the README"

    python = fresh_venv(package, example.extras, tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "first.py").write_text(first_python_block(readme))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env['PATH']}"  # launchers start `python` from PATH
    proc = subprocess.run(
        [str(python), "first.py"], cwd=work, env=env, capture_output=True, text=True, timeout=example.timeout
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for text in example.expect:
        assert text in proc.stdout, f"{text!r} not in the output:\n{proc.stdout[-3000:]}"
