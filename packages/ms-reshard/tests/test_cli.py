"""The console script: `plan` text and JSON, layout syntax, errors."""

from __future__ import annotations

import json

import pytest

from ms_layout import Layout, dumps
from ms_reshard import ReshardError
from ms_reshard.cli import main, parse_config
from ms_reshard.layout_text import format_layout, parse_layout


def test_layout_text_round_trip():
    lay = parse_layout("dp=2,sp=2,mp=2:mp,sp+dp@4-11")
    assert lay == Layout((2, 2, 2), ("dp", "sp", "mp"), rank_list=tuple(range(4, 12)))("mp", ("sp", "dp"))
    assert format_layout(lay) == "dp=2,sp=2,mp=2:mp,sp+dp@4-11"
    assert parse_layout("tp=2:").ndim == 0
    assert parse_layout("tp=4:-,tp@0,2,4,6").rank_list == (0, 2, 4, 6)


def test_layout_text_errors_name_the_text():
    with pytest.raises(ReshardError, match="MESH:MAP"):
        parse_layout("dp=2,tp=2")
    with pytest.raises(ReshardError, match="unknown alias 'xx'"):
        parse_layout("dp=2:xx")
    with pytest.raises(ReshardError, match="name=size"):
        parse_layout("dp:dp")


def test_plan_json(capsys):
    assert main(["plan", "--src", "dp=2,tp=2:tp,None", "--dst", "tp=4:None,tp", "--shape", "8,8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bytes_moved"] == sum(r["received"] for r in report["ranks"])
    assert all(r["received"] == r["lower_bound"] for r in report["ranks"])
    assert report["naive_gather_bytes"] >= report["bytes_moved"]
    assert set(report["ops"]) == {"0", "1", "2", "3"}


def test_plan_text_and_layout_file(tmp_path, capsys):
    path = tmp_path / "src.msgpack"
    path.write_bytes(dumps(Layout((4,), ("tp",))("tp", "None")))
    assert main(["plan", "--src", str(path), "--dst", "tp=2:tp,None@4-5", "--shape", "8,4", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "lower bound" in out and "rank 4:" in out and "recv" in out


def test_plan_errors_exit_2(capsys):
    assert main(["plan", "--src", "tp=4:tp", "--dst", "tp=3:tp", "--shape", "8"]) == 2
    assert "not divisible" in capsys.readouterr().err


def test_parse_config():
    assert parse_config("dp=2,tp=2,opt") == __import__("ms_layout").ParallelConfig(dp=2, tp=2, optimizer_shard=True)
    with pytest.raises(ReshardError, match="'zz=1'"):
        parse_config("zz=1")
