"""docs/cli.md, generated from the parser, so that it cannot drift from the flags: every
command with its help, and every flag with its default and one line. Regenerate with

    python -m wavelet.scripts.cli_reference > docs/cli.md

(``tests/test_docs.py`` fails when the file is out of date)."""

from __future__ import annotations

import argparse
import sys

from wavelet.scripts.cli import build_parser


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\\\|")


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.nargs != 0 and action.metavar not in (None, argparse.SUPPRESS):
        names += f" {action.metavar}"
    return names


def _rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        flag = _flag(action) if action.option_strings else f"`{action.dest}` (positional)"
        # argparse prints a help's "%%" as "%"; so does the reference
        rows.append(f"| {flag} | {_cell((action.help or '').replace('%%', '%'))} |")
    return rows


def reference() -> str:
    parser = build_parser()
    lines = [
        "# Command-line reference",
        "",
        "Generated from the parser by `python -m wavelet.scripts.cli_reference > docs/cli.md`;",
        "`tests/test_docs.py` fails when it is out of date. Job flags override a `--config`",
        "file; `--set key=value` reaches any other setting",
        "(`--set optimizer.kwargs.momentum=0.8`). A bad flag or value prints one line and exits",
        "with status 2.",
        "",
        "## wavelet",
        "",
        _cell(parser.description or ""),
        "",
        "| flag | what it does |",
        "|---|---|",
        *_rows(parser),
        "",
    ]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    for name, command in sub.choices.items():
        lines += [
            f"## wavelet {name}",
            "",
            _cell(helps.get(name) or command.description or ""),
            "",
            "| flag | what it does |",
            "|---|---|",
            *_rows(command),
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(reference())
