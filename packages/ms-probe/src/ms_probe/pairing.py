"""How two dumps' items and data entries pair up (pure; used by compare.py).

Items pair by key: (kind, module path after the mapping, direction, call index); an API call is
keyed inside its parent module. Data entries pair by key after the mapping's data renames, then in
order among leftover tensors of the same role, dtype kind and compatible shape.
"""

from __future__ import annotations

import math

from .mapping import NameMapping
from .reader import DataEntry, DumpItem, RankDump


def _target_key(item: DumpItem, mapping: NameMapping) -> tuple:
    p = item.parsed
    if p.kind == "api":
        return ("api", mapping.map_api(f"{p.prefix}.{p.path}"), p.direction, p.index)
    return (p.kind, mapping.map_path(p.path), p.direction, p.index)


def _golden_key(item: DumpItem, mapping: NameMapping) -> tuple:
    p = item.parsed
    if p.kind == "api":
        return ("api", f"{p.prefix}.{p.path}", p.direction, p.index)
    return (p.kind, mapping.golden_key(p.path), p.direction, p.index)


def item_keys(dump: RankDump, mapping: NameMapping, side: str) -> dict[str, tuple]:
    """Alignment key of every item. An API call is keyed inside its parent module: (API name, the
    parent's key, its rank among same-named calls in that parent), so the 3rd matmul of an attention
    module meets the 3rd matmul of its counterpart even when the global call counts differ."""
    key_of = _target_key if side == "target" else _golden_key
    keys: dict[str, tuple] = {}
    seen: dict[tuple, int] = {}
    items = sorted(dump.items.values(), key=lambda i: i.order)
    for item in items:
        if item.parsed.kind != "api":
            keys[item.name] = key_of(item, mapping)
    for item in items:
        if item.parsed.kind == "api":
            _, api, direction, index = key_of(item, mapping)
            parent = keys.get(item.parent) if item.parent else None
            if parent is None:
                keys[item.name] = ("api", api, direction, index, None)
                continue
            n = seen.get((api, parent), 0)
            seen[(api, parent)] = n + 1
            keys[item.name] = ("api", api, direction, n, parent)
    return keys


def dtype_kind(dtype: str) -> str:
    """'f', 'i', 'b' or '?' from either framework's dtype spelling."""
    d = dtype.lower()
    if "bool" in d:
        return "b"
    if "float" in d or "half" in d or "double" in d:
        return "f"
    if "int" in d:
        return "i"
    return "?"


def shapes_compatible(a: tuple[int, ...], b: tuple[int, ...]) -> str | None:
    """None when two shapes hold the same data; else why not. Frameworks often differ only by a
    size-1 axis (HF's head axis in MLA) or by flattened leading dims (tokens as [B*S, H])."""
    if a == b:
        return None
    if [d for d in a if d != 1] == [d for d in b if d != 1]:
        return None
    if a and b and a[-1] == b[-1] and math.prod(a) == math.prod(b):  # Python ints: no overflow
        return None
    return f"shape {list(a)} vs {list(b)}"


def pair_entries(
    t: DumpItem, g: DumpItem, mapping: NameMapping, golden_path: str
) -> list[tuple[DataEntry | None, DataEntry | None, str]]:
    """Pairs of (target entry, golden entry, how): by key first, then by order among compatible tensors."""
    g_by_key = {e.key: e for e in g.entries}
    used: set[str] = set()
    pairs: list[tuple[DataEntry | None, DataEntry | None, str]] = []
    left_t: list[DataEntry] = []
    for e in t.entries:
        key = mapping.map_data_key(golden_path, e.key)
        ge = g_by_key.get(key)
        if ge is not None and key not in used and ge.is_tensor == e.is_tensor:
            used.add(key)
            pairs.append((e, ge, "name"))
        else:
            left_t.append(e)
    left_g = [e for e in g.entries if e.key not in used]
    for e in left_t:
        hit = None
        if e.is_tensor:
            for ge in left_g:
                if (
                    ge.is_tensor
                    and ge.role == e.role
                    and shapes_compatible(ge.shape, e.shape) is None
                    and dtype_kind(ge.dtype) == dtype_kind(e.dtype)
                ):
                    hit = ge
                    break
        if hit is not None:
            left_g.remove(hit)
            pairs.append((e, hit, "order"))
        else:
            pairs.append((e, None, ""))
    pairs.extend((None, ge, "") for ge in left_g)
    return pairs


def api_outputs_disagree(t: DumpItem, g: DumpItem) -> bool:
    """Two implementations rarely issue the same API calls; a pair whose outputs cannot hold the
    same data is a misalignment, not a numerical error."""
    to = [e for e in t.entries if e.role == "output" and e.is_tensor]
    go = [e for e in g.entries if e.role == "output" and e.is_tensor]
    if len(to) != len(go):
        return True
    return any(shapes_compatible(a.shape, b.shape) is not None for a, b in zip(to, go))
