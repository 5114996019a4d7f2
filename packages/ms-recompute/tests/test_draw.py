"""The timeline drawing takes the runtime's trace (or plain dicts) and writes a PNG atomically."""

from __future__ import annotations

import pytest

from ms_recompute import RecomputeError, pair_layers
from ms_recompute.draw import draw_timeline


def fake_trace(rank: int, paired: bool) -> list[dict]:
    """Steps of a pair's order at 1 ms each (only the drawing is under test here)."""
    (group,) = pair_layers([0, 1], comms=1, overlap=True) if paired else pair_layers([1], comms=1)
    names = {"c": "compute", ">": "issue", "<": "wait"}
    return [
        {
            "rank": rank,
            "layer": s.layer,
            "op": names[s.op.value],
            "index": s.index,
            "start": t * 1e-3,
            "end": (t + 1) * 1e-3,
        }
        for t, s in enumerate(group.order)
    ] + [{"rank": rank, "layer": 0, "op": "recompute", "index": 2, "start": 0.0, "end": 0.008}]


def test_draws_a_png_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "pair.png"
    panels = {"alone": fake_trace(0, False) + fake_trace(1, False), "paired": fake_trace(0, True) + fake_trace(1, True)}
    assert draw_timeline(panels, path, "test") == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["pair.png"]


def test_empty_input_is_refused(tmp_path):
    with pytest.raises(RecomputeError, match="no panels"):
        draw_timeline({}, tmp_path / "x.png")
    with pytest.raises(RecomputeError, match="no compute"):
        draw_timeline(
            {"p": [{"rank": 0, "layer": 0, "op": "recompute", "index": 1, "start": 0, "end": 1}]}, tmp_path / "x.png"
        )
