"""The house has one-way flow between its wings, and within each wing between its modules: no import cycle.

A wing is a folder of src/gemmdrift (``model/``, ``replay/``, ``view/``, ...) or a module standing alone at the
top (``errors``, ``store``, ``suite``, ...). WINGS ranks the wings: a module may import another wing only if that
wing ranks strictly lower. RANKS ranks the modules inside a wing the same way. A new module adds one line to
RANKS (a new wing one line to WINGS); an import that points upwards fails here.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "gemmdrift"

# Lower rank = lower in the house.
WINGS = {
    # the shared ground, standing alone at the top: no gemmdrift imports but errors
    "errors": 0, "defaults": 0, "text": 0, "metrics": 0, "files": 1, "schedules": 1, "checks": 1,
    "directions": 1,  # which way is better for every tracked figure (the gate, the changelog, upgrade)
    "matrix": 2,  # the mlx <-> mlx-lm pairing, read from asv.conf.json (upgrade, history/, the tests)
    "ranges": 2,  # list and range arguments ('1-17,24', 'A:B') and the default split of a stream
    "prompts": 2, "result": 2,
    "machine": 3,  # machine/: backend wheels, platform facts, memory, the environment record, runenv
    "dispatch": 3,  # dispatch/: which kernel MLX runs per chip, T and version, read from the mlx source
    "model": 4,  # model/: model sources, GGUF, layer and op taps, projections, drafts
    "caches": 4,  # caches/: the exact cache, other designs, plug-in loading
    "checkpoint": 5, "workers": 5,
    "exact_cache": 5, "cache_designs": 5, "serve_launch": 5,  # the documented plug-in and -m paths, kept working
    "measure": 6,  # measure/: stack, diverge, batch, server, golden logits, history
    "kernels": 7,  # kernels/: GEMV vs GEMM per projection and path
    "state": 7,  # state/: cache exactness, and the bench for someone else's cache
    "replay": 8,  # replay/: the recipes, the compiled engine, the whole model replayed, check, predict
    "fingerprint": 9,  # fingerprint/: accumulation-order trees recovered black-box
    "attribution": 10,  # attribution/: which op (op taps' local drift, counterfactuals, releases, the gate)
    "release_ops": 11,
    "changelog": 11,  # changelog/: the numerics changelog of mlx
    "upgrade": 11.5,  # upgrade/: should I upgrade mlx? two releases' interpreters, the class of the change
    "view": 12,  # view/: summaries, printed text, figures and report sections per kind
    "legacy": 13, "store": 14, "page": 14.5, "report": 15, "interrupts": 15, "suite": 16,
    # history/: what the history measures (the tracking tier), over what (the releases and bridges of
    # asv.conf.json; the commits of mlx-lm and mlx, bisected), and how it stores it (asv's results directories)
    "history": 16.5,
    "history_run": 16.6,  # python -m gemmdrift.history_run, kept working
    "cli": 17,  # cli/: the command line and its parsers per command
    "clidoc": 18, "__main__": 18, "": 19,  # "" is the package itself (gemmdrift/__init__.py)
}

# Inside a wing (a wing's own name is its __init__.py).
RANKS = {
    "machine": 0, "machine.compat": 0, "machine.platforminfo": 0, "machine.backends": 0, "machine.memory": 1, "machine.interpreter": 1, "machine.envinfo": 1,
    "machine.runenv": 2,
    "dispatch.base": 1, "dispatch.commits": 1.2, "dispatch.tags": 1.5, "dispatch.archname": 1.5, "dispatch.chips": 2, "dispatch.metal": 2, "dispatch.cuda": 2, "dispatch.cpu": 3, "dispatch": 4,
    "model.gguf_read": 0, "model.draft_self": 0, "model.native": 0, "model.gguf_gemma": 1, "model.description": 1,
    "model": 2,
    "model.taps": 3, "model.projections": 4, "model.optaps": 4,
    "caches": 0, "caches.exact": 0, "caches.designs": 0, "caches.plugins": 1, "caches.serve_launch": 2,
    "measure": 0, "measure.twostats": 1, "measure.speculative": 1, "measure.triage": 1.5, "measure.stack": 2,
    "measure.diverge": 2, "measure.golden": 2, "measure.history": 2, "measure.batchgen": 2, "measure.serving": 2.5,
    "measure.batch": 3, "measure.server": 3,
    "kernels.paths": 6, "kernels.table": 7, "kernels.ops": 8, "kernels.runs": 9, "kernels": 10,
    "state.reading": 4.1, "state.common": 4.2, "state.rollback": 4.3, "state.trim": 4.3,
    "state.saveload": 4.3, "state.server_reuse": 4.3, "state.batch": 4.3, "state.sweep": 4.4, "state": 5,
    "state.bench": 6,  # the test bench for cache fixes (point state, diverge, stack, server at a plug-in)
    "replay.core": 1, "replay.jitcore": 1.5, "replay.dense": 2, "replay.jitcache": 2, "replay.jit": 2.5,
    "replay.quant": 3, "replay.fpquant": 3.5, "replay.jitquant": 4, "replay": 5, "replay.paths": 6, "replay.calib": 6.5, "replay.model": 7,
    "replay.orderrows": 9, "replay.check": 10, "replay.predict": 11,
    "fingerprint.probes": 10.1, "fingerprint.recovery": 10.2, "fingerprint.describe": 10.3, "fingerprint": 11,
    "attribution": 0, "attribution.primitives_operands": 4.5, "attribution.release_ops": 5,
    "attribution.primitives_ops": 7.5, "attribution.verdict": 7.8, "attribution.hold": 7.8, "attribution.attribute": 8,
    "attribution.primitives": 8.6,
    "changelog.classify": 5, "changelog": 6, "changelog.bisected": 6.5, "changelog.pages": 7, "changelog.bridged": 7.5, "changelog.timeline": 8, "changelog.predicted": 12,
    "history": 0, "history.asvfiles": 0, "history.tier": 0, "history.releases": 1,
    "history.bisect.search": 2, "history.bisect.gitrepo": 2, "history.bisect.asv_build": 2, "history.bisect.figures": 3,
    "history.bisect.commits": 3, "history.bisect.worker": 3, "history.bisect.asv_json": 3.5,
    "history.bisect.shipped": 3.5, "history.bisect": 4,
    "upgrade.envs": 0, "upgrade.worker": 0, "upgrade.judge": 1, "upgrade.measure": 2, "upgrade": 3,
    "view": 0, "view.figure": 1, "view.compare": 11, "view.predict": 11.5, "view.attribute": 11.6, "view.primitives": 11.7,
    "view.history": 11.8, "view.timeline": 11.8, "view.upgrade": 11.8, "view.fingerprint": 11.8, "view.state": 11.8,
    "view.batch": 11.8, "view.summaries": 12, "view.plots": 12, "view.answer": 12.5,
    "cli.common": 0, "cli.golden": 1, "cli.dispatch": 1, "cli.replay": 1, "cli.primitives": 1, "cli.changelog": 1,
    "cli.history": 1.5, "cli.upgrade": 1, "cli.bisect": 1, "cli.batch": 1, "cli.attribute": 2, "cli": 3, "cli.doc": 4,
}


def wing(name: str) -> str:
    return name.partition(".")[0]


def rank(name: str) -> tuple[float, float]:
    """(wing rank, rank inside the wing); a module standing alone is its wing."""
    return WINGS[wing(name)], RANKS.get(name, 0) if name != wing(name) or name in RANKS else 0


def _modules():
    for p in sorted(SRC.rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), p


def _imports(name: str, path: Path) -> set[str]:
    """gemmdrift modules imported anywhere in the file (top level and inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = [p for p in package.split(".") if p]
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "gemmdrift":
                target = node.module.partition(".")[2]
            else:
                continue
            if node.module is None:  # from . import x, y
                out |= {f"{target}.{a.name}".lstrip(".") for a in node.names}
            else:
                out.add(target)
        elif isinstance(node, ast.Import):
            out |= {a.name.partition(".")[2] for a in node.names if a.name.split(".")[0] == "gemmdrift"}
    return out


def test_every_module_has_a_place():
    names = [n for n, _ in _modules()]
    unknown = [n for n in names if wing(n) not in WINGS or ("." in n and n not in RANKS)
               or ("." not in n and n and (SRC / n).is_dir() and n not in RANKS)]
    assert not unknown, f"modules without a place in the house: {unknown} (add them to WINGS/RANKS in {__file__})"


def _resolve(dep: str) -> str:
    """A ``from X import name`` target: the module itself, or the module that holds ``name``."""
    if dep in RANKS or dep in WINGS:
        return dep
    head = dep.rpartition(".")[0]
    return head if head in RANKS or head in WINGS else dep


def test_no_module_imports_one_above_it():
    bad = []
    for name, path in _modules():
        for dep in sorted(_imports(name, path)):
            dep = _resolve(dep)
            if dep == name:
                continue
            if wing(dep) != wing(name):
                ok = WINGS.get(wing(dep), 10**6) < WINGS.get(wing(name), -1)
            else:
                ok = RANKS.get(dep, -1) < RANKS.get(name, 10**6)
            if not ok:
                bad.append(f"{name or 'gemmdrift'} (rank {rank(name)}) imports {dep} "
                           f"(rank {rank(dep) if wing(dep) in WINGS else None})")
    assert not bad, "imports that point upwards (or sideways):\n" + "\n".join(bad)


def test_every_wing_is_a_folder_with_a_docstring():
    for d in sorted(p for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        assert d.name in WINGS, f"{d.name}/ is not a wing of the house"
        assert ast.get_docstring(ast.parse((d / "__init__.py").read_text(encoding="utf-8"))), d.name


MAX_LINES = 600  # docs/layout.md: no module over 600 lines


def too_long(root: Path = SRC, limit: int = MAX_LINES) -> list[str]:
    """Every module under ``root`` longer than ``limit`` lines, with its length."""
    out = []
    for p in sorted(root.rglob("*.py")):
        n = len(p.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out.append(f"{p.relative_to(root)}: {n} lines")
    return out


def test_no_module_is_over_600_lines(tmp_path):
    assert not too_long(), f"modules over {MAX_LINES} lines (split them along a seam):\n" + "\n".join(too_long())
    # the check sees a planted long module, and lets one of exactly the limit through
    (tmp_path / "wing").mkdir()
    (tmp_path / "wing" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "edge.py").write_text("x = 1\n" * MAX_LINES)
    assert too_long(tmp_path) == [f"{Path('wing', 'long.py')}: {MAX_LINES + 1} lines"]


def test_the_layering_check_sees_a_planted_cycle(tmp_path):
    planted = tmp_path / "stack.py"
    planted.write_text("def f():\n    from ..report import build_report\n    from .. import store, metrics\n"
                       "    from .batch import x\n")
    deps = _imports("measure.stack", planted)
    assert deps == {"report", "store", "metrics", "measure.batch"}
    up = [d for d in deps if (WINGS[wing(d)] >= WINGS["measure"]) if wing(d) != "measure"]
    assert sorted(up) == ["report", "store"]  # another wing above measure/
    assert RANKS["measure.batch"] >= RANKS["measure.stack"]  # and a module above stack inside its own wing


@pytest.mark.parametrize("name", [n for n, _ in _modules() if n not in ("__main__",)])
def test_every_module_imports(name):
    importlib.import_module("gemmdrift" + (f".{name}" if name else ""))


def test_the_cli_defaults_are_the_library_defaults():
    """The CLI's defaults come from the library (gemmdrift.defaults), not copies in argparse."""
    from gemmdrift import cli, defaults, kernels, suite
    from gemmdrift.measure import diverge, history

    p = cli.build_parser()
    sub = {a.dest: a for a in p._subparsers._group_actions[0].choices["kernels"]._actions}
    assert sub["paths"].default == ",".join(kernels.DEFAULT_PATHS)
    assert sub["max_t"].default == kernels.DEFAULT_MAX_T and sub["rows"].default == kernels.DEFAULT_MAX_ROWS
    assert p.parse_args(["stack"]).schedules == list(suite.DECODE_FAMILY)
    d = p.parse_args(["diverge"])
    import inspect

    sig = inspect.signature(diverge.diverge).parameters
    assert (d.k, d.prefill_a, d.prefill_b) == (sig["k"].default, sig["prefill_a"].default, sig["prefill_b"].default)
    assert p.parse_args(["gate"]).threshold == history.GATE_THRESHOLD
    # triage: the schedule written in the stream file, else defaults.SCHEDULE_SPECULATIVE (cmd_triage, issue 25)
    assert p.parse_args(["triage", "--stream-a", "a", "--stream-b", "b"]).schedule_b is None


def test_the_documented_paths_still_work():
    """The plug-in paths and ``python -m`` entries the docs gave before the wings still load the same code."""
    import subprocess
    import sys

    from gemmdrift.caches import designs, exact, plugins

    assert plugins.load_cache_impl("gemmdrift.exact_cache:make_cache").obj is exact.make_cache
    assert plugins.load_rollback("gemmdrift.exact_cache:rollback").obj is exact.rollback
    assert plugins.load_cache_impl("gemmdrift.cache_designs:unroll_cut").obj is designs.unroll_cut
    for old, new in [("release_ops", "attribution.release_ops"), ("serve_launch", "caches.serve_launch"),
                     ("clidoc", "cli.doc")]:
        shim = importlib.import_module(f"gemmdrift.{old}")
        assert shim.main is importlib.import_module(f"gemmdrift.{new}").main, old
    doc = SRC.parent.parent / "docs" / "commands.md"
    r = subprocess.run([sys.executable, "-m", "gemmdrift.clidoc", "--check", str(doc)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
