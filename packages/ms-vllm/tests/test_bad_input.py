"""Hostile and careless input to `ms-vllm quantize`: one line on stderr, exit code 2, no traceback,
no folder replaced that is not an earlier quantized checkpoint, nothing half-written left behind.

Most cases are refused before MindSpore is imported (they answer in well under a second); the
last ones go through the quantizer itself.
"""

from __future__ import annotations

import json
import shutil

import pytest

from ms_layout.testing import run_script

Q = ["quantize", "--method", "ms_w4a16"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_dirs):
    tmp = tmp_path_factory.mktemp("quant_inputs")
    (tmp / "afile").write_text("x")
    (tmp / "bad.txt").write_bytes(b"\xff\xfe")
    (tmp / "blank.txt").write_text("\n  \n")
    (tmp / "nocfg").mkdir()
    (tmp / "listcfg").mkdir()
    (tmp / "listcfg" / "config.json").write_text("[1, 2]")
    (tmp / "badcfg").mkdir()
    (tmp / "badcfg" / "config.json").write_bytes(b"{\xff")
    (tmp / "noweights").mkdir()
    (tmp / "noweights" / "config.json").write_text("{}")
    (tmp / "notok").mkdir()
    (tmp / "notok" / "config.json").write_text("{}")
    (tmp / "notok" / "model.safetensors").write_bytes(b"")
    (tmp / "other").mkdir()
    (tmp / "other" / "keep.txt").write_text("precious")
    shutil.copytree(tiny_dirs["llama"], tmp / "tiny")
    shutil.copytree(tiny_dirs["llama"], tmp / "trunc")
    weights = tmp / "trunc" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return tmp


CLI_CASES = [
    ([*Q, "{tmp}/missing", "{tmp}/out"], "checkpoint folder '{tmp}/missing' does not exist"),
    ([*Q, "{tmp}/afile", "{tmp}/out"], "checkpoint '{tmp}/afile' is not a folder"),
    ([*Q, "{tmp}/nocfg", "{tmp}/out"], "checkpoint config '{tmp}/nocfg/config.json' does not exist"),
    ([*Q, "{tmp}/listcfg", "{tmp}/out"], "'{tmp}/listcfg/config.json' holds a list, not an object"),
    ([*Q, "{tmp}/badcfg", "{tmp}/out"], "checkpoint config '{tmp}/badcfg/config.json' is not UTF-8 text (byte 1)"),
    ([*Q, "{tmp}/noweights", "{tmp}/out"], "checkpoint folder '{tmp}/noweights' holds no *.safetensors weights"),
    ([*Q, "{tmp}/notok", "{tmp}/out"], "checkpoint folder '{tmp}/notok' has no tokenizer.json"),
    ([*Q, "{tmp}/tiny", "{tmp}/tiny"], "output '{tmp}/tiny' overlaps the source checkpoint '{tmp}/tiny'"),
    ([*Q, "{tmp}/tiny", "{tmp}/tiny/q"], "output '{tmp}/tiny/q' overlaps the source checkpoint"),
    ([*Q, "{tmp}/tiny", "{tmp}/afile"], "output '{tmp}/afile' exists and is not a folder"),
    ([*Q, "{tmp}/tiny", "{tmp}/other"], "output '{tmp}/other' is a non-empty folder that is not a quantized"),
    ([*Q, "{tmp}/tiny", "{tmp}/no/such/out"], "output '{tmp}/no/such/out': folder '{tmp}/no/such' does not exist"),
    ([*Q, "{tmp}/tiny", "{tmp}/out", "--group-size", "0"], "group_size=0; expected a positive int"),
    ([*Q, "{tmp}/tiny", "{tmp}/out", "--group-size=-8"], "group_size=-8; expected a positive int"),
    ([*Q, "{tmp}/tiny", "{tmp}/out", "--group-size", "100000000"], "group_size = 100000000 is over the limit of 65536"),
    ([*Q, "{tmp}/tiny", "{tmp}/out", "--calib", "{tmp}/missing.txt"], "calibration file '{tmp}/missing.txt' does not"),
    ([*Q, "{tmp}/tiny", "{tmp}/out", "--calib", "{tmp}/bad.txt"], "calibration file '{tmp}/bad.txt' is not UTF-8"),
    ([*Q, "{tmp}/tiny", "{tmp}/out", "--calib", "{tmp}/blank.txt"], "calibration file '{tmp}/blank.txt' holds no"),
    ([*Q, "{tmp}/tiny", "{tmp}/out", "--calib", "{tmp}"], "calibration file '{tmp}' is a folder, not a file"),
]


@pytest.mark.parametrize(("argv", "message"), CLI_CASES, ids=[" ".join(a[3:])[:60] for a, _ in CLI_CASES])
def test_cli_bad_input_is_one_line_exit_2(dirs, argv, message):
    run = run_script("ms_vllm.cli", [a.format(tmp=dirs) for a in argv])
    run.assert_one_line_error("ms-vllm", message.format(tmp=dirs))
    assert run.seconds < 20  # answered before MindSpore is loaded
    assert (dirs / "other" / "keep.txt").read_text() == "precious"
    assert not (dirs / "out").exists()


def test_cli_calibration_file_over_the_limit(dirs):
    big = dirs / "big.txt"
    big.write_text("hello world\n" * 200)
    run = run_script(
        "ms_vllm.cli",
        [*Q, str(dirs / "tiny"), str(dirs / "out"), "--calib", str(big)],
        env={"MS_VLLM_MAX_CALIB_BYTES": "1000"},
    )
    run.assert_one_line_error("ms-vllm", f"calibration file '{big}' is over the limit of 1000 bytes")


def test_cli_damaged_weights_and_bad_group_leave_nothing_behind(dirs):
    run = run_script("ms_vllm.cli", [*Q, str(dirs / "trunc"), str(dirs / "out")], timeout=300)
    run.assert_one_line_error("ms-vllm", "model.safetensors")
    run = run_script("ms_vllm.cli", [*Q, str(dirs / "tiny"), str(dirs / "out"), "--group-size", "48"], timeout=300)
    run.assert_one_line_error("ms-vllm", "must be a multiple of group_size=48")
    assert sorted(p.name for p in dirs.iterdir() if p.name.startswith(".")) == []  # no temporary folder left


def test_cli_replaces_an_earlier_quantized_output(dirs):
    out = dirs / "q"
    for group in ("16", "32"):
        run = run_script("ms_vllm.cli", [*Q, str(dirs / "tiny"), str(out), "--group-size", group], timeout=300)
        assert run.rc == 0, run.stderr
        config = json.loads((out / "config.json").read_text())
        assert config["quantization_config"] == {"quant_method": "ms_w4a16", "group_size": int(group)}
    assert sorted(p.name for p in dirs.iterdir() if p.name.startswith(".")) == []
