"""What runs inside a commit's interpreter: ``python -m gemmdrift.history.bisect.worker --parts state --out F.json``.

Loads the embedded model as the tier's benchmarks do (benchmarks/common.model: bfloat16), runs each named tier
part whole (:func:`gemmdrift.history.tier.run_part`) and writes ``{part: figures}`` (``{"_not_run": reason}`` for a
part this mlx-lm cannot run: never a figure's name, as the state part's own ``cannot_run`` count is one), with the
mlx-lm and the mlx it imported under ``"_mlx_lm"`` and ``"_mlx"``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NOT_RUN = "_not_run"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gemmdrift.history.bisect.worker")
    ap.add_argument("--parts", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from .. import tier
    from ...files import write_json
    from ...model import load_model

    lm = load_model("embedded", dtype="bfloat16")
    out = {}
    for part in [p for p in args.parts.split(",") if p]:
        r = tier.run_part(lm, part)
        out[part] = dict(r.figures) if hasattr(r, "figures") else {NOT_RUN: r.get("cannot_run", "?")}
    import mlx.core as mx
    import mlx_lm

    out["_mlx_lm"] = {"file": str(Path(mlx_lm.__file__).parent)}
    out["_mlx"] = {"version": mx.__version__, "file": str(Path(mx.__file__).parent)}
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
