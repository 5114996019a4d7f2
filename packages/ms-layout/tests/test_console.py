"""ms_layout.console and ms_layout.limits: one-line errors with exit code 2, --debug tracebacks."""

from __future__ import annotations

import argparse

import pytest

from ms_layout.console import run_console
from ms_layout.errors import LayoutError
from ms_layout.limits import Limit


def _parser():
    p = argparse.ArgumentParser(prog="tool")
    p.add_argument("what")
    return p


def _body(args):
    if args.what == "ok":
        return None
    if args.what == "layout":
        raise LayoutError("dp = 3 does not divide 4")
    if args.what == "missing":
        open("/nonexistent/file")
    if args.what == "bug":
        raise TypeError("a bug")
    return 5


@pytest.mark.parametrize(
    "what, code, err",
    [
        ("ok", 0, ""),
        ("other", 5, ""),
        ("layout", 2, "tool: error: dp = 3 does not divide 4\n"),
        ("missing", 2, "tool: error: /nonexistent/file: No such file or directory\n"),
    ],
)
def test_run_console_exit_codes(capsys, what, code, err):
    assert run_console("tool", _parser(), _body, [what]) == code
    assert capsys.readouterr().err == err


def test_debug_shows_traceback_and_bugs_keep_theirs():
    with pytest.raises(LayoutError):
        run_console("tool", _parser(), _body, ["layout", "--debug"])
    with pytest.raises(TypeError):
        run_console("tool", _parser(), _body, ["bug"])


def test_limit_names_value_bound_and_variable(monkeypatch):
    lim = Limit("MS_TEST_MAX_RANKS", 8, "ranks")
    assert lim.check(8) == 8
    with pytest.raises(LayoutError, match=r"dp = 9 is over the limit of 8 ranks \(raise it with MS_TEST_MAX_RANKS=N\)"):
        lim.check(9, "dp", LayoutError)
    monkeypatch.setenv("MS_TEST_MAX_RANKS", "16")
    assert lim.check(9) == 9
    monkeypatch.setenv("MS_TEST_MAX_RANKS", "lots")
    with pytest.raises(ValueError, match="MS_TEST_MAX_RANKS='lots' is not an integer"):
        lim.check(1)


def test_debug_is_accepted_after_a_subcommand(capsys):
    parser = argparse.ArgumentParser(prog="tool")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("go")
    with pytest.raises(LayoutError):
        run_console("tool", parser, lambda a: _body(argparse.Namespace(what="layout")), ["go", "--debug"])
    assert run_console("tool", parser, lambda a: _body(argparse.Namespace(what="layout")), ["go"]) == 2


def test_argparse_errors_are_one_line(capsys):
    parser = argparse.ArgumentParser(prog="tool")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("go").add_argument("--n", type=int)
    with pytest.raises(SystemExit) as exc:
        run_console("tool", parser, lambda a: None, ["go", "--n", "two"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == "tool go: error: argument --n: invalid int value: 'two' (tool go -h for help)\n"
