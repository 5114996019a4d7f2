"""ms_layout.files: atomic writes survive kill -9, safe_join refuses escapes, manifests verify."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ms_layout import files
from ms_layout.files import FileError


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    target = tmp_path / "a.json"
    files.atomic_write_json(target, {"v": 1})
    files.atomic_write(target, "new")
    assert target.read_text() == "new"
    assert os.listdir(tmp_path) == ["a.json"]


def test_atomic_path_failure_keeps_old_file(tmp_path):
    target = tmp_path / "a.bin"
    files.atomic_write(target, b"good")
    with pytest.raises(RuntimeError), files.atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer failed")
    assert target.read_bytes() == b"good"
    assert os.listdir(tmp_path) == ["a.bin"]


def test_atomic_dir_refuses_existing_without_overwrite(tmp_path):
    with files.atomic_dir(tmp_path / "ck") as tmp:
        (tmp / "f").write_text("1")
    with pytest.raises(FileError, match="already exists"), files.atomic_dir(tmp_path / "ck"):
        pass
    with files.atomic_dir(tmp_path / "ck", overwrite=True) as tmp:
        (tmp / "f").write_text("2")
    assert (tmp_path / "ck" / "f").read_text() == "2"
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_swap_without_exchange_parks_then_recovers(tmp_path, monkeypatch):
    """Where renameat2 is missing the old folder is parked; a writer dying right after parking it
    leaves the target missing, and the next atomic_dir (or recover_dir) puts it back."""
    monkeypatch.setattr(files, "exchange", lambda a, b: False)
    with files.atomic_dir(tmp_path / "ck") as tmp:
        (tmp / "f").write_text("good")

    def die_after_parking(src, dst):
        real_rename(src, dst)
        if str(dst).endswith("/d"):
            raise KeyboardInterrupt  # stands for a kill between the two renames

    real_rename = os.rename
    monkeypatch.setattr(os, "rename", die_after_parking)
    with pytest.raises(KeyboardInterrupt), files.atomic_dir(tmp_path / "ck", overwrite=True) as tmp:
        (tmp / "f").write_text("new")
    monkeypatch.setattr(os, "rename", real_rename)
    assert not (tmp_path / "ck").exists()
    assert files.recover_dir(tmp_path / "ck")
    assert (tmp_path / "ck" / "f").read_text() == "good"


def test_clean_stale_removes_dead_writers_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / f".ck.tmp-{pid}-abc").mkdir()
    (tmp_path / f".x.json.tmp-{pid}-q").write_text("half")
    (tmp_path / f".ck.tmp-{os.getpid()}-live").mkdir()
    (tmp_path / ".hidden").write_text("not ours")
    removed = files.clean_stale(tmp_path)
    assert sorted(removed) == [f".ck.tmp-{pid}-abc", f".x.json.tmp-{pid}-q"]
    assert sorted(os.listdir(tmp_path)) == [f".ck.tmp-{os.getpid()}-live", ".hidden"]


WRITER = textwrap.dedent(
    """
    import sys, time
    from ms_layout import files
    root, n = sys.argv[1], int(sys.argv[2])
    with files.atomic_dir(root + "/ck", overwrite=True) as tmp:
        for i in range(40):
            (tmp / f"part{i}").write_bytes(bytes([n % 256]) * 50000)
        files.write_manifest(tmp, [f"part{i}" for i in range(40)], {"n": n})
    """
)


def test_kill_minus_9_loop_keeps_a_verified_folder(tmp_path):
    """20 writers killed at random moments: the folder always verifies (old or new content) and the
    next writer's cleanup leaves no temporary folder behind."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root = tmp_path / "out"
    subprocess.run([sys.executable, str(script), str(root), "0"], check=True)
    rng = random.Random(0)
    for n in range(1, 21):
        proc = subprocess.Popen([sys.executable, str(script), str(root), str(n)])
        time.sleep(rng.uniform(0.05, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        files.recover_dir(root / "ck")
        manifest = files.verify_manifest(root / "ck")
        assert 0 <= manifest["n"] <= n
    subprocess.run([sys.executable, str(script), str(root), "99"], check=True)
    assert files.verify_manifest(root / "ck")["n"] == 99
    assert os.listdir(root) == ["ck"]


@pytest.mark.parametrize(
    "name, message",
    [
        ("../outside", "leaves its folder"),
        ("/etc/hostname", "leaves its folder"),
        ("a/../../x", "leaves its folder"),
        ("", "is not a file name"),
        ("a\x00b", "is not a file name"),
        ("link", "outside"),
        ("sub", "not a regular file"),
        ("missing", "does not exist"),
        ("big", "over the limit of 10"),
    ],
)
def test_safe_join_refuses(tmp_path, name, message):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "secret").write_text("x")
    (root / "link").symlink_to(tmp_path / "secret")
    (root / "big").write_bytes(b"x" * 11)
    with pytest.raises(FileError, match=message):
        files.safe_join(root, name, max_bytes=10)


def test_safe_join_accepts_inside_links(tmp_path):
    (tmp_path / "real").write_text("ok")
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert files.safe_join(tmp_path, "alias").read_text() == "ok"


def test_read_capped_stops_on_endless_files():
    with pytest.raises(FileError, match="over the limit of 1000"):
        files.read_capped("/dev/zero", 1000)


def test_manifest_detects_damage(tmp_path):
    (tmp_path / "a").write_bytes(b"12345")
    files.write_manifest(tmp_path, ["a"], {"format": "t"})
    assert files.verify_manifest(tmp_path)["format"] == "t"
    (tmp_path / "a").write_bytes(b"12346")
    with pytest.raises(FileError, match="does not match its sha256"):
        files.verify_manifest(tmp_path)
    (tmp_path / "a").write_bytes(b"1234")
    with pytest.raises(FileError, match="holds 4 bytes, the manifest says 5"):
        files.verify_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"files": {"../x": {"bytes": 1, "sha256": "' + "0" * 64 + '"}}}')
    with pytest.raises(FileError, match="leaves its folder"):
        files.verify_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"files": {"a": {"bytes": "4", "sha256": 1}}}')
    with pytest.raises(FileError, match="bytes = '4' is not a size"):
        files.verify_manifest(tmp_path)
    (tmp_path / "manifest.json").write_bytes(b'{"files": \xff')
    with pytest.raises(FileError, match="not UTF-8"):
        files.verify_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"files": ')
    with pytest.raises(FileError, match="not valid JSON"):
        files.verify_manifest(tmp_path)


@pytest.mark.parametrize("text", ["[" * 100000, "1" * 5000])
def test_read_json_pathological_documents(tmp_path, text):
    (tmp_path / "m.json").write_text(text)
    with pytest.raises(FileError, match="m.json"):
        files.read_json(tmp_path / "m.json")
