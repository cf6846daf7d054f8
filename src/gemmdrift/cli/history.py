"""`gemmdrift history` and `gemmdrift gate`: the tracked figures of asv's results against the mlx release, and
the exit status of a release whose figures are worse than the one before it's.

Argparse setup and handlers only; the work is in :mod:`gemmdrift.measure.history`. ``cli`` is the
:mod:`gemmdrift.cli` module, handed in (it sits above this one, so it is never imported here).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .. import defaults as D
from . import changelog as changelog_cli

RESULTS_HELP = ("asv results directories, one or more (default: .asv/results if it holds results, else the "
                "committed reference results in benchmarks/reference)")


def _release(label: str) -> str:
    """'0.32.4' -> 'mlx 0.32.4'; '0.32.4+lm0.31.3' -> 'mlx 0.32.4 with mlx-lm 0.31.3'."""
    from ..checks import split_release

    mlx, lm = split_release(label)
    return f"mlx {mlx}" + (f" with mlx-lm {lm}" if lm else "")


def _results_dirs(args) -> tuple[list[str], str]:
    """--results, or this checkout's .asv/results, or the committed reference results, and which it was: the
    caller says that on stderr once its work is done, so a refusal stays its one line alone (issue 53 item 24)."""
    if args.results:
        return args.results, ""
    from ..measure.history import default_results

    d, why = default_results()
    return [str(d)], f"gemmdrift {args.command}: {why}"


def _say(note: str) -> None:
    if note:
        print(note, file=sys.stderr)


def cmd_history(args) -> int:
    from ..checks import check_out_dir

    check_out_dir(args.out)
    from .. import store
    from ..view import summaries
    from ..measure.history import history_result, mixed_commits, read_results

    dirs, note = _results_dirs(args)
    out = Path(args.out)
    df = read_results(dirs)
    for machine, release, commits in mixed_commits(df):
        print(f"gemmdrift history: warning: machine {machine} holds {release} at gemmdrift commits "
              f"{' and '.join(commits)}: the latest of each figure is drawn", file=sys.stderr)
    result = history_result(df, include=args.include,
                            results=[str(d) for d in (dirs if isinstance(dirs, (list, tuple)) else [dirs])])
    store.write_result(result, out)
    _say(note)
    summary = summaries.summary(result)
    summary["figures"] = [str(out / f) for f in summary["figures"]]
    summary["changelog"] = changelog_cli.index_pointer()
    args.cli.emit(args, summary, summaries.text(result)
                  + f"\n\n{len(summary['figures'])} figures in {out / 'figures'}/" + f"\n{summary['changelog']}")
    return 0


def cmd_gate(args) -> int:
    from ..checks import check_gate_versions, check_out_dir, check_threshold

    check_threshold(args.threshold)
    check_gate_versions(args.candidate, args.baseline)  # the same release twice, or the pair reversed
    if args.out:
        check_out_dir(args.out)
    from .. import files
    from ..measure.history import check_one_commit, gate, read_results
    from ..text import text_table

    dirs, note = _results_dirs(args)
    df = read_results(dirs)
    check_one_commit(df)
    g = gate(df, candidate=args.candidate, baseline=args.baseline, threshold=args.threshold, include=args.include)
    _say(note)
    bad = g[g["regression"]]
    if args.out:
        files.write_csv(Path(args.out) / "gate.csv", g)
    cand, base = _release(g["candidate"].iloc[0]), _release(g["baseline"].iloc[0])
    counts = g["verdict"].value_counts()
    tally = ", ".join(f"{int(counts.get(v, 0))} {v}" for v in ("better", "within", "news", "same"))
    verdict = (f"FAIL: {len(bad)} of {len(g)} tracked figures of {cand} are worse than {base} by more than "
               f"{args.threshold:.0%} ({tally})" if len(bad) else
               f"PASS: no tracked figure of {cand} is worse than {base} by more than {args.threshold:.0%} "
               f"({len(g)} compared: {tally})")
    cols = ["machine", "backend", "benchmark", "params", "old", "new", "ratio", "direction"]
    news = g[g["verdict"] == "news"]
    said = ("\nnews (changed, not judged: a change either way, or no direction declared; not a failure):\n"
            + text_table(news[["machine", "backend", "benchmark", "params", "old", "new", "direction"]])
            if len(news) else "")
    page = changelog_cli.gate_pointer(g["baseline"].iloc[0], g["candidate"].iloc[0])
    args.cli.emit(args, {"pass": not len(bad), "compared": int(len(g)), "threshold": args.threshold,
                         "counts": {v: int(counts.get(v, 0)) for v in ("worse", "better", "within", "news", "same")},
                         "regressions": bad.to_dict(orient="records"),
                         "better": g[g["verdict"] == "better"].to_dict(orient="records"),
                         "news": news.to_dict(orient="records"), "changelog": page},
                  (text_table(bad[cols]) + "\n" if len(bad) else "") + verdict + said + "\n" + page)
    return 1 if len(bad) else 0


def add_parser(sub, cli) -> None:
    """Register ``history`` and ``gate`` on the CLI's subparsers."""
    s = sub.add_parser("history", help="tracked figures against the mlx version, from asv's results")
    s.add_argument("--results", nargs="+", metavar="DIR", help=RESULTS_HELP)
    s.add_argument("--include", default="", help="only benchmarks whose name contains this text")
    cli.add_output(s, "results/history")
    s.set_defaults(func=cmd_history, cli=cli)

    s = sub.add_parser("gate", help="exit 1 if a tracked figure of an mlx release is worse than the previous "
                                    "release's (each figure's declared direction: higher or lower is better)")
    s.add_argument("--results", nargs="+", metavar="DIR", help=RESULTS_HELP)
    s.add_argument("--candidate", help="release to judge: an mlx version (with the newest mlx-lm it ran with), or "
                                       "MLX+lmMLXLM, e.g. 0.32.4+lm0.31.3 (default: the newest)")
    s.add_argument("--baseline", help="release to compare with, as --candidate (default: the newest release of the "
                                      "mlx before the candidate's)")
    s.add_argument("--threshold", type=float, default=D.GATE_THRESHOLD,
                   help=f"allowed relative move the wrong way: growth of a lower-is-better figure, a fall of a "
                        f"higher-is-better one (default {D.GATE_THRESHOLD})")
    s.add_argument("--include", default="", help="only benchmarks whose name contains this text")
    s.add_argument("--out", help="also write gate.csv here (every compared figure, its direction and verdict)")
    s.add_argument("--json", action="store_true", help="print a JSON summary on stdout (progress goes to stderr)")
    s.set_defaults(func=cmd_gate, cli=cli)
