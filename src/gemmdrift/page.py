"""The report page's form: blocks (heading, text, table, figure) written as markdown or as one HTML file with its
figures inlined, and the page rendered in headless Chromium to check that it displays. What the blocks say
is :mod:`gemmdrift.report`."""

from __future__ import annotations

from pathlib import Path

from . import files
from .errors import GemmdriftError
from .text import cell as _cell
from .text import md_table as _md_table


# A page is a list of blocks, rendered twice: report.md (figures linked) and
# report.html (one self-contained file, figures embedded). Blocks:
#   ("h1" | "h2" | "p", text)   ("ul", [text, ...])   ("pre", text)
#   ("table", [row dict, ...])  ("img", path relative to the results directory, caption)
# Text may use `code`, **bold** and *emphasis*.

Block = tuple


def to_markdown(blocks: list[Block]) -> str:
    out = []
    for b in blocks:
        kind = b[0]
        if kind == "h1":
            out.append(f"# {b[1]}")
        elif kind == "h2":
            out.append(f"## {b[1]}")
        elif kind == "p":
            out.append(b[1])
        elif kind == "ul":
            out.append("\n".join(f"- {x}" for x in b[1]) or "(none)")
        elif kind == "pre":
            out.append(f"```\n{b[1]}\n```")
        elif kind == "table":
            out.append(_md_table(b[1]))
        elif kind == "img":
            out.append(f"![{b[2]}]({b[1]})")
    return "\n\n".join(out) + "\n"


def _inline(text: str) -> str:
    import html
    import re

    t = html.escape(str(text), quote=False)
    t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
    t = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", t)
    return re.sub(r"\*([^*\s][^*]*)\*", r"<em>\1</em>", t)


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em}h2{font-size:1.25em;margin-top:1.8em;border-bottom:1px solid #ddd}
pre{background:#f6f8fa;padding:.8em;overflow-x:auto;font-size:12px}code{background:#f0f0f0;padding:0 .2em}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
td:first-child,th{text-align:left}figure{margin:1em 0}img{max-width:100%;border:1px solid #eee}
figcaption{font-size:12px;color:#555}"""


def to_html(blocks: list[Block], root: Path) -> str:
    """One self-contained page: figures embedded as data URIs."""
    import base64
    import html

    title = next((b[1] for b in blocks if b[0] == "h1"), "gemmdrift report")
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>"]
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "p"):
            out.append(f"<{kind}>{_inline(b[1])}</{kind}>")
        elif kind == "ul":
            out.append("<ul>" + "".join(f"<li>{_inline(x)}</li>" for x in b[1]) + "</ul>")
        elif kind == "pre":
            out.append(f"<pre>{html.escape(b[1], quote=False)}</pre>")
        elif kind == "table":
            rows = b[1]
            if not rows:
                out.append("<p>(none)</p>")
                continue
            cols = list(rows[0])
            out.append("<table><tr>" + "".join(f"<th>{html.escape(str(c))}</th>" for c in cols) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{_inline(_cell(r.get(c)))}</td>"
                                                  for c in cols) + "</tr>" for r in rows) + "</table>")
        elif kind == "img":
            data = base64.b64encode((root / b[1]).read_bytes()).decode("ascii")
            out.append(f'<figure><img alt="{html.escape(b[2])}" src="data:image/png;base64,{data}">'
                       f"<figcaption>{html.escape(b[2])} ({html.escape(b[1])})</figcaption></figure>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# Headless Chromium on a machine with no network: no background connections, no GPU, a throwaway profile.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars")


# Where macOS keeps the browsers (they are app bundles, not on PATH).
MAC_BROWSERS = ("/Applications/Google Chrome.app/Contents/MacOS/Google Chrome",
                "/Applications/Chromium.app/Contents/MacOS/Chromium")


def find_chromium(which=None, home: str | Path | None = None, exists=None) -> str | None:
    """A Chromium-family browser: on PATH (``chromium``, ``chromium-browser``, ``google-chrome``), then the macOS app
    bundles in /Applications and ~/Applications. ``which``/``exists`` are for tests (shutil.which, os.path.isfile)."""
    import os
    import shutil

    which = which or shutil.which
    exists = exists or (lambda p: os.path.isfile(p) and os.access(p, os.X_OK))
    found = next((which(n) for n in ("chromium", "chromium-browser", "google-chrome") if which(n)), None)
    if found:
        return found
    home = Path(home) if home is not None else Path.home()
    bundles = [*MAC_BROWSERS, *(str(home / p.lstrip("/")) for p in MAC_BROWSERS)]
    return next((p for p in bundles if exists(p)), None)


def screenshot(html: str | Path, png: str | Path, width: int = 1200, height: int = 9000) -> Path:
    """Render a report page in headless Chromium (Debian's ``chromium``; Chrome or Chromium on macOS) and save a PNG."""
    import subprocess
    import tempfile

    exe = find_chromium()
    if exe is None:
        raise GemmdriftError("no Chromium found (on Debian: apt-get install chromium; on macOS: install Google Chrome "
                             "or Chromium in /Applications)")
    png = Path(png)
    with tempfile.TemporaryDirectory() as profile, files.atomic_path(png) as tmp:
        r = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={tmp}",
                            f"--window-size={width},{height}", Path(html).resolve().as_uri()],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0 or not Path(tmp).stat().st_size:
            raise GemmdriftError(f"Chromium could not render {html}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return png
