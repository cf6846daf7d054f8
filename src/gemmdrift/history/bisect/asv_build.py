"""asv's build step for mlx's own commits (``asv.mlx.conf.json``): the user's build command, as ``gemmdrift bisect``
runs it.

Run by path, with the asv environment's interpreter (``python {conf_dir}/src/gemmdrift/history/bisect/asv_build.py
{build_dir}``), so it needs nothing but the standard library: gemmdrift is not importable there before the
environment is layered. In order:

1. the environment is layered over gemmdrift's own site-packages (``$GEMMDRIFT_BASE_SITE``, a ``.pth`` file: numpy,
   the model package and the rest, the same for every commit), as the command's environments are;
2. the mlx-lm release that runs the tier (``$GEMMDRIFT_MLX_LM``) is installed ``--no-deps``, once;
3. ``$GEMMDRIFT_MLX_BUILD`` runs with bash in the commit's tree, with ``GEMMDRIFT_SRC`` (the tree),
   ``GEMMDRIFT_PYTHON`` (this interpreter) and ``GEMMDRIFT_COMMIT`` set, as ``--build`` does;
4. ``mlx.core``, and the libmlx it loads, must then come from this environment itself, or the commit does not
   build (exit 1): a build that installed nothing is never measured with another mlx underneath.

gemmdrift ships no recipe that builds mlx: the command is the user's. A missing variable is one line and exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

NEEDS = ("GEMMDRIFT_MLX_BUILD", "GEMMDRIFT_MLX_LM", "GEMMDRIFT_BASE_SITE")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    missing = [v for v in NEEDS if not os.environ.get(v)]
    if len(argv) != 1 or missing:
        why = f"set {', '.join(missing)}" if missing else "give the commit's tree ({build_dir})"
        print(f"asv_build: {why} (make asv-mlx sets them: see docs/bisect.md)", file=sys.stderr)
        return 2
    src = Path(argv[0]).resolve()
    site = Path(sysconfig.get_paths()["purelib"])
    (site / "zz_gemmdrift_base.pth").write_text(f"import site; site.addsitedir({os.environ['GEMMDRIFT_BASE_SITE']!r})\n")
    lm = os.environ["GEMMDRIFT_MLX_LM"]
    have = subprocess.run([sys.executable, "-c", "from importlib.metadata import version as v; print(v('mlx-lm'))"],
                          capture_output=True, text=True).stdout.strip()
    if have != lm:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", f"mlx-lm=={lm}"], check=True)
    env = {**os.environ, "GEMMDRIFT_SRC": str(src), "GEMMDRIFT_PYTHON": sys.executable,
           "GEMMDRIFT_COMMIT": os.environ.get("ASV_COMMIT", "")}
    rc = subprocess.run(["bash", "-c", os.environ["GEMMDRIFT_MLX_BUILD"]], cwd=src, env=env).returncode
    if rc != 0:
        print(f"asv_build: the build command exited {rc}", file=sys.stderr)
        return 1
    env.pop("PYTHONPATH", None)
    where = subprocess.run([sys.executable, "-c", WHERE], capture_output=True, text=True, env=env)
    core, _, lib = where.stdout.strip().partition("\n")
    if where.returncode != 0 or not core.startswith(sys.prefix):
        print(f"asv_build: the build command did not install mlx into {sys.prefix} "
              f"(mlx.core: {core or where.stderr.strip()[-200:]})", file=sys.stderr)
        return 1
    if lib and not lib.startswith(sys.prefix):
        print(f"asv_build: the built mlx.core loads {lib}, outside the environment {sys.prefix}", file=sys.stderr)
        return 1
    return 0


# mlx.core's file and the libmlx it loaded, as commits._WHERE reads them (kept here: this file imports no gemmdrift)
WHERE = ("import os, mlx.core as mx; print(mx.__file__); m = '/proc/self/maps'; print(next((l.split()[-1] for l in "
         "open(m) if 'libmlx' in l), '') if os.path.exists(m) else '')")


if __name__ == "__main__":
    sys.exit(main())
