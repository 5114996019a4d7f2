"""Automatic alignment of two module trees when no mapping is given.

Both dumps' forward module calls form trees (construct.json gives each call's parent; siblings keep
their call order). Children lists are aligned like sequences (Needleman-Wunsch, no gap cost), where
a pair's value is its own similarity plus the best alignment of its children, so structure decides
ties that names cannot. Similarity of two modules, in [0, 1]:
    0.35 same output shapes + 0.25 same parameter shapes + 0.15 local-name similarity
    + 0.10 class-name similarity + 0.15 similar subtree size.
Pairs below 0.5 are not matched. A single wrapper level (Megatron's `module.module`) is skipped
when that aligns better. Confidence = mean pair similarity x share of modules matched.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from .mapping import NameMapping, Rule, Template
from .reader import RankDump

MIN_SCORE = 0.5


@dataclass
class _Node:
    path: str
    cls: str
    out_shapes: tuple
    param_shapes: tuple
    children: list[_Node] = field(default_factory=list)
    size: int = 1

    @property
    def local(self) -> str:
        return self.path.rsplit(".", 1)[-1]


@dataclass
class AlignedPair:
    """Two module paths judged to be the same module."""

    target: str
    golden: str
    score: float


@dataclass
class Alignment:
    """The result of aligning two module trees."""

    pairs: list[AlignedPair]
    target_only: list[str]
    golden_only: list[str]
    confidence: float

    def to_mapping(self) -> NameMapping:
        """A NameMapping with one exact rule per aligned pair."""
        m = NameMapping(name=f"auto-aligned (confidence {self.confidence:.2f})")
        m.rules = [Rule(Template(p.target), Template(p.golden)) for p in self.pairs]
        return m

    def to_dict(self) -> dict[str, Any]:
        return {
            "confidence": round(self.confidence, 4),
            "pairs": [{"target": p.target, "golden": p.golden, "score": round(p.score, 4)} for p in self.pairs],
            "target_only": self.target_only,
            "golden_only": self.golden_only,
        }


def _tree(dump: RankDump) -> list[_Node]:
    nodes: dict[str, _Node] = {}
    parent_of: dict[str, str | None] = {}
    order: list[str] = []
    item_path = {}
    for item in sorted(dump.items.values(), key=lambda i: i.order):
        p = item.parsed
        if p.kind != "module" or p.direction != "forward":
            continue
        item_path[item.name] = p.path
        if p.path in nodes:
            continue
        outs = tuple(e.shape for e in item.entries if e.role == "output" and e.is_tensor)
        params = tuple(sorted(e.shape for e in item.entries if e.role == "parameter" and e.is_tensor))
        nodes[p.path] = _Node(p.path, p.cls, outs, params)
        parent_of[p.path] = item.parent
        order.append(p.path)
    roots: list[_Node] = []
    for path in order:  # completion order keeps siblings in call order
        parent = item_path.get(parent_of[path] or "")
        (nodes[parent].children if parent in nodes else roots).append(nodes[path])

    def size(n: _Node) -> int:
        n.size = 1 + sum(size(c) for c in n.children)
        return n.size

    for r in roots:
        size(r)
    return roots


def _name_sim(a: str, b: str) -> float:
    if a.isdigit() or b.isdigit():
        return 1.0 if a == b else 0.3
    return difflib.SequenceMatcher(None, a.lower(), b.lower()).ratio()


def similarity(a: _Node, b: _Node) -> float:
    """How alike two modules look by themselves (see the module docstring)."""
    shape = (
        1.0 if a.out_shapes and a.out_shapes == b.out_shapes else (0.5 if a.out_shapes[:1] == b.out_shapes[:1] else 0.0)
    )
    if a.param_shapes or b.param_shapes:
        param = 1.0 if a.param_shapes == b.param_shapes else 0.0
    else:
        param = 0.5
    size = 1.0 - abs(a.size - b.size) / max(a.size, b.size)
    return (
        0.35 * shape + 0.25 * param + 0.15 * _name_sim(a.local, b.local) + 0.1 * _name_sim(a.cls, b.cls) + 0.15 * size
    )


class _Aligner:
    def __init__(self):
        self.memo: dict[tuple[int, int], tuple[float, list[AlignedPair]]] = {}

    def pair(self, a: _Node, b: _Node) -> tuple[float, list[AlignedPair]]:
        key = (id(a), id(b))
        if key not in self.memo:
            s = similarity(a, b)
            if s < MIN_SCORE:
                self.memo[key] = (0.0, [])
            else:
                value, pairs = self.seq(a.children, b.children)
                self.memo[key] = (s + value, [AlignedPair(a.path, b.path, s), *pairs])
        return self.memo[key]

    def seq(self, xs: list[_Node], ys: list[_Node]) -> tuple[float, list[AlignedPair]]:
        n, m = len(xs), len(ys)
        best = [[0.0] * (m + 1) for _ in range(n + 1)]
        for i in range(n - 1, -1, -1):
            for j in range(m - 1, -1, -1):
                v, _ = self.pair(xs[i], ys[j])
                take = v + best[i + 1][j + 1] if v > 0 else -1.0
                best[i][j] = max(take, best[i + 1][j], best[i][j + 1])
        out: list[AlignedPair] = []
        i = j = 0
        while i < n and j < m:
            v, pairs = self.pair(xs[i], ys[j])
            if v > 0 and abs(best[i][j] - (v + best[i + 1][j + 1])) < 1e-12:
                out.extend(pairs)
                i, j = i + 1, j + 1
            elif best[i][j] == best[i + 1][j]:
                i += 1
            else:
                j += 1
        return best[0][0], out


def _all_paths(roots: list[_Node]) -> list[str]:
    out = []
    stack = list(reversed(roots))
    while stack:
        n = stack.pop()
        out.append(n.path)
        stack.extend(reversed(n.children))
    return out


def auto_align(target: RankDump, golden: RankDump) -> Alignment:
    """Align the module trees of two dumps by structure and call order."""
    ta, gb = _tree(target), _tree(golden)
    aligner = _Aligner()
    candidates = [(ta, gb)]
    if len(gb) == 1:
        candidates.append((ta, gb[0].children))  # golden wrapped once more (DDP, Float16Module)
    if len(ta) == 1:
        candidates.append((ta[0].children, gb))
    _, pairs = max((aligner.seq(x, y) for x, y in candidates), key=lambda r: r[0])
    t_paths, g_paths = _all_paths(ta), _all_paths(gb)
    matched_t = {p.target for p in pairs}
    matched_g = {p.golden for p in pairs}
    coverage = len(pairs) / max(len(t_paths), len(g_paths), 1)
    mean = sum(p.score for p in pairs) / len(pairs) if pairs else 0.0
    return Alignment(
        pairs,
        [p for p in t_paths if p not in matched_t],
        [p for p in g_paths if p not in matched_g],
        mean * coverage,
    )
