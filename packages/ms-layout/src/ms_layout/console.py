"""How every console script of the toolkit ends: one line on stderr and exit code 2 for bad input.

``run_console(prog, parser, body, argv, expected)`` parses `argv` with `parser` (adding
``--debug``), calls ``body(args)`` and turns the `expected` exceptions (the package's own error,
malformed files, unreachable servers) into ``PROG: error: MESSAGE`` on stderr with exit code 2, like
argparse does for a bad flag. ``--debug`` (or ``MS_TOOLKIT_DEBUG=1``) shows the traceback instead.
An exception outside `expected` is a bug of the tool and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from .files import FileError

EXPECTED: tuple[type[BaseException], ...] = (ValueError, OSError, FileError)
"""Errors every script reports as bad input: ValueError (the packages' errors subclass it, as do
JSON and Unicode decoding errors) and OSError (missing files, refused connections, busy ports)."""


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror}"
    text = str(exc) or type(exc).__name__
    return " ".join(text.split()) if "\n" not in text.strip() else text.strip()


def _one_line_errors(parser: argparse.ArgumentParser) -> None:
    """argparse's own errors (a bad flag) as one line too: ``PROG: error: ... (PROG -h for help)``."""

    def error(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {message} ({parser.prog} -h for help)\n")

    parser.error = error  # type: ignore[method-assign]


def _prepare(parser: argparse.ArgumentParser, debug_default: object) -> None:
    """``--debug`` and one-line errors on the parser and on every subcommand (so that ``--debug``
    may come before or after the subcommand)."""
    if not any("--debug" in a.option_strings for a in parser._actions):
        parser.add_argument("--debug", action="store_true", default=debug_default, help="show the traceback of errors")
    _one_line_errors(parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _prepare(sub, argparse.SUPPRESS)


def run_console(
    prog: str,
    parser: argparse.ArgumentParser,
    body: Callable[[argparse.Namespace], int | None],
    argv: Sequence[str] | None = None,
    expected: tuple[type[BaseException], ...] = (),
) -> int:
    """Run a console script's `body`; returns its exit code (0 when it returns None)."""
    _prepare(parser, debug_default=False)
    args = parser.parse_args(None if argv is None else list(argv))
    debug = bool(getattr(args, "debug", False)) or os.environ.get("MS_TOOLKIT_DEBUG") == "1"
    try:
        code = body(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except EXPECTED + tuple(expected) as exc:
        if debug:
            raise
        print(f"{prog}: error: {_message(exc)}", file=sys.stderr)
        return 2
    return 0 if code is None else int(code)
