"""``gemmdrift bisect``: the first commit of mlx-lm or mlx at which a tracking-tier figure changes (issue 55).

Flags -> every check before any build (:func:`gemmdrift.history.bisect.plan`: the repository, both ends, the range's
direction, the figure, and for mlx the build command and the mlx-lm release) -> one library call (:func:`gemmdrift.history.bisect.bisect`) -> the answer in words
(:func:`gemmdrift.history.bisect.text`), with both ends against the shipped release results
(:func:`gemmdrift.history.bisect.shipped.check_ends`). Progress goes to stderr; ``--json`` prints the answer as JSON on stdout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import GemmdriftError
from ..files import to_json

REPO_VAR = "GEMMDRIFT_MLX_LM_REPO"
REPO_VARS = {"mlx-lm": REPO_VAR, "mlx": "GEMMDRIFT_MLX_REPO"}


def repo_path(text: str) -> Path:
    """``--repo``: a path, or ``mlx-lm`` / ``mlx`` for ``$GEMMDRIFT_MLX_LM_REPO`` / ``$GEMMDRIFT_MLX_REPO`` (else
    ``<cache>/bisect/mlx-lm.git`` / ``mlx.git``)."""
    if text not in REPO_VARS:
        return Path(text).expanduser()
    from ..files import cache_dir

    var = REPO_VARS[text]
    p = Path(os.environ.get(var) or cache_dir() / "bisect" / f"{text}.git").expanduser()
    if not p.exists():
        raise GemmdriftError(f"--repo {text}: no clone at {p} (clone ml-explore/{text} there with its tags, set "
                             f"{var}, or give --repo PATH)")
    return p


def cmd_bisect(args) -> int:
    from ..history import bisect as B

    repo = repo_path(args.repo)
    how = dict(build=args.build, mlx_lm=args.mlx_lm)
    B.plan(repo, args.good, args.bad, args.figure, **how)  # every refusal here, before anything is built

    def say(text: str) -> None:
        print(f"gemmdrift bisect: {text}", file=sys.stderr, flush=True)

    b = B.bisect(repo, args.good, args.bad, args.figure, results=Path(args.results) if args.results else None,
                 say=say, **how)
    from ..history.bisect import shipped

    ends = shipped.check_ends(b)
    if args.json:
        o = b.outcome
        out = {"project": b.project, **({"mlx_lm": b.build.mlx_lm} if b.build else {}), "good": b.range[0].sha, "bad": b.range[-1].sha, "commits": len(b.range),
               "figures": list(b.figures), "changed": o.changed, "results": str(b.results),
               "measured": [b.range[i].sha for i in o.measured],
               "skipped": [sha for sha, r in b.records.items() if r.get("skipped")]}
        if o.changed:
            first, before = b.range[o.first], b.range[o.before]
            out.update(first={"commit": first.sha, "subject": first.subject, "pr": first.pr,
                              "link": B.link(b.project, first), "values": b.value(o.first)},
                       before={"commit": before.sha, "subject": before.subject, "values": b.value(o.before)},
                       candidates=[b.range[i].sha for i in o.skipped] + [first.sha])
        else:
            out["values"] = b.value(0)
        out["ends_vs_shipped"] = {end: {"commit": sha, **got} for end, sha, got in ends}
        print(to_json(out))  # a figure not measured (NaN) is null: JSON has no NaN
    else:
        print(B.text(b))
        for end, sha, got in ends:
            print(shipped.describe(end, sha, got))
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("bisect", help="the first mlx-lm or mlx commit at which a tracking-tier figure changes (each "
                                      "commit in its own environment: mlx-lm beside this mlx, mlx built by --build; "
                                      "resumable)")
    s.add_argument("--repo", required=True, help="a git clone of mlx-lm or mlx (bare or not), or 'mlx-lm' / 'mlx' "
                                                 f"for ${REPO_VAR} / ${REPO_VARS['mlx']} (default "
                                                 "<cache>/bisect/mlx-lm.git / mlx.git)")
    s.add_argument("--good", required=True, metavar="A", help="the older end: a tag or commit")
    s.add_argument("--bad", required=True, metavar="B", help="the newer end: a tag or commit (A must be its ancestor)")
    s.add_argument("--figure", required=True, metavar="NAME",
                   help="a tracking-tier benchmark (e.g. TierState.track_state_bugs, "
                        "TierStateCases.track_non_exact[KVCache/rollback]) or 'any' (every answer figure)")
    s.add_argument("--build", metavar="CMD", help="mlx only: a command (run by bash in the commit's tree) that builds "
                                                 "$GEMMDRIFT_SRC and installs it into $GEMMDRIFT_PYTHON's environment; "
                                                 "a commit whose build fails is skipped")
    s.add_argument("--mlx-lm", metavar="VERSION", help="mlx only: the mlx-lm release that runs the tier on every "
                                                      "commit (default: the one asv.conf.json pairs with --good)")
    s.add_argument("--results", metavar="DIR", help="where each commit's JSON goes (default "
                                                    "<cache>/bisect/results/mlx-lm-on-mlx<version>, or "
                                                    "mlx-with-lm<version>)")
    s.add_argument("--json", action="store_true", help="print the answer as JSON on stdout (progress goes to stderr)")
    s.set_defaults(func=cmd_bisect)
