"""``gemmdrift bisect``: the first commit of mlx-lm at which a tracking-tier figure changes (issue 55).

Flags -> every check before any build (:func:`gemmdrift.bisect.plan`: the repository, both ends, the range's
direction, the figure) -> one library call (:func:`gemmdrift.bisect.bisect`) -> the answer in words
(:func:`gemmdrift.bisect.text`). Progress goes to stderr; ``--json`` prints the answer as JSON on stdout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import GemmdriftError
from ..files import to_json

REPO_VAR = "GEMMDRIFT_MLX_LM_REPO"


def repo_path(text: str) -> Path:
    """``--repo``: a path, or ``mlx-lm`` for ``$GEMMDRIFT_MLX_LM_REPO`` (else ``<cache>/bisect/mlx-lm.git``)."""
    if text != "mlx-lm":
        return Path(text).expanduser()
    from ..files import cache_dir

    p = Path(os.environ.get(REPO_VAR) or cache_dir() / "bisect" / "mlx-lm.git").expanduser()
    if not p.exists():
        raise GemmdriftError(f"--repo mlx-lm: no clone at {p} (clone ml-explore/mlx-lm there with its tags, set "
                             f"{REPO_VAR}, or give --repo PATH)")
    return p


def cmd_bisect(args) -> int:
    from .. import bisect as B

    repo = repo_path(args.repo)
    B.plan(repo, args.good, args.bad, args.figure)  # every refusal here, before anything is built

    def say(text: str) -> None:
        print(f"gemmdrift bisect: {text}", file=sys.stderr, flush=True)

    b = B.bisect(repo, args.good, args.bad, args.figure, results=Path(args.results) if args.results else None,
                 say=say)
    if args.json:
        o = b.outcome
        out = {"project": b.project, "good": b.range[0].sha, "bad": b.range[-1].sha, "commits": len(b.range),
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
        print(to_json(out))  # a figure not measured (NaN) is null: JSON has no NaN
    else:
        print(B.text(b))
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("bisect", help="the first mlx-lm commit at which a tracking-tier figure changes (each commit "
                                      "installed in its own environment beside this mlx; resumable)")
    s.add_argument("--repo", required=True, help="a git clone of mlx-lm (bare or not), or 'mlx-lm' for "
                                                 f"${REPO_VAR} (default <cache>/bisect/mlx-lm.git)")
    s.add_argument("--good", required=True, metavar="A", help="the older end: a tag or commit")
    s.add_argument("--bad", required=True, metavar="B", help="the newer end: a tag or commit (A must be its ancestor)")
    s.add_argument("--figure", required=True, metavar="NAME",
                   help="a tracking-tier benchmark (e.g. TierState.track_state_bugs, "
                        "TierStateCases.track_non_exact[KVCache/rollback]) or 'any' (every answer figure)")
    s.add_argument("--results", metavar="DIR", help="where each commit's JSON goes (default "
                                                    "<cache>/bisect/results/mlx-lm-on-mlx<version>)")
    s.add_argument("--json", action="store_true", help="print the answer as JSON on stdout (progress goes to stderr)")
    s.set_defaults(func=cmd_bisect)
