"""`gemmdrift changelog`: the numerics changelog of mlx, one page per release pair (issue 30).

    gemmdrift changelog                                  # every consecutive pair with data, and the index
    gemmdrift changelog --from 0.29.4 --to 0.30.6        # one pair (its page in results/changelog/)
    gemmdrift changelog --results .asv/results benchmarks/reference --out results/changelog

Releases are named as `gemmdrift history` and `gate` name them (``0.31.2``, ``0.32.4+lm0.31.3``; a bare mlx
version names that mlx with the newest mlx-lm it ran with), or an mlx release whose dispatch was read from
the mlx source (its page has predictions only). The shipped pages (``docs/changelog/``) are written by
``make changelog`` from the shipped inputs; a test fails when they differ from what this command writes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

from ..errors import GemmdriftError

PAIR_OUT = "results/changelog"  # one pair's page by default: not among the shipped pages, which the index links
RESULTS_HELP = ("asv results directories (default: this checkout's .asv/results, else the committed "
                "benchmarks/reference)")


def add_parser(sub) -> None:
    s = sub.add_parser("changelog", help="what each mlx release changed in the bits: measured here, which op, "
                                         "predicted per chip (Markdown and HTML pages)")
    s.add_argument("--from", dest="old", metavar="A", help="the older release (with --to; default: every "
                                                             "consecutive pair with data)")
    s.add_argument("--to", dest="new", metavar="B", help="the newer release")
    s.add_argument("--results", nargs="+", metavar="DIR", help=RESULTS_HELP)
    s.add_argument("--ops", nargs="+", metavar="DIR",
                   help="release comparisons of ops (gemmdrift.attribution.release_ops JSON; default benchmarks/release_ops)")
    s.add_argument("--out", default=None, help=f"where the pages go (default: every pair's pages and the index in "
                                               f"docs/changelog of this checkout; one pair's page (--from/--to) in "
                                               f"{PAIR_OUT} of the current directory)")
    s.add_argument("--no-predict", action="store_true", help="leave out the predicted section")
    s.add_argument("--replay", action="store_true",
                   help="replay the decode-vs-verify envelopes missing from the cache (loads the embedded Gemma)")
    s.set_defaults(func=cmd_changelog)


def _rel(path: Path, root: Path | None) -> str:
    """A path as the page names it: relative to the checkout when inside it (pages must not depend on where
    the checkout lies)."""
    p = Path(path).resolve()
    if root is not None:
        try:
            return p.relative_to(root.resolve()).as_posix()
        except ValueError:
            pass
    return str(path)


def cmd_changelog(args) -> int:
    from ..measure.history import default_results, project_root

    if (args.old is None) != (args.new is None):
        raise GemmdriftError("give both --from and --to (or neither, for every consecutive pair)")
    root = project_root()
    why = ""
    if args.results:
        dirs = [Path(d) for d in args.results]
    else:
        d, why = default_results()
        dirs = [Path(d)]
    from ..changelog import OPS_DIR, PAGES

    ops_dirs = [Path(d) for d in args.ops] if args.ops else ([root / OPS_DIR] if root is not None else [])
    for d in ops_dirs:
        if not d.is_dir() and args.ops:
            raise GemmdriftError(f"--ops: no directory {d}")
    if args.out:
        out = Path(args.out)
    elif args.old is not None:  # one pair: beside the other commands' results, not into the shipped pages
        out = Path(PAIR_OUT)
    else:
        out = (root / PAGES) if root is not None else PAGES
    from ..checks import check_out_dir

    check_out_dir(out)  # before any page is computed
    from ..changelog.bisected import BISECT
    from ..measure.history import REFERENCE_RESULTS

    # the bisections: beside each results directory read, and the shipped ones where the results are this checkout's
    bisect_dirs = [d / BISECT for d in dirs]
    if not args.results and root is not None:
        bisect_dirs.append(root / REFERENCE_RESULTS / BISECT)
    written = write_changelog(dirs, out, pair=(args.old, args.new) if args.old else None, ops_dirs=ops_dirs,
                              root=root, predict=not args.no_predict, replay=args.replay, bisect_dirs=bisect_dirs)
    if why:  # which results were read: said once the pages are written (a refusal is its one line alone)
        print(f"gemmdrift changelog: {why}", file=sys.stderr)
    for p in written:
        print(p)
    return 0


def write_changelog(results: Sequence[Path], out: Path, *, pair: tuple[str, str] | None = None,
                    ops_dirs: Sequence[Path] = (), root: Path | None = None, predict: bool = True,
                    replay: bool = False, cache: Path | None = None,
                    bisect_dirs: Sequence[Path] | None = None) -> list[Path]:
    """Write the pages (Markdown and HTML) of one pair, or of every consecutive pair and the index.

    ``bisect_dirs``: where the bisections are (:mod:`gemmdrift.changelog.bisected`; default each results
    directory's ``bisect/``). The bridges (:mod:`gemmdrift.changelog.bridged`) are read from each results
    directory's ``bridges/``. Every input error (unknown release, no common machine, corrupt results, ops or
    bisection files) raises before a page is written. Returns the paths written.
    """
    from .. import changelog as cl
    from ..changelog import pages as view
    from ..changelog.bisected import BISECT, for_pair, read_bisections
    from ..files import write_text
    from ..measure.history import check_one_commit, read_results

    df = read_results([str(d) for d in results])
    check_one_commit(df)
    if pair is not None:
        old, new = cl.resolve(pair[0], df, "--from"), cl.resolve(pair[1], df, "--to")
        if old == new:
            raise GemmdriftError(f"--from and --to name the same release ({old})")
        from ..checks import release_order_key

        if release_order_key(old) > release_order_key(new):
            raise GemmdriftError(f"--from {old} is newer than --to {new}: a page reads from the older release to the "
                                 f"newer (write --from {new} --to {old})")
        have = set(cl.measured_releases(df))
        if not predict and not {old, new} <= have:
            raise GemmdriftError(f"--no-predict: {' and '.join(r for r in (old, new) if r not in have)} has no results "
                                 f"measured here, so the page of {old} → {new} is its prediction only (drop "
                                 "--no-predict)")
        pairs = [(old, new)]
    else:
        pairs = cl.default_pairs(df)
    inputs = ", ".join(f"`{_rel(d, root)}`" for d in results)
    ops_text = [f"`{_rel(d, root)}`" for d in ops_dirs if Path(d).is_dir()]
    if ops_text:
        inputs += " (release comparisons of ops: " + ", ".join(ops_text) + ")"
    dirs = [Path(d) / BISECT for d in results] if bisect_dirs is None else [Path(d) for d in bisect_dirs]
    answers = read_bisections(dict.fromkeys(d.resolve() for d in dirs), shown=lambda p: _rel(p, root))
    from ..changelog import bridged

    # the bridges (one mlx-lm on both mlx releases of a pair): beside each results directory
    bridge_df, bridge_status = bridged.read_bridges([Path(d) / bridged.BRIDGES for d in results])
    pages: list[tuple[str, str, list, str]] = []
    bisected = {}  # each pair's bisections
    classes: list[tuple[Any, dict]] = []  # each pair's Measured and its predicted class per chip
    predictor = None
    chips: tuple[str, ...] = ()
    if predict:
        from ..changelog.predicted import ENVELOPE_CHIPS, Predictor, chip_class

        predictor = Predictor(cache=cache if cache is not None else default_cache(root, out), replay=replay)
        chips = ENVELOPE_CHIPS
    for old, new in pairs:
        m = cl.measured(df, old, new, strict=pair is not None)
        ops = cl.read_ops([d for d in ops_dirs if Path(d).is_dir()], old, new)
        predicted = predictor.blocks(old, new) if predictor is not None else []
        pred = {c: chip_class(predictor, c, old, new) for c in chips} if predictor is not None else {}
        classes.append((m, pred))
        bisected[(old, new)] = b = for_pair(answers, old, new, m.machines)
        bridged.attach(df, bridge_df, bridge_status, m)
        pages.append((old, new, view.page(m, ops, predicted, inputs, pred, b, bridged.blocks(m)),
                      view.summary(m, ops)))
    if predictor is not None:
        predictor.save()
    written = []
    for old, new, blocks, _ in pages:
        stem = out / cl.page_name(old, new)
        written.append(write_text(Path(str(stem) + ".md"), view.markdown(blocks)))
        written.append(write_text(Path(str(stem) + ".html"), view.html(blocks)))
    if pair is None:
        from ..changelog import timeline
        from ..view.timeline import save_timeline

        columns, rows = timeline.rows(cl.known_releases(df), classes, chips, have=cl.releases_by_machine(df),
                                      bisected=bisected)
        written.append(save_timeline(columns, rows, out / TIMELINE))
        idx = timeline.index_blocks(columns, rows, inputs, figure=TIMELINE)
        written.append(write_text(out / "index.md", view.markdown(idx)))
        written.append(write_text(out / "index.html", view.html(idx)))
    return written


TIMELINE = "timeline.png"  # the index's figure, beside the pages


def default_cache(root: Path | None, out: Path) -> Path:
    """The replayed envelopes' cache: the shipped one beside the shipped pages."""
    from ..changelog import PAGES

    return (root / PAGES / "replayed.json") if root is not None else out / "replayed.json"


def gate_pointer(baseline: str, candidate: str) -> str:
    """The line `gemmdrift gate` and `history` print: where the changelog page of the pair is (or how to write
    it)."""
    from ..changelog import PAGES, page_name
    from ..measure.history import project_root

    root = project_root()
    page = PAGES / f"{page_name(baseline, candidate)}.md"
    if root is not None and (root / page).is_file():
        return f"what changed in the bits, op and prediction per chip: {page.as_posix()}"
    return (f"what changed in the bits: `gemmdrift changelog --from {baseline} --to {candidate}` writes the page "
            f"(into {PAIR_OUT}/)")


__all__: list[Any] = ["add_parser", "cmd_changelog", "write_changelog", "gate_pointer"]


def index_pointer() -> str:
    """The line `gemmdrift history` prints: the changelog's index (every pair it judges side by side)."""
    from ..changelog import PAGES

    return f"what each release changed, pair by pair: {(PAGES / 'index.md').as_posix()} (`gemmdrift changelog`)"
