"""Hostile and careless input (issue 16): damaged dumps, names that leave the dump, NaN/Inf,
malformed files on every reader, the console script's exit codes, and kill -9 during a dump.

Exit codes of `ms-probe compare` checked here: 0 done, 1 divergence or NaN/Inf found
(--fail-on-divergence), 2 bad input (one line on stderr), 3 a damaged or unverifiable dump
(--fail-on-divergence; wins over 1)."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from fakenet import MLPNet, dump_fake
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ms_layout.files import verify_manifest
from ms_probe import (
    ProbeError,
    compare_dirs,
    compare_rank,
    config_from_dict,
    load_config,
    load_rank,
    mapping_from_dict,
    render_html,
)
from ms_probe.output import rank_json
from ms_probe.reader import RankDump

TESTS = os.path.dirname(os.path.abspath(__file__))
ITEM_NAMES = [
    "Cell.block.fc1.Dense.forward.0",
    "Cell.block.act.ReLU.forward.0",
    "Cell.block.fc2.Dense.parameters_grad.0",
    "Cell.block.MLP.backward.0",
    "Functional.matmul.0.forward",
    "not-a-name",
]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([TESTS, env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _cli(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ms_probe.cli", *argv], capture_output=True, text=True, env=_env(**env), timeout=120
    )


def _pair(tmp_path: Path, task: str = "statistics", t_net=None, g_net=None) -> tuple[str, str]:
    t = dump_fake(tmp_path / "t", t_net or MLPNet(), task=task)
    g = dump_fake(tmp_path / "g", g_net or MLPNet(), task=task, prefix="Module")
    return t, g


def _rewrite(folder: str, edit) -> None:
    """Edit a dump.json in place (as a careless or hostile user would, leaving the manifest stale)."""
    path = os.path.join(folder, "dump.json")
    doc = json.load(open(path))
    edit(doc["data"])
    open(path, "w").write(json.dumps(doc, indent=1))


# ----------------------------------------------------------------- damaged dumps and exit codes
def test_truncated_target_fails_with_its_own_exit_code(tmp_path):
    # The target holds a real NaN divergence in norm (the 5th item); the truncation cuts it off.
    t, g = _pair(tmp_path)

    def nan_norm(data):
        data["Cell.norm.Norm.forward.0"]["output"][0].update(Max="nan", Min="nan", Mean="nan", Norm="nan", NanCount=64)

    _rewrite(t, nan_norm)
    text = open(os.path.join(t, "dump.json")).read()
    open(os.path.join(t, "dump.json"), "w").write(text[: len(text) // 2])
    out = tmp_path / "out"
    r = _cli("compare", "--target", t, "--golden", g, "--out", str(out), "--json", "--fail-on-divergence")
    assert r.returncode == 3, r.stderr
    summary = json.loads(r.stdout)
    assert [(d["side"], d["step"], d["rank"], d["folder"]) for d in summary["damaged"]] == [("target", 0, 0, t)]
    reasons = summary["damaged"][0]["reasons"]
    assert any(x.startswith("dump.json: ") and "sha256 differs from manifest.json" in x for x in reasons)
    assert "dump.json: read 3 complete items before the damage" in reasons
    assert r.stderr.splitlines() == [f"ms-probe: damaged dump: target step 0 rank 0 ({t}): " + "; ".join(reasons)]
    # Without the flag the compare still reports everything it could read, and exits 0.
    r = _cli("compare", "--target", t, "--golden", g, "--out", str(out))
    assert r.returncode == 0 and f"damaged: target step 0 rank 0 ({t})" in r.stdout
    assert "damaged" in (out / "report.html").read_text()


def test_exit_codes_good_divergence_and_damage(tmp_path):
    t, g = _pair(tmp_path / "a")
    out = str(tmp_path / "out")
    assert _cli("compare", "--target", t, "--golden", g, "--out", out, "--fail-on-divergence").returncode == 0
    bad, g2 = _pair(tmp_path / "b", t_net=MLPNet(scale=1.3))
    assert _cli("compare", "--target", bad, "--golden", g2, "--out", out, "--fail-on-divergence").returncode == 1
    os.remove(os.path.join(bad, "stack.json"))  # damage beats divergence
    r = _cli("compare", "--target", bad, "--golden", g2, "--out", out, "--fail-on-divergence")
    assert r.returncode == 3
    assert r.stderr.splitlines() == [
        f"ms-probe: damaged dump: target step 0 rank 0 ({bad}): stack.json: missing (manifest.json lists it)"
    ]
    help_text = _cli("compare", "--help").stdout
    assert "3 --fail-on-divergence: a dump is damaged or unverifiable (wins over 1)" in " ".join(help_text.split())


def test_unreadable_manifest_makes_the_dump_unverifiable(tmp_path):
    t, g = _pair(tmp_path)
    open(os.path.join(t, "manifest.json"), "wb").write(b"\xff\xfe not json")
    dump = load_rank(t)
    assert dump.damage == ["manifest.json: not UTF-8 text (byte 0); files are not verified"]
    assert compare_dirs(t, g).summary()["damaged"][0]["reasons"] == dump.damage


# ----------------------------------------------------------------- names that leave the dump
@pytest.mark.parametrize(
    "data_name, expected",
    [
        ("../../../../../../../../etc/hostname", "leaves its folder"),
        ("/etc/hostname", "leaves its folder"),
        ("/dev/zero", "leaves its folder"),
        ("link-out.npy", "outside"),
        ("zero-link.npy", "outside"),
        ("sub", "is not a regular file"),
        (7, "data_name 7 is not a file name"),
    ],
)
def test_data_names_outside_the_dump_are_refused(tmp_path, data_name, expected):
    t, g = _pair(tmp_path, "tensor")
    tensors = Path(t) / "dump_tensor_data"
    (tensors / "link-out.npy").symlink_to("/etc/hostname")
    (tensors / "zero-link.npy").symlink_to("/dev/zero")
    (tensors / "sub").mkdir()
    _rewrite(t, lambda d: d["Cell.block.fc1.Dense.forward.0"]["output"][0].update(data_name=data_name))
    rc = compare_dirs(t, g).ranks[0]
    refused = [p for p in rc.problems if "Cell.block.fc1.Dense.forward.0.output.0" in p]
    assert len(refused) == 1 and expected in refused[0], rc.problems
    row = next(r for r in rc.rows if r.target == "Cell.block.fc1.Dense.forward.0.output.0")
    assert row.metrics["_mode"] == "statistics" and "statistics compared" in row.message


def test_dev_zero_and_huge_tensors_stay_in_memory_bounds(tmp_path):
    """`/dev/zero` (refused: not in the folder) and a 64 MiB .npy over MS_PROBE_MAX_TENSOR_BYTES=1 MiB:
    the compare's peak RSS stays under 250 MB (python + numpy alone are ~60 MB)."""
    t, g = _pair(tmp_path, "tensor")
    big = np.zeros(16 << 20, np.float32)
    np.save(Path(t) / "dump_tensor_data" / "big.npy", big)
    np.save(Path(g) / "dump_tensor_data" / "big.npy", big)

    def edit(d):
        d["Cell.block.fc1.Dense.forward.0"]["output"][0]["data_name"] = "/dev/zero"
        d["Cell.block.fc2.Dense.forward.0"]["output"][0]["data_name"] = "big.npy"

    _rewrite(t, edit)
    script = textwrap.dedent(
        f"""
        import resource, sys
        from ms_probe import compare_dirs
        rc = compare_dirs({t!r}, {g!r}).ranks[0]
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
        print(*rc.problems, sep="\\n")
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=_env(MS_PROBE_MAX_TENSOR_BYTES="1048576")
    )
    assert r.returncode == 0, r.stderr
    peak_mb, *problems = r.stdout.splitlines()
    assert int(peak_mb) < 250
    assert any("/dev/zero" in p and "leaves its folder" in p for p in problems)
    assert any("big.npy" in p and "over the limit of 1048576" in p for p in problems)


def test_npy_header_that_lies_about_its_size_is_refused(tmp_path):
    t, g = _pair(tmp_path, "tensor")
    victim = Path(t) / "dump_tensor_data" / "Cell.block.fc1.Dense.forward.0.output.0.npy"
    header = b"{'descr': '<f8', 'fortran_order': False, 'shape': (1000000000000,), }"
    victim.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b"\0" * 64)
    os.remove(os.path.join(t, "manifest.json"))  # the lie itself must be caught, not only the checksum
    rc = compare_dirs(t, g).ranks[0]
    assert any(
        "Cell.block.fc1.Dense.forward.0.output.0.npy: not a usable .npy file (its header says 8000000000000 bytes "
        "of data, it holds 64)" in p
        for p in rc.problems
    ), rc.problems


# ----------------------------------------------------------------- NaN and Inf
@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_nan_on_both_sides_is_an_anomaly(tmp_path, task):
    t, g = _pair(tmp_path, task, MLPNet(scale=np.nan), MLPNet(scale=np.nan))
    run = compare_dirs(t, g)
    s = run.summary()
    assert s["first_divergence"] is None  # the same NaN on both sides is no divergence...
    assert [(a["side"], a["item"], a["key"]) for a in s["anomalies"]] == [  # ...but it is an anomaly
        ("target", "Cell.block.act.ReLU.forward.0", "output.0"),
        ("golden", "Module.block.act.ReLU.forward.0", "output.0"),
    ]
    assert s["anomalies"][0]["what"] == "64 nan"
    html = render_html(run)
    assert "First NaN/Inf" in html and "Cell.block.act.ReLU.forward.0" in html
    out = str(tmp_path / "out")
    r = _cli("compare", "--target", t, "--golden", g, "--out", out)
    assert r.returncode == 0
    assert "  first nan/inf: target Cell.block.act.ReLU.forward.0 output.0 (64 nan)" in r.stdout.splitlines()
    assert _cli("compare", "--target", t, "--golden", g, "--out", out, "--fail-on-divergence").returncode == 1


def test_anomaly_order_is_forward_then_backward_and_tensors_count(tmp_path):
    t, g = _pair(tmp_path, "tensor")
    os.remove(os.path.join(t, "manifest.json"))  # msprobe's own dumps have none: not damage

    def edit(d):
        d["Cell.block.MLP.backward.0"]["output"][0].update(Max="inf", InfCount=1)  # backward: later
        d["Cell.norm.Norm.forward.0"]["output"][0]["Mean"] = "-inf"  # last forward item: first

    _rewrite(t, edit)
    arr_path = Path(g) / "dump_tensor_data" / "Module.block.fc2.Dense.forward.0.output.0.npy"
    arr = np.load(arr_path)
    arr[0, 0] = np.inf  # only the golden .npy has it; its statistics in dump.json do not
    np.save(arr_path, arr)
    os.remove(os.path.join(g, "manifest.json"))
    s = compare_dirs(t, g).summary()
    assert s["damaged"] == []
    assert [(a["side"], a["item"], a["key"], a["what"]) for a in s["anomalies"]] == [
        ("target", "Cell.norm.Norm.forward.0", "output.0", "Mean = -inf"),
        ("golden", "Module.block.fc2.Dense.forward.0", "output.0", "1 inf in the tensor file"),
    ]


# ----------------------------------------------------------------- the console script, table-driven
def _mk(tmp_path: Path, kind: str) -> str:
    """Build the bad input `kind` under tmp_path; returns the path to hand to the CLI."""
    p = tmp_path / kind
    if kind == "file":
        p.write_text("x")
    elif kind == "empty":
        p.mkdir()
    elif kind in ("non_utf8", "json_list", "no_data", "data_list", "dump_json_dir", "deep"):
        p.mkdir()
        content = {
            "non_utf8": b'{"data": {"\xff\xfe": 1}}',
            "json_list": b"[1, 2]",
            "no_data": b'{"task": "statistics"}',
            "data_list": b'{"data": [1]}',
            "deep": b"[" * 100_000,
        }.get(kind)
        if content is None:
            (p / "dump.json").mkdir()
        else:
            (p / "dump.json").write_bytes(content)
    elif kind.startswith("map_"):
        content = {
            "map_non_utf8": b"modules: [\xff]",
            "map_list": b"[1, 2]",
            "map_strip": b"strip: [1]",
            "map_modules": b"modules: 5",
            "map_skip": b"skip: [nope]",
            "map_yaml": b"modules: [unclosed",
            "map_deep": b"[" * 100_000,
        }[kind]
        p.write_bytes(content)
    return str(p)


CLI_CASES = [
    # (name, argv with {t} {g} {out} {bad} placeholders, env, exit code, the text the one line must hold)
    ("missing target", ["compare", "--target", "{tmp}/nope", "--golden", "{g}"], {}, 2, "'{tmp}/nope' does not exist"),
    ("target is a file", ["compare", "--target", "{bad}", "--golden", "{g}"], {"bad": "file"}, 2, "is not a folder"),
    ("not a dump", ["compare", "--target", "{bad}", "--golden", "{g}"], {"bad": "empty"}, 2, "no dump.json under"),
    ("non-UTF-8", ["compare", "--target", "{bad}", "--golden", "{g}"], {"bad": "non_utf8"}, 2, "not UTF-8 text"),
    ("JSON list", ["compare", "--target", "{bad}", "--golden", "{g}"], {"bad": "json_list"}, 2, "is a list"),
    ("no data", ["compare", "--target", "{g}", "--golden", "{bad}"], {"bad": "no_data"}, 2, "has no 'data' object"),
    ("data list", ["compare", "--target", "{bad}", "--golden", "{g}"], {"bad": "data_list"}, 2, "'data' is a list"),
    ("deep", ["compare", "--target", "{bad}", "--golden", "{g}"], {"bad": "deep"}, 2, "nested too deeply"),
    ("dump.json dir", ["compare", "--target", "{bad}", "--golden", "{g}"], {"bad": "dump_json_dir"}, 2,
     "not a regular"),
    ("mapping name", ["compare", "--target", "{t}", "--golden", "{g}", "--mapping", "nope"], {}, 2,
     "'nope' is neither"),
    ("map utf8", ["compare", "--target", "{t}", "--golden", "{g}", "--mapping", "{bad}"], {"bad": "map_non_utf8"}, 2,
     "not UTF-8 text"),
    ("map list", ["compare", "--target", "{t}", "--golden", "{g}", "--mapping", "{bad}"], {"bad": "map_list"}, 2,
     "expected a mapping object, got list"),
    ("map strip", ["compare", "--target", "{t}", "--golden", "{g}", "--mapping", "{bad}"], {"bad": "map_strip"}, 2,
     "strip: expected {target: [...], golden: [...]}, got [1]"),
    ("map modules", ["compare", "--target", "{t}", "--golden", "{g}", "--mapping", "{bad}"], {"bad": "map_modules"}, 2,
     "modules: expected a list, got 5"),
    ("map skip", ["compare", "--target", "{t}", "--golden", "{g}", "--mapping", "{bad}"], {"bad": "map_skip"}, 2,
     "skip[0]: expected {side: ..., path: ..., reason: ...}, got 'nope'"),
    ("map yaml", ["compare", "--target", "{t}", "--golden", "{g}", "--mapping", "{bad}"], {"bad": "map_yaml"}, 2,
     "is not valid YAML"),
    ("map deep", ["compare", "--target", "{t}", "--golden", "{g}", "--mapping", "{bad}"], {"bad": "map_deep"}, 2,
     "nested too deeply"),
    ("map folder", ["compare", "--target", "{t}", "--golden", "{g}", "--mapping", "{tmp}"], {}, 2, "is a folder"),
    ("out is a file", ["compare", "--target", "{t}", "--golden", "{g}", "--out", "{bad}"], {"bad": "file"}, 2,
     "File exists"),
    ("no common step", ["compare", "--target", "{t}", "--golden", "{g}", "--step", "5"], {}, 2,
     "no step/rank in common"),
    ("json limit", ["compare", "--target", "{t}", "--golden", "{g}"], {"MS_PROBE_MAX_JSON_BYTES": "100"}, 2,
     "over the limit of 100 bytes (raise it with MS_PROBE_MAX_JSON_BYTES=N)"),
    ("bad limit", ["compare", "--target", "{t}", "--golden", "{g}"], {"MS_PROBE_MAX_JSON_BYTES": "lots"}, 2,
     "MS_PROBE_MAX_JSON_BYTES='lots' is not an integer"),
    ("align missing", ["align", "--target", "{t}", "--golden", "{tmp}/nope"], {}, 2, "'{tmp}/nope' does not exist"),
    ("align not utf8", ["align", "--target", "{bad}", "--golden", "{g}"], {"bad": "non_utf8"}, 2, "not UTF-8 text"),
]  # fmt: skip


@pytest.fixture(scope="module")
def good_pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("good")
    return _pair(base)


@pytest.mark.parametrize("name, argv, env, code, text", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_one_line(tmp_path, good_pair, name, argv, env, code, text):
    env = dict(env)
    bad = _mk(tmp_path, env.pop("bad")) if "bad" in env else ""
    fill = {"t": good_pair[0], "g": good_pair[1], "bad": bad, "tmp": str(tmp_path)}
    argv = [a.format(**fill) for a in argv]
    if argv[0] == "compare" and "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    r = _cli(*argv, **env)
    assert r.returncode == code, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ms-probe: error: "), r.stderr
    assert text.replace("{tmp}", str(tmp_path)) in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_debug_flag_shows_the_traceback(tmp_path, good_pair):
    r = _cli("compare", "--target", str(tmp_path / "nope"), "--golden", good_pair[1], "--out", str(tmp_path), "--debug")
    assert r.returncode == 1 and "Traceback" in r.stderr and "ProbeError" in r.stderr


# ----------------------------------------------------------------- hypothesis: every reader, any bytes
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=30,
)
_leaf = st.fixed_dictionaries(
    {
        # Well-formed values two times in three, anything else the third.
        "type": st.just("torch.Tensor") | _json,
        "dtype": st.sampled_from(["Float32", "torch.int64"]) | st.just("Float16") | _json,
        "shape": st.sampled_from([[4, 16], [64]]) | st.sampled_from([[2, 2, 16], []]) | _json,
    },
    optional={
        k: _json | st.sampled_from(["nan", "inf", 1.5, -2])
        for k in ("Max", "Min", "Mean", "Norm", "NanCount", "InfCount", "data_name", "md5", "requires_grad", "value")
    },
)
_entry = st.fixed_dictionaries(
    {},
    optional={
        "input_args": st.lists(_leaf | _json, max_size=3) | _json,
        "input_kwargs": st.dictionaries(st.text(max_size=4), _leaf, max_size=2) | _json,
        "output": st.lists(_leaf, max_size=3) | _leaf | _json,
        "parameters": st.dictionaries(st.sampled_from(["weight", "bias"]), _leaf, max_size=2) | _json,
        "input": st.lists(_leaf, max_size=2) | _json,
        "weight": st.lists(_leaf, max_size=1) | _leaf,
    },
)
_doc = st.fixed_dictionaries(
    {"data": st.dictionaries(st.sampled_from(ITEM_NAMES), _entry | _json, max_size=6)},
    optional={"task": _json | st.sampled_from(["tensor", "statistics"]), "level": _json, "framework": _json},
)

_REFERENCE: dict[str, RankDump] = {}
_CASES = itertools.count()


def _check_folder(folder: Path) -> None:
    """The folder must load as a dump (damage reported) or be refused with a ProbeError, and a
    loaded one must compare, serialize and render without any other exception."""
    try:
        dump = load_rank(folder)
    except ProbeError:
        return
    if "g" not in _REFERENCE:
        _REFERENCE["g"] = load_rank(dump_fake(folder.parent / "ref", MLPNet(), task="tensor"))
    for a, b in ((dump, _REFERENCE["g"]), (_REFERENCE["g"], dump), (dump, dump)):
        rc = compare_rank(a, b)
        json.dumps(rank_json(rc), default=str, allow_nan=True)
        assert isinstance(rc.summary()["damaged"], list)


def _write_case(tmp: Path, files: dict[str, bytes]) -> Path:
    folder = tmp / f"case{next(_CASES)}"  # hypothesis seeds `random` alike for every example
    (folder / "dump_tensor_data").mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300))
def test_random_bytes_as_dump_json(tmp_path, raw):
    _check_folder(_write_case(tmp_path, {"dump.json": raw}))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_json | _doc, construct=_json, stack=_json, manifest=_json)
def test_random_json_structures_as_dump_files(tmp_path, doc, construct, stack, manifest):
    files = {"dump.json": json.dumps(doc).encode(), "construct.json": json.dumps(construct).encode()}
    files["stack.json"] = json.dumps(stack).encode()
    files["manifest.json"] = json.dumps(manifest).encode()
    _check_folder(_write_case(tmp_path, files))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_doc, cut=st.floats(0, 1), npy=st.binary(max_size=200))
def test_truncated_json_and_random_npy_files(tmp_path, doc, cut, npy):
    doc["task"] = "tensor"
    for entry in doc["data"].values():
        if isinstance(entry, dict):
            entry["output"] = [{"type": "t", "dtype": "Float32", "shape": [4, 16], "data_name": "x.npy"}]
    text = json.dumps(doc, indent=1).encode()
    folder = _write_case(tmp_path, {"dump.json": text[: int(len(text) * cut)]})
    (folder / "dump_tensor_data" / "x.npy").write_bytes(npy)
    _check_folder(folder)


@settings(max_examples=200, deadline=None)
@given(raw=_json | st.dictionaries(st.sampled_from(["strip", "modules", "skip", "data", "api", "name"]), _json))
def test_random_mapping_structures_give_probe_error_only(raw):
    try:
        mapping = mapping_from_dict(raw)
    except ProbeError:
        return
    mapping.reversed().map_path("a.b.c")


_config_keys = st.sampled_from(["task", "dump_path", "rank", "step", "level", "jit", "statistics", "tensor"])
_task_keys = st.sampled_from(["scope", "list", "data_mode", "summary_mode", "tensor_list"])


@settings(max_examples=200, deadline=None)
@given(raw=_json | st.dictionaries(_config_keys, _json | st.dictionaries(_task_keys, _json)))
def test_random_config_structures_give_probe_error_only(raw):
    try:
        config_from_dict(raw)
    except ProbeError:
        pass


@pytest.mark.parametrize(
    "content, text",
    [
        (b"\xff{}", "is not UTF-8 text (byte 0)"),
        (b"{nope", "is not valid JSON"),
        (b"[" * 100_000, "is nested too deeply"),
        (None, "does not exist"),
    ],
)
def test_bad_config_files(tmp_path, content, text):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ProbeError, match=re.escape(text)) as info:
        load_config(path)
    assert str(path) in str(info.value)


# ----------------------------------------------------------------- kill -9 during a dump
WRITER = """
import sys
import numpy as np
from fakenet import MLPNet, dump_fake
x = np.random.default_rng(int(sys.argv[2])).normal(size=(2048, 8)).astype(np.float32)
print("ready", flush=True)
for _ in range(int(sys.argv[3])):
    dump_fake(sys.argv[1], MLPNet(), task="tensor", x=x)
"""


def _assert_intact(folder: Path) -> None:
    verify_manifest(folder)  # every file the manifest lists, with its size and sha256
    dump = load_rank(folder)
    assert dump.problems == [] and len(dump.items) == 9


def test_kill_9_while_dumping_keeps_the_previous_dump(tmp_path):
    """20 writers that re-dump step 0 rank 0 over a complete dump, each killed with SIGKILL after a
    random delay: the folder always verifies and loads; the next run succeeds and leaves no temp."""
    root = tmp_path / "dump"
    folder = Path(dump_fake(root, MLPNet(), task="tensor"))
    _assert_intact(folder)
    rng = random.Random(16)
    start, landed = time.monotonic(), 0  # kills that left a half-built folder behind
    for i in range(20):
        proc = subprocess.Popen(
            # more repetitions than a writer can finish before its kill (on a fast box 50 took < 0.6 s)
            [sys.executable, "-c", WRITER, str(root), str(i), "1000000"],
            stdout=subprocess.PIPE,
            env=_env(),
        )
        assert proc.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        _assert_intact(folder)
        leftovers = [n for n in os.listdir(folder.parent) if n != "rank0"]
        assert all(n.startswith(".rank0.tmp-") for n in leftovers), leftovers
        landed += bool(leftovers)
    assert time.monotonic() - start < 60
    assert landed >= 1, "no kill landed inside a write"
    r = subprocess.run([sys.executable, "-c", WRITER, str(root), "99", "1"], env=_env(), capture_output=True)
    assert r.returncode == 0, r.stderr
    _assert_intact(folder)
    assert os.listdir(folder.parent) == ["rank0"]


def test_second_start_stop_in_a_step_keeps_the_first_tensors(tmp_path):
    """A second start()/stop() in the same step republishes the folder with the first segment's
    tensors (hard links) and the second's; nothing temporary is left."""
    from fakenet import NumpyAdapter

    from ms_probe.config import DumpConfig
    from ms_probe.recorder import Recorder

    rec = Recorder(DumpConfig(dump_path=str(tmp_path), task="tensor"), NumpyAdapter(), 0)
    x = np.ones((2, 8), np.float32)
    rec.start()
    MLPNet().run(rec, x)
    folder = Path(rec.stop())
    first = sorted(os.listdir(folder / "dump_tensor_data"))
    rec.start()
    MLPNet().run(rec, x)
    assert Path(rec.stop()) == folder
    dump = load_rank(folder)
    assert dump.problems == [] and len(dump.items) == 18
    assert set(first) < set(os.listdir(folder / "dump_tensor_data"))
    assert os.listdir(folder.parent) == ["rank0"]
    verify_manifest(folder)


def test_version_1_manifests_are_still_verified(tmp_path):
    """ms-probe 0.1 wrote {size, crc32} entries; they are still checked."""
    import zlib

    folder = Path(dump_fake(tmp_path, MLPNet()))
    names = ["dump.json", "stack.json", "construct.json"]
    files = {
        n: {"size": (folder / n).stat().st_size, "crc32": f"{zlib.crc32((folder / n).read_bytes()):08x}"} for n in names
    }
    (folder / "manifest.json").write_text(json.dumps({"version": 1, "files": files}))
    assert load_rank(folder).problems == []
    raw = bytearray((folder / "stack.json").read_bytes())
    at = raw.index(b'"') + 1  # a character of the first key: still valid JSON, another CRC
    raw[at] = ord("X") if raw[at] != ord("X") else ord("Y")
    (folder / "stack.json").write_bytes(bytes(raw))
    size = len(raw)
    assert load_rank(folder).damage == [
        f"stack.json: {size} bytes, CRC-32 differs from manifest.json ({size} bytes): corrupt or truncated"
    ]
