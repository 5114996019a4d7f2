"""PNG timelines and Chrome traces."""

from __future__ import annotations

import json

import pytest

import ms_pipeline as mp
from ms_pipeline.draw import chrome_trace, draw_png, read_chrome_trace, write_chrome_trace

pytest.importorskip("matplotlib")


@pytest.mark.parametrize(
    "schedule", [mp.one_f_one_b(4, 8), mp.zero_bubble_v(4, 8), mp.zero_bubble_v(2, 6, overlap=True)]
)
def test_png_is_written(schedule, tmp_path):
    path = draw_png(schedule, tmp_path / "t.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert [p.name for p in tmp_path.iterdir()] == ["t.png"]


def test_chrome_trace_matches_the_timeline(tmp_path):
    result = mp.simulate(mp.zero_bubble_v(2, 4))
    trace = chrome_trace(result.timeline, name="zbv")
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(result.timeline) == 2 * 2 * 3 * 4  # ranks x chunks x (F, B, W) x m
    first = min(slices, key=lambda e: (e["ts"], e["tid"]))
    assert first["name"] == "0F0" and first["tid"] == 0 and first["cat"] == "F"
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1"}
    path = write_chrome_trace(tmp_path / "trace.json", result.timeline)
    json.loads(path.read_text())  # valid JSON for Perfetto
    back = read_chrome_trace(path)
    assert [(e.rank, str(e.action)) for e in back] == [(e.rank, str(e.action)) for e in result.timeline]
    assert mp.Bubbles.of(back, 2).bubble_rate == pytest.approx(result.bubble_rate)


def test_drawing_is_public_from_the_package(tmp_path):
    """Other packages draw schedules through ms_pipeline's public names, not its modules."""
    path = mp.draw_png(mp.zero_bubble_v(2, 3), tmp_path / "zbv.png", title="ZBV")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert mp.chrome_trace is chrome_trace and mp.write_chrome_trace is write_chrome_trace
    assert mp.read_chrome_trace is read_chrome_trace and "draw_png" in mp.__all__
