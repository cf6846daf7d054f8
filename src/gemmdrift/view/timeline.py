"""The changelog's timeline as a figure: one row per release (per pair), a column per measured machine and
backend and per predicted chip, each cell coloured by its class (:mod:`gemmdrift.changelog.timeline`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..changelog.timeline import BISECTED  # a measured cell whose pair was bisected to a commit
from .figure import pyplot as _plt

COLOURS = {"BIT-FOR-BIT": "#4caf50", "ROUNDOFF": "#ffc107", "ANSWER-CHANGING": "#e53935"}
OTHER = "#e0e0e0"  # not measured, not knowable, not replayed
NONE = "#ffffff"  # the first release, an mlx-lm pair's prediction
SHORT = {"BIT-FOR-BIT": "BFB", "ROUNDOFF": "ROUNDOFF", "ANSWER-CHANGING": "ANSWER", "not measured": "·",
         "not knowable": "?", "not replayed": "n/r", "first": "first", "-": ""}


def _wrap(column: str, width: int = 20) -> str:
    """A column's label on lines of about ``width`` characters (a long machine name breaks after a dash), the
    backend or "(predicted)" on a line of its own: two long names side by side do not run into each other."""
    name, _, rest = column.partition(" (")
    lines = []
    while len(name) > width and "-" in name[1:width]:
        cut = name.rindex("-", 1, width) + 1
        lines.append(name[:cut])
        name = name[cut:]
    return "\n".join(lines + [name] + ([f"({rest}"] if rest else []))


def plot_timeline(columns: Sequence[str], rows: Sequence[dict[str, Any]]):
    """The timeline (oldest release at the top), cells coloured by class and labelled in short."""
    plt = _plt()
    from matplotlib.patches import Patch

    n, k = len(rows), len(columns)
    fig, ax = plt.subplots(figsize=(2.2 + 1.05 * k, 1.2 + 0.32 * n))
    for i, row in enumerate(rows):
        for j, c in enumerate(columns):
            cell = row["cells"][c]
            colour = COLOURS.get(cell.get("cls")) or (NONE if cell["cell"] in ("-", "first") else OTHER)
            ax.add_patch(plt.Rectangle((j, i), 1, 1, facecolor=colour, edgecolor="white", linewidth=1.5))
            text = SHORT.get(cell.get("cls") if cell.get("lm") or cell.get("prs") or "whose" in cell else cell["cell"],
                             cell["cell"])
            text += ("*" if cell.get("lm") else "") + (BISECTED if cell.get("bisected") else "")
            if cell.get("whose"):  # split at a bridge: the package(s) whose change moved figures
                text += f" [{cell['whose'].replace('mlx-lm', 'lm')}]"
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=6.5)
    ax.set_xlim(0, k)
    ax.set_ylim(n, 0)
    ax.set_xticks([j + 0.5 for j in range(k)])
    ax.set_xticklabels([_wrap(c) for c in columns], fontsize=7)
    ax.xaxis.tick_top()
    ax.set_yticks([i + 0.5 for i in range(n)])
    ax.set_yticklabels([r["release"] + (f"  (from {r['from']})" if r["from"] else "") for r in rows], fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    handles = [Patch(facecolor=v, label=k_) for k_, v in COLOURS.items()]
    handles += [Patch(facecolor=OTHER, label="not measured (·) / not knowable (?) / not replayed (n/r)")]
    if any(r["cells"][c].get("lm") for r in rows for c in columns):
        handles += [Patch(facecolor=NONE, label="* mlx-lm changed too on that machine: the class may be mlx-lm's")]
    if any(r["cells"][c].get("whose") for r in rows for c in columns):
        handles += [Patch(facecolor=NONE, label="[mlx] / [lm]: whose change moved the figures (split at a bridge, "
                                                "one mlx-lm on both mlx releases)")]
    if any(r["cells"][c].get("bisected") for r in rows for c in columns):
        handles += [Patch(facecolor=NONE, label=f"{BISECTED} bisected to a commit: see the page")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2, fontsize=7, frameon=False)
    ax.set_title("mlx releases, pair by pair: the class of each change", fontsize=9, pad=28)
    return fig


def save_timeline(columns: Sequence[str], rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Draw and write the timeline PNG atomically, without the metadata that names matplotlib's version."""
    from ..files import atomic_path
    from .figure import tight

    plt = _plt()
    fig = plot_timeline(columns, rows)
    tight(fig)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return Path(path)


__all__ = ["plot_timeline", "save_timeline", "COLOURS"]
