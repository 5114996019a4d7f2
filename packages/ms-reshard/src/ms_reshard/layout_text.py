"""A compact text form of a layout for the command line: ``MESH:MAP[@RANKS]``.

* MESH: mesh axes, slowest first, ``dp=2,tp=2``;
* MAP: one entry per tensor dim, ``tp,None``; ``sp+dp`` splits a dim over several axes (first
  most significant), ``None`` or ``-`` leaves it whole; an empty MAP is a 0-d tensor;
* RANKS: optional global ranks of the mesh positions, ``0-3`` or ``4,6,8-9`` (default 0..N-1).

``dp=2,tp=2:tp,None@4-7`` is a column-parallel weight on ranks 4..7. A path to a file written by
``ms_layout.dumps(layout)`` is accepted wherever a layout is expected.
"""

from __future__ import annotations

import math
import os

from ms_layout import NONE, Layout, LayoutError, loads
from ms_layout.files import FileError, read_capped

from .errors import ReshardError
from .limits import MAX_RANKS, MAX_SPEC_FILE_BYTES, check_count, check_layout


def _rank(text: str, whole: str) -> int:
    text = text.strip()
    if not text.isascii() or not text.isdigit():
        raise ReshardError(f"rank list {whole!r} must be ints and ranges like 0-3,8")
    return check_count(int(text), MAX_RANKS, f"rank {text} in {whole!r}")


def parse_ranks(text: str) -> tuple[int, ...]:
    """``0-3,8`` -> (0, 1, 2, 3, 8); at most MS_RESHARD_MAX_RANKS ranks, each below it."""
    out: list[int] = []
    for item in text.split(","):
        a, sep, b = item.partition("-")
        lo = _rank(a, text)
        hi = _rank(b, text) if sep else lo
        check_count(len(out) + max(hi - lo + 1, 0), MAX_RANKS, f"ranks in {text!r}")
        out += range(lo, hi + 1)
    return tuple(out)


def format_ranks(ranks) -> str:
    """Inverse of parse_ranks, with runs folded into ranges."""
    parts, run = [], []
    for r in ranks:
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def parse_layout(text: str) -> Layout:
    """A Layout from ``MESH:MAP[@RANKS]`` or from a msgpack file; errors name the text."""
    if os.path.isfile(text):
        try:
            layout = loads(read_capped(text, MAX_SPEC_FILE_BYTES.value, "layout file"), expect="Layout")
        except (LayoutError, FileError) as exc:
            raise ReshardError(f"{text}: {exc}") from None
        if layout.dims is None:
            raise ReshardError(f"{text}: the layout has no tensor map")
        return check_layout(layout, f"layout {text!r}")
    body, _, ranks = text.partition("@")
    mesh, sep, tensor_map = body.partition(":")
    if not sep:
        raise ReshardError(f"layout {text!r} must look like MESH:MAP[@RANKS], e.g. dp=2,tp=2:tp,None@0-3")
    names, sizes = [], []
    for item in mesh.split(","):
        name, _, size = item.partition("=")
        if not size.strip().isascii() or not size.strip().isdigit():
            raise ReshardError(f"mesh entry {item!r} in {text!r} must look like name=size")
        names.append(name.strip())
        sizes.append(int(size))
    check_count(math.prod(sizes), MAX_RANKS, f"ranks of layout {text!r}")
    specs = [] if not tensor_map.strip() else [d.strip() for d in tensor_map.split(",")]
    dims = [NONE if d in ("", "-", NONE) else tuple(d.split("+")) for d in specs]
    try:
        rank_list = parse_ranks(ranks) if ranks else None
        return check_layout(Layout(tuple(sizes), tuple(names), rank_list=rank_list)(*dims), f"layout {text!r}")
    except LayoutError as exc:
        raise ReshardError(f"layout {text!r}: {exc}") from None


def format_layout(layout: Layout) -> str:
    """The text form of a layout (ranks shown only when they are not 0..N-1)."""
    mesh = ",".join(f"{n}={s}" for n, s in zip(layout.alias_names, layout.device_matrix))
    dims = ",".join("+".join(d) if d else NONE for d in layout.dims)
    ranks = "" if layout.rank_list is None else "@" + format_ranks(layout.rank_list)
    return f"{mesh}:{dims}{ranks}"
