"""Every package's headline figures against their anchors, from benchmarks/anchors.toml and the
result JSON files: one row per claim (package, figure, ours, peer or anchor, ratio, verdict, source).

The verdict is computed, never written by hand: a claim with a target passes or misses on the
numbers in the committed results; a claim without one is reported as measured.
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import tomllib

ANCHORS = Path(__file__).with_name("anchors.toml")
_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


class AnchorError(ValueError):
    """A claim in anchors.toml that does not match its result file (a stale row or column name)."""


@dataclass(frozen=True)
class Verdict:
    """One claim, evaluated."""

    package: str
    """The package that makes the claim."""
    figure: str
    """What is measured."""
    ours: str
    """Our figure (a range over rows when the claim spans several)."""
    peer: str
    """The peer measured in the same run, or the anchor's text when there is none."""
    ratio: str
    """ours/peer or peer/ours as the claim names it ("" without a peer)."""
    verdict: str
    """'meets < 1', 'misses < 1', or 'reported' for claims without a target."""
    source: str
    """Where the anchor comes from."""
    why: str = ""
    """Why the figure is what it is, where it misses (from the claim's `why`)."""

    def cells(self) -> list[str]:
        """The table's columns: everything but `why`."""
        return [self.package, self.figure, self.ours, self.peer, self.ratio, self.verdict, self.source]


def _matches(row: dict, where: dict) -> bool:
    for key, want in where.items():
        have = row.get(key)
        if isinstance(want, str) and "*" in want:
            if not (isinstance(have, str) and fnmatchcase(have, want)):
                return False
        elif have != want:
            return False
    return True


def _values(rows: list[dict], spec: dict, name: str) -> list[float]:
    """The column `spec["column"]` of the first matching row, or of every one with every = true."""
    found = [row for row in rows if _matches(row, spec.get("row", {}))]
    if not spec.get("every"):
        found = found[:1]
    values = [row.get(spec["column"]) for row in found]
    values = [v for v in values if isinstance(v, (int, float))]
    if not values:
        raise AnchorError(f"{name}: no row matches {spec.get('row')} with a number in {spec['column']!r}")
    return values


def _fmt(value: float) -> str:
    if value == 0 or 0.01 <= abs(value) < 1000:
        return f"{value:.3g}"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.2e}"


def _span(values: list[float], unit: str = "") -> str:
    lo, hi = min(values), max(values)
    text = _fmt(lo) if lo == hi else f"{_fmt(lo)} .. {_fmt(hi)}"
    return f"{text} {unit}".strip()


def _check(target: str, values: list[float]) -> str:
    op, _, number = target.strip().partition(" ")
    if op not in _OPS:
        raise AnchorError(f"target {target!r}: expected one of {sorted(_OPS)} then a number")
    passed = all(_OPS[op](v, float(number)) for v in values)
    return f"{'meets' if passed else 'misses'} {target}"


def evaluate(claim: dict, results: dict[str, dict]) -> Verdict:
    name = f"{claim['package']}: {claim['figure']}"
    if claim["result"] not in results:  # that benchmark was not run: say so rather than fail the page
        missing = f"no {claim['result']}.json"
        return Verdict(claim["package"], claim["figure"], missing, claim["anchor"], "", "not run", claim["source"])
    rows = results[claim["result"]].get(claim.get("rows", "rows"), [])  # a claim may read e.g. shaped_rows
    unit = claim.get("unit", "")
    ours = _values(rows, claim["ours"], name)
    peer_text, ratio_text, checked = claim["anchor"], "", ours
    if "peer" in claim:
        peer = _values(rows, claim["peer"], name)
        if len(peer) != len(ours):
            raise AnchorError(f"{name}: {len(ours)} rows of ours against {len(peer)} of the peer")
        if claim.get("ratio") not in ("ours/peer", "peer/ours"):
            raise AnchorError(f"{name}: ratio must be 'ours/peer' or 'peer/ours', got {claim.get('ratio')!r}")
        pairs = zip(ours, peer)
        checked = [o / p if claim["ratio"] == "ours/peer" else p / o for o, p in pairs]
        peer_text = f"{_span(peer, unit)}: {claim['anchor']}"
        ratio_text = f"{_span(checked)} ({claim['ratio']})"
    verdict = _check(claim["target"], checked) if "target" in claim else "reported"
    ours_text = _span(ours, unit)
    why = claim.get("why", "")
    return Verdict(claim["package"], claim["figure"], ours_text, peer_text, ratio_text, verdict, claim["source"], why)


def table(results: dict[str, dict], path: Path = ANCHORS) -> list[Verdict]:
    """Every claim of anchors.toml evaluated against `results` (benchmark name -> result dict).

    A claim whose row is missing (a --quick run has fewer rows, or the claim went stale) shows as
    'no row' in the table and is named on stderr, rather than losing the whole page."""
    out = []
    for claim in tomllib.loads(path.read_text())["claim"]:
        try:
            out.append(evaluate(claim, results))
        except AnchorError as exc:
            print(f"anchors.toml: {exc}", file=sys.stderr)
            row = (claim["package"], claim["figure"], "n/a", claim["anchor"], "", "no row", claim["source"])
            out.append(Verdict(*row))
    return out
