"""The ms-layout console script, as text and as JSON."""

import json

from ms_layout.cli import main


def test_config_text(capsys):
    assert main(["--dp", "2", "--tp", "2", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp groups: [0,1] [2,3] [4,5] [6,7]" in out
    assert "pp groups: [0,4] [1,5] [2,6] [3,7]" in out


def test_config_json(capsys):
    assert main(["config", "--dp", "2", "--tp", "2", "--pp", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 8
    assert report["groups"]["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert report["ranks"][5] == {"rank": 5, "tp": 1, "cp": 0, "dp": 0, "pp": 1, "ep": 0, "edp": 0}


def test_layout_json(capsys):
    assert main(["layout", "--mesh", "dp=2,sp=2,mp=2", "--map", "mp,sp+dp", "--shape", "8,8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    first_row_block = sorted((s["chunk"][1], s["rank"]) for s in report["shards"] if s["chunk"][0] == 0)
    assert [rank for _, rank in first_row_block] == [0, 4, 2, 6]


def test_bad_input_exit_code_and_message(capsys):
    assert main(["--dp", "3", "--ep", "2"]) == 2
    assert "ep=2 must divide dp*cp=3" in capsys.readouterr().err
    assert main(["layout", "--mesh", "dp=2", "--map", "xx", "--shape", "4"]) == 2
    assert "unknown alias 'xx'" in capsys.readouterr().err
