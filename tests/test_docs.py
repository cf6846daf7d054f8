"""The documentation cannot drift from the code.

README.md and every page under docs/: each relative link (and its #anchor) resolves, each `gemmdrift ...`
command line written in them parses with today's CLI (parse only: nothing runs), and each flag table equals
what `python -m gemmdrift.cli.doc` generates from the parsers (every command has one, in docs/commands.md).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from gemmdrift.cli import doc as clidoc
from gemmdrift.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LAUNCHER = re.compile(r"^(?:\S*/)?gemmdrift$")  # gemmdrift, .venv/bin/gemmdrift, .venv-cuda13/bin/gemmdrift


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def split_markdown(text: str) -> tuple[list[str], list[list[str]]]:
    """(prose lines with code blocks blanked, the code blocks' lines)."""
    prose, blocks, block = [], [], None
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            if block is None:
                block = []
            else:
                blocks.append(block)
                block = None
            prose.append("")
        elif block is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation dropped, spaces to hyphens."""
    text = SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    out, seen = set(), {}
    for line in prose:
        m = HEADING.match(line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    for line in prose:  # explicit anchors
        out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
    return out


def paragraphs(prose: list[str]) -> list[str]:
    """The prose joined into paragraphs (a link or a code span may wrap across lines)."""
    out, cur = [], []
    for line in prose + [""]:
        if line.strip() and not HEADING.match(line):
            cur.append(line.strip())
        elif cur:
            out.append(" ".join(cur))
            cur = []
    return out


def links(path: Path) -> list[str]:
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    out = []
    for line in paragraphs(prose) + [l for l in prose if HEADING.match(l)]:
        line = SPAN.sub("", line)  # a link written inside code is code
        out += LINK.findall(line)
    return out


def broken_links(path: Path) -> list[str]:
    bad = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...: not checked here
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


def command_lines(path: Path) -> list[str]:
    """Every `gemmdrift ...` command written in the page: code-block lines (with their continuations) and
    code spans that begin with the command."""
    prose, blocks = split_markdown(path.read_text(encoding="utf-8"))
    out = []
    for block in blocks:
        joined, buf = [], ""
        for line in block:
            if line.rstrip().endswith("\\"):
                buf += line.rstrip()[:-1] + " "
                continue
            joined.append(buf + line)
            buf = ""
        if buf:
            joined.append(buf)
        for line in joined:
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            if words and LAUNCHER.match(words[0]):
                out.append(shlex.join(["gemmdrift", *words[1:]]))
    for line in paragraphs(prose):
        for m in SPAN.finditer(line):
            code = m.group(2).strip()
            if code.startswith("gemmdrift ") or code == "gemmdrift":
                out.append(code)
    return out


def parse_error(parser, line: str) -> str | None:
    """argparse's complaint about the command line, or None when it parses.

    A bare command name in prose (`gemmdrift report`, `gemmdrift replay check`: no flags, no arguments) names
    the command, so it only has to exist; anything longer must parse whole, required flags included.
    """
    words = shlex.split(line)[1:]
    if 0 < len(words) <= 2 and not any(w.startswith("-") for w in words) and " ".join(words) in _commands():
        return None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(shlex.split(line)[1:])
    except SystemExit as e:
        return err.getvalue().strip() or f"exit {e.code}"
    return None


def _commands() -> dict:
    if not _COMMANDS:
        _COMMANDS.update(clidoc.commands())
    return _COMMANDS


_COMMANDS: dict = {}


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def test_the_pages_exist():
    assert (ROOT / "docs" / "README.md").exists()
    assert len(DOCS) > 5


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_relative_links_resolve(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_command_lines_parse(path, parser):
    bad = [f"{line!r}: {err}" for line in command_lines(path) if (err := parse_error(parser, line))]
    assert bad == []


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_flag_tables_match_the_parsers(path):
    text = path.read_text(encoding="utf-8")
    assert clidoc.render(text) == text, f"stale flag table: run `python -m gemmdrift.cli.doc {_rel(path)}`"


def test_every_command_has_a_flag_table():
    text = (ROOT / "docs" / "commands.md").read_text(encoding="utf-8")
    missing = [name for name, p in clidoc.commands().items() if name not in clidoc.marked(text)
               and any(not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) for a in p._actions)]
    assert missing == [], ("add `<!-- flags:NAME -->` / `<!-- /flags:NAME -->` to docs/commands.md, then run "
                           "`python -m gemmdrift.cli.doc docs/commands.md`")


def test_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


# ---- the checkers themselves: each must fail on what it is there to catch


def test_the_checkers_catch_what_they_are_for(tmp_path, parser):
    (tmp_path / "b.md").write_text("# Other page\n\n## A `code` heading: yes (really)\n", encoding="utf-8")
    page = tmp_path / "a.md"
    page.write_text(
        "# Title\n\n[ok](b.md) [ok anchor](b.md#a-code-heading-yes-really) [self](#title) [web](https://x.org/y)\n"
        "[gone](c.md) [bad anchor](b.md#nope) `[in code](d.md)`\n\n"
        "```sh\ngemmdrift stack --tokens 40 \\\n    --split 32   # a comment\ngemmdrift stack --tokens many\n"
        "echo gemmdrift kernels\n.venv/bin/gemmdrift nosuchcommand\n```\n\n"
        "Run `gemmdrift diverge --n 4` or `gemmdrift.caches.exact:make_cache`; `gemmdrift triage` judges and\n"
        "`gemmdrift nosuch` does not exist.\n", encoding="utf-8")
    assert broken_links(page) == ["c.md: no such file", "b.md#nope: no heading #nope in b.md"]
    lines = command_lines(page)
    assert lines == ["gemmdrift stack --tokens 40 --split 32", "gemmdrift stack --tokens many",
                     "gemmdrift nosuchcommand", "gemmdrift diverge --n 4", "gemmdrift triage", "gemmdrift nosuch"]
    assert [parse_error(parser, x) is None for x in lines] == [True, False, False, True, True, False]
    assert parse_error(parser, "gemmdrift triage --envelope 0.1") is not None  # flags given: required ones too


def test_a_stale_or_unknown_flag_table_is_seen():
    fresh = clidoc.render("<!-- flags:env -->\n<!-- /flags:env -->\n")
    assert "`--json`" in fresh and "`--device {cpu,gpu}`" in fresh
    assert clidoc.render(fresh) == fresh
    assert clidoc.render(fresh.replace("--json", "--jsn")) == fresh  # a hand edit is regenerated away
    with pytest.raises(ValueError):
        clidoc.render("<!-- flags:nosuch -->\n<!-- /flags:nosuch -->\n")
    assert clidoc.marked(fresh) == ["env"]


def test_slugs_are_githubs():
    assert slug("Two runs compared: golden logits (`gemmdrift logits`, `gemmdrift compare`)") == \
        "two-runs-compared-golden-logits-gemmdrift-logits-gemmdrift-compare"
    assert slug("Ctrl-C: what is kept, and what resumes") == "ctrl-c-what-is-kept-and-what-resumes"
    assert slug("A test bench for cache fixes (`--cache-impl`, `--rollback`)") == \
        "a-test-bench-for-cache-fixes---cache-impl---rollback"


def test_clidoc_regenerates_and_checks_a_file(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text("# Flags\n\n<!-- flags:gate -->\nstale\n<!-- /flags:gate -->\n", encoding="utf-8")
    assert clidoc.main(["--check", str(page)]) == 1  # stale, and left as it was
    assert "stale" in page.read_text(encoding="utf-8")
    assert clidoc.main([str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert "stale" not in text and "| `--threshold THRESHOLD` | `0.1` |" in text
    assert clidoc.main(["--check", str(page)]) == 0
    page.write_text("<!-- flags:nosuch -->\n<!-- /flags:nosuch -->\n", encoding="utf-8")
    assert clidoc.main([str(page)]) == 2
    assert "flags:nosuch: no such command" in capsys.readouterr().err
