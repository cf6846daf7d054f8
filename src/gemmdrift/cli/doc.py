"""The documentation's flag tables, generated from the CLI's own argparse parsers.

A markdown file holds a table for a command between two markers::

    <!-- flags:stack -->
    ...the table, regenerated...
    <!-- /flags:stack -->

(a nested command is named with a space: ``<!-- flags:replay check -->``).
``python -m gemmdrift.cli.doc docs/commands.md`` rewrites every table in place;
``--check`` only says which are stale (exit 1), which is what the tests call.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from .. import files
from . import build_parser

MARKER = re.compile(r"(<!-- flags:([a-z][a-z -]*?) -->\n)(.*?)(<!-- /flags:\2 -->)", re.S)


def commands(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    """Every command and nested subcommand of the CLI by name ("stack", "replay check"), in the parser's order."""
    out: dict[str, argparse.ArgumentParser] = {}

    def walk(p, prefix):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out[prefix + name] = sub
                    walk(sub, f"{prefix}{name} ")

    walk(parser or build_parser(), "")
    return out


def _cell(text) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text.replace("<", "&lt;").replace(">", "&gt;")  # replay:<chip> is text, not an HTML tag


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest}`"
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{names}`"
    if action.choices is not None:
        value = "{" + ",".join(str(c) for c in action.choices) + "}"
    else:
        value = action.metavar or action.dest.upper()
    if action.nargs in ("+", "*"):
        value += " ..."
    return f"`{names} {value}`"


def table(parser: argparse.ArgumentParser) -> str:
    """The markdown table of a command's flags: flag, default, what it does (argparse's help text)."""
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        default = action.default
        if action.nargs == 0 or default in (None, "", [], ()) or default is argparse.SUPPRESS:
            shown = "required" if action.required else ""
        else:
            shown = f"`{' '.join(default) if isinstance(default, (list, tuple)) else default}`"
        rows.append(f"| {_flag(action)} | {shown} | {_cell(action.help or '')} |")
    return "\n".join(rows) + "\n"


def render(text: str, parsers: dict[str, argparse.ArgumentParser] | None = None) -> str:
    """``text`` with every marked flag table regenerated; an unknown command name is a ValueError."""
    parsers = commands() if parsers is None else parsers

    def one(m):
        name = m.group(2)
        if name not in parsers:
            raise ValueError(f"flags:{name}: no such command (known: {', '.join(parsers)})")
        return m.group(1) + table(parsers[name]) + m.group(4)

    return MARKER.sub(one, text)


def marked(text: str) -> list[str]:
    """The command names whose flag tables ``text`` marks."""
    return [m.group(2) for m in MARKER.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gemmdrift.cli.doc", description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="markdown files with <!-- flags:NAME --> markers")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table is stale")
    args = ap.parse_args(argv)
    parsers = commands()
    stale = []
    for path in map(Path, args.paths):
        try:
            text = path.read_text(encoding="utf-8")
            new = render(text, parsers)
        except (OSError, ValueError) as e:
            print(f"clidoc: error: {path}: {e}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(path)
            if not args.check:
                files.write_text(path, new)
            print(f"{path}: {'stale' if args.check else 'regenerated'} ({len(marked(text))} tables)", file=sys.stderr)
    return 1 if (args.check and stale) else 0


__all__ = ["commands", "main", "marked", "render", "table"]

if __name__ == "__main__":
    sys.exit(main())
