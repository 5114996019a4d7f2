"""What every benchmark script shares: the machine and versions, the printed table, the JSON result.

Scripts run as `python benchmarks/bench_<name>.py`, so this folder is on sys.path and they import
it as `from _common import ...`.
"""

from __future__ import annotations

import json
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def package_version(name: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine_info(*packages: str, **extra: object) -> dict:
    """Where a result was measured: cores, the 1-minute load average when the run ends (the box is
    shared, so the load says how much to trust a timing), platform, Python, numpy and the versions
    of `packages`, then `extra` (ranks, threads, a model config: whatever the figures depend on)."""
    info = {
        "nproc": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": package_version("numpy"),
    }
    info.update({name: package_version(name) for name in packages})
    info.update(extra)
    return info


def print_table(rows: list[dict], title: str) -> None:
    """Rows as one table (rich if importable, aligned plain text otherwise); None prints as n/a."""
    cells = [{k: ("n/a" if v is None else str(v)) for k, v in row.items()} for row in rows]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        widths = {c: max(len(c), *(len(r.get(c, "")) for r in cells)) for c in columns}
        print("  ".join(c.rjust(widths[c]) for c in columns))
        for r in cells:
            print("  ".join(r.get(c, "").rjust(widths[c]) for c in columns))
        return
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for r in cells:
        table.add_row(*(r.get(c, "") for c in columns))
    Console().print(table)


def write_result(path: Path, result: dict, indent: int = 2) -> None:
    """Write the result JSON whole or not at all (a temporary name, then a rename)."""
    from ms_layout.files import atomic_write

    atomic_write(path, json.dumps(result, indent=indent) + "\n")
    suffix = f" ({result['wall_s']} s)" if "wall_s" in result else ""
    print(f"wrote {path}{suffix}")
