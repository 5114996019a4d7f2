"""Print every benchmark result under a folder as one table per benchmark (rich if available)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def print_results(folder: Path) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text is enough for a log
        Console = Table = None
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        rows = result.get("rows", [])
        if not rows:
            continue
        columns = list(dict.fromkeys(k for row in rows for k in row))
        title = f"{result.get('benchmark', path.stem)}: {result.get('title', '')}".rstrip(": ")
        if Table is None:
            print(title)
            print("  ".join(columns))
            for row in rows:
                print("  ".join(_cell(row.get(c, "")) for c in columns))
            print()
            continue
        table = Table(title=title)
        for column in columns:
            table.add_column(column, justify="right")
        for row in rows:
            table.add_row(*(_cell(row.get(c, "")) for c in columns))
        Console().print(table)


if __name__ == "__main__":
    print_results(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results"))
