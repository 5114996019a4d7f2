"""What every package of the toolkit does with files: atomic writes, sha256, manifests, safe reads.

- ``atomic_write(path, data)`` and ``atomic_path(path)`` write a file under a temporary name beside
  it, fsync it and rename it into place: a reader sees the old file or the new one, never half.
- ``atomic_dir(target)`` builds a folder under a temporary name and swaps it into place. Where the
  kernel has ``renameat2(RENAME_EXCHANGE)`` (Linux) the swap of an existing folder is one atomic
  step; elsewhere the old folder is parked as ``.NAME.old-PID-*`` first and ``recover_dir`` puts it
  back if the process died between the two renames. The good copy is never removed before the new
  one is in place.
- Temporary names carry the writer's pid (``.NAME.tmp-PID-*``); ``clean_stale`` removes those whose
  writer is gone, so a ``kill -9`` leaves nothing behind after the next run.
- ``safe_join(root, name)`` turns a name read from a file (a manifest, a dump, a pointer) into a
  path: it refuses absolute names, ``..``, symlinks that leave the root, anything that is not a
  regular file, and files over a size cap. ``read_capped`` reads at most a given number of bytes.
- ``file_entry`` / ``verify_entry`` / ``write_manifest`` / ``verify_manifest``: ``{name: {bytes,
  sha256}}`` manifests, checked before anything they list is used.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .limits import Limit

MAX_FILE_BYTES = Limit("MS_TOOLKIT_MAX_FILE_BYTES", 1 << 40, "bytes one file read from a manifest or dump may hold")
MAX_MANIFEST_BYTES = Limit("MS_TOOLKIT_MAX_MANIFEST_BYTES", 64 << 20, "bytes of one JSON manifest or index")


class FileError(ValueError):
    """A file or a folder that is missing, damaged, out of its root or over a size limit."""


# --------------------------------------------------------------------------------------------- hashes
def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of bytes."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, progress: Any = None, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file read in chunks (updating a tqdm-like ``progress`` by bytes if given)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if progress is not None:
                progress.update(len(block))
    return h.hexdigest()


# --------------------------------------------------------------------------------------- temp names
def _tmp_prefix(target: Path, kind: str) -> str:
    return f".{target.name}.{kind}-{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_pid(name: str) -> int | None:
    """The writer pid in ``.NAME.tmp-PID-XXXX`` (or ``.old-``), or None for a foreign name."""
    for kind in (".tmp-", ".old-"):
        head, sep, tail = name.rpartition(kind)
        if sep and head.startswith("."):
            pid = tail.split("-", 1)[0]
            return int(pid) if pid.isdigit() else None
    return None


def clean_stale(parent: str | os.PathLike, name: str | None = None) -> list[str]:
    """Remove temporary files and folders in `parent` (of `name`, or of any target) whose writing
    process is gone, after restoring a parked old folder whose target is missing. Returns the names
    removed."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    removed = []
    for entry in sorted(os.listdir(parent)):
        pid = _owner_pid(entry)
        if pid is None or _pid_alive(pid):
            continue
        if name is not None and not entry.startswith(f".{name}."):
            continue
        target_name = entry[1:].rsplit(".tmp-" if ".tmp-" in entry else ".old-", 1)[0]
        path = parent / entry
        if ".old-" in entry and not (parent / target_name).exists():
            recover_dir(parent / target_name)
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        removed.append(entry)
    return removed


# ------------------------------------------------------------------------------------- atomic files
def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, mode: int = 0o644) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write (by any library); on success it is fsynced and
    renamed onto `path`, on error removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=_tmp_prefix(path, "tmp"), dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write(path: str | os.PathLike, data: bytes | str, mode: int = 0o644) -> None:
    """Write bytes (or UTF-8 text) to `path` atomically."""
    if isinstance(data, str):
        data = data.encode()
    with atomic_path(path, mode) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_write_json(path: str | os.PathLike, obj: Any, mode: int = 0o644, **dumps: Any) -> None:
    """Write `obj` as JSON to `path` atomically."""
    atomic_write(path, json.dumps(obj, **dumps), mode)


# ----------------------------------------------------------------------------------- atomic folders
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two existing paths in one atomic step; False where the system cannot."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a))


def recover_dir(target: str | os.PathLike) -> bool:
    """Put back the folder parked as ``.NAME.old-*`` if `target` is missing (a writer died between
    parking it and renaming the new one in). True if something was restored."""
    target = Path(target)
    if target.exists() or not target.parent.is_dir():
        return False
    parked = sorted(
        (p for p in target.parent.glob(f".{target.name}.old-*") if (p / "d").is_dir()),
        key=lambda p: p.stat().st_mtime,
    )
    if not parked:
        return False
    os.rename(parked[-1] / "d", target)
    shutil.rmtree(parked[-1], ignore_errors=True)
    return True


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside `target`; on success it takes `target`'s place.

    An existing `target` is an error unless `overwrite`; it is replaced only once the new folder is
    complete, and it is never removed before the new one is in place."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(target)
    clean_stale(target.parent, target.name)
    if target.exists() and not overwrite:
        raise FileError(f"{target} already exists; pass overwrite to replace it")
    tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(target, "tmp"), dir=target.parent))
    try:
        yield tmp
        for root, _, names in os.walk(tmp):
            for name in names:
                with open(os.path.join(root, name), "rb+") as f:
                    os.fsync(f.fileno())
        _swap_in(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_in(tmp: Path, target: Path) -> None:
    if not target.exists():
        os.rename(tmp, target)
        return
    if exchange(tmp, target):  # target is now the new folder, tmp the old one
        shutil.rmtree(tmp, ignore_errors=True)
        return
    parked = Path(tempfile.mkdtemp(prefix=_tmp_prefix(target, "old"), dir=target.parent))
    os.rename(target, parked / "d")
    os.rename(tmp, target)
    shutil.rmtree(parked, ignore_errors=True)


# -------------------------------------------------------------------------------------- safe reads
def safe_join(
    root: str | os.PathLike,
    name: str,
    *,
    max_bytes: int | None = None,
    what: str = "file",
    must_exist: bool = True,
) -> Path:
    """``root / name`` for a `name` read from untrusted input, refusing absolute names, ``..``,
    symlinks out of `root`, non-regular files and files over `max_bytes` (default
    MS_TOOLKIT_MAX_FILE_BYTES)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise FileError(f"{what} name {name!r} is not a file name")
    pure = Path(name)
    if pure.is_absolute() or name.startswith(("/", "\\")) or ".." in pure.parts or ".." in name.split("\\"):
        raise FileError(f"{what} name {name!r} leaves its folder {os.fspath(root)!r}; only relative names inside it")
    root_real = Path(os.path.realpath(root))
    path = Path(root) / pure
    real = Path(os.path.realpath(path))
    if real != root_real and root_real not in real.parents:
        raise FileError(f"{what} {name!r} resolves to {os.fspath(real)!r}, outside {os.fspath(root_real)!r}")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        if must_exist:
            raise FileError(f"{what} {os.fspath(path)!r} does not exist") from None
        return path
    if not stat.S_ISREG(st.st_mode):
        raise FileError(f"{what} {os.fspath(path)!r} is not a regular file")
    cap = MAX_FILE_BYTES.value if max_bytes is None else max_bytes
    if st.st_size > cap:
        raise FileError(f"{what} {os.fspath(path)!r} holds {st.st_size} bytes, over the limit of {cap}")
    return path


def read_capped(path: str | os.PathLike, max_bytes: int, what: str = "file") -> bytes:
    """Read a whole file, refusing one over `max_bytes` (also when its size is not known up front)."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise FileError(f"{what} {os.fspath(path)!r} does not exist") from None
    except IsADirectoryError:
        raise FileError(f"{what} {os.fspath(path)!r} is a folder, not a file") from None
    if len(data) > max_bytes:
        raise FileError(f"{what} {os.fspath(path)!r} is over the limit of {max_bytes} bytes")
    return data


def read_json(path: str | os.PathLike, what: str = "JSON file", max_bytes: int | None = None) -> Any:
    """Parse a JSON file (at most `max_bytes`, default MS_TOOLKIT_MAX_MANIFEST_BYTES), with a
    FileError naming the file for anything unreadable."""
    cap = MAX_MANIFEST_BYTES.value if max_bytes is None else max_bytes
    data = read_capped(path, cap, what)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise FileError(f"{what} {os.fspath(path)!r} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise FileError(f"{what} {os.fspath(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except RecursionError:  # 100k nested brackets
        raise FileError(f"{what} {os.fspath(path)!r} is nested too deeply") from None
    except ValueError as exc:  # a 5000-digit integer
        raise FileError(f"{what} {os.fspath(path)!r} is not readable JSON: {str(exc)[:120]}") from None


# --------------------------------------------------------------------------------------- manifests
def file_entry(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest entry of a file: its size and sha256."""
    return {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}


def verify_entry(root: str | os.PathLike, name: str, entry: Any, progress: Any = None) -> Path:
    """Check one ``{bytes, sha256}`` entry against the file `name` under `root`; returns its path."""
    if not isinstance(entry, Mapping):
        raise FileError(f"manifest entry of {name!r} is {type(entry).__name__}, expected an object")
    size, digest = entry.get("bytes"), entry.get("sha256")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise FileError(f"manifest entry of {name!r}: bytes = {size!r} is not a size")
    if not isinstance(digest, str) or len(digest) != 64:
        raise FileError(f"manifest entry of {name!r}: sha256 = {digest!r} is not a hex digest")
    path = safe_join(root, name, what="manifest file")
    actual = os.path.getsize(path)
    if actual != size:
        raise FileError(f"{os.fspath(path)!r} holds {actual} bytes, the manifest says {size}")
    if sha256_file(path, progress) != digest:
        raise FileError(f"{os.fspath(path)!r} does not match its sha256 in the manifest")
    return path


def write_manifest(
    root: str | os.PathLike, names: Iterable[str], extra: Mapping[str, Any] | None = None, name: str = "manifest.json"
) -> dict[str, Any]:
    """Write ``{**extra, "files": {name: entry}}`` as `name` under `root` (atomically); returns it."""
    manifest = dict(extra or {})
    manifest["files"] = {n: file_entry(Path(root) / n) for n in sorted(names)}
    atomic_write_json(Path(root) / name, manifest, indent=1, sort_keys=True)
    return manifest


def verify_manifest(root: str | os.PathLike, name: str = "manifest.json", progress: Any = None) -> dict[str, Any]:
    """Read the manifest `name` under `root` and verify every file it lists; returns the manifest."""
    manifest = read_json(safe_join(root, name, what="manifest"), "manifest")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise FileError(f"manifest {os.fspath(Path(root) / name)!r} has no 'files' object")
    for file_name, entry in manifest["files"].items():
        verify_entry(root, file_name, entry, progress)
    return manifest
