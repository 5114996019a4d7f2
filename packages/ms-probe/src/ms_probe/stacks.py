"""The user's call stack of a module or API call, in msprobe's stack.json line format.

A dump takes one stack per forward module call (hundreds per step): the frames are walked with
`sys._getframe` (no `traceback.extract_stack`), and each frame's formatted line is kept by
(file, line, function), so a frame seen before costs one dict lookup.
"""

from __future__ import annotations

import linecache
import os
import sys

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
# Frames of the frameworks' hook machinery say nothing about the user's code.
_SKIP_FILES = (
    os.sep + os.path.join("mindspore", "nn", "cell.py"),
    os.sep + os.path.join("torch", "nn", "modules", "module.py"),
    os.sep + os.path.join("torch", "utils", "hooks.py"),
    os.sep + os.path.join("torch", "overrides.py"),
)
MAX_STACK_FRAMES = 40

_lines: dict[tuple[str, int, str], str | None] = {}
"""(file, line, function) -> the frame's stack.json line, None for a framework frame."""
_lines_dirs: tuple[str, ...] = ()
"""The framework folders `_lines` was built with (a framework imported later empties it)."""


def _framework_dirs() -> tuple[str, ...]:
    """Install folders of the loaded frameworks: their internal frames are left out of stacks."""
    dirs = [_PKG_DIR]
    for name in ("mindspore", "torch"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None):
            dirs.append(os.path.dirname(mod.__file__) + os.sep)
    return tuple(dirs)


def call_stack(skip: int = 2) -> tuple[str, ...]:
    """The user's call stack, innermost first, in msprobe's stack.json line format."""
    global _lines_dirs
    skip_dirs = _framework_dirs()
    if skip_dirs != _lines_dirs:
        _lines.clear()
        _lines_dirs = skip_dirs
    frames = []
    f = sys._getframe(skip)
    while f is not None and len(frames) < MAX_STACK_FRAMES:
        code = f.f_code
        key = (code.co_filename, f.f_lineno, code.co_name)
        line = _lines.get(key, False)
        if line is False:
            line = _format(key, skip_dirs)
            _lines[key] = line
        if line is not None:
            frames.append(line)
        f = f.f_back
    return tuple(frames)


def _format(key: tuple[str, int, str], skip_dirs: tuple[str, ...]) -> str | None:
    filename, lineno, name = key
    if filename.startswith(skip_dirs) or filename.endswith(_SKIP_FILES):
        return None
    code = linecache.getline(filename, lineno).strip()
    return f"File {filename}, line {lineno}, in {name}, \n {code}"
