"""The CLI reference, generated at build time from the argparse parser that `workbench` itself uses.

A page holding the marker below gets every command's and subcommand's `--help` text (workbench/cli.py
builds the parser from workbench/commands/arguments.py and bench_arguments.py), a heading per command,
so a new option or subcommand appears without editing the docs.
"""

from __future__ import annotations

import argparse
import os

MARKER = "<!-- generated: cli-reference -->"
WIDTH = "100"
"""Columns argparse wraps the help to (it reads $COLUMNS), the same on every machine."""


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, cli_reference())
    return markdown


def cli_reference() -> str:
    from workbench import cli

    parser = cli._parser
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        return "\n".join(_sections(parser(), level=2))
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


def _sections(parser: argparse.ArgumentParser, level: int) -> list[str]:
    """`parser`'s help in a code block, then each subcommand's under a heading one level down."""
    out = ["```text", parser.format_help().rstrip(), "```", ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += [f"{'#' * level} `{sub.prog}`", ""] + _sections(sub, level + 1)
    return out
