"""The house has one-way flow: every module imports only modules below it, so there is no import cycle.

measure (taps, kernels, stack, diverge, history) -> Result -> summaries / plots -> store -> report -> suite
-> cli. A new module adds one line to RANKS (its place in the flow); a new import that points upwards fails here.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "gemmdrift"

# Lower rank = lower in the house. A module may import only modules of a strictly lower rank.
RANKS = {
    # foundations: no gemmdrift imports but errors
    "errors": 0, "defaults": 0, "files": 1, "text": 1, "metrics": 1, "schedules": 1, "dispatch": 4, "checks": 1, "prompts": 2,
    "envinfo": 1,
    "platforminfo": 0, "dispatch.base": 1, "dispatch.chips": 2, "dispatch.metal": 2, "dispatch.cuda": 2, "dispatch.cpu": 3,
    "backends": 0, "memory": 1,
    "runenv": 2,  # the CLI's pre-measurement settings and the compute record of resume keys
    "result": 2, "gguf_gemma": 2, "gguf_read": 0,
    "models": 3,
    "taps": 4, "workers": 4, "checkpoint": 4,
    "native_kernels": 1,  # which models are replayed now; their shared prefix on this machine's kernels (issue 22)
    # measurements: each returns a Result
    "kernels.replay_core": 1, "kernels.replay_dense": 2, "kernels.replay_quant": 3, "kernels.replay": 5,
    "kernels.replay_jitcore": 1.5, "kernels.replay_jit": 2.5, "kernels.replay_jitquant": 4,  # compiled replay
    "kernels.replay_paths": 6, "kernels.replay_model": 7, "kernels.replay_units": 8.5, "kernels.replay_check": 10, "replay_cli": 16,
    "kernels.capture": 5, "kernels.paths": 6, "kernels.table": 7, "kernels.ops": 8, "kernels.runs": 9,
    "kernels": 10, "stack": 5, "diverge": 5, "history": 5,
    "kernels.replay_jitcache": 2,  # the compiled replay's tile cache
    "kernels.replay_calib": 6.5,  # calibration files: a chip's measured variant (issue 31)
    "speculative": 4,  # diverge's stream primitives and exact rollback (issue 25)
    "fingerprint": 11, "state": 5, "batch": 6, "server": 6,
    "state.reading": 4.1, "state.common": 4.2, "state.rollback": 4.3, "state.trim": 4.3,  # state/ (issue 25)
    "state.saveload": 4.3, "state.server_reuse": 4.3, "state.batch": 4.3, "state.sweep": 4.4,
    "fingerprint.probes": 10.1, "fingerprint.recovery": 10.2, "fingerprint.describe": 10.3,  # fingerprint/
    "exact_cache": 0, "cache_designs": 0, "plugins": 1, "cachebench": 6, "serve_launch": 7, "draft_self": 4,
    # downstream of a Result
    "summaries": 12, "plots": 12,
    "legacy": 13,
    "store": 14,
    "report": 15, "interrupts": 15,
    "suite": 16,
    "dispatch_cli": 16,
    "twostats": 3, "golden": 5, "goldview": 11, "goldcli": 16,  # logits / compare (issue 23)
    "cliargs": 2,  # the CLI's list and range arguments (issue 25)
    "predict": 11, "predict_view": 11.5,  # predicted GPU drift, the main job's replay part (issue 22)
    "optaps": 5.5,  # op taps inside every decoder layer and local drift per op (issue 29)
    "attribute": 8,  # which op: local drift, counterfactual per op class, the verdict (issue 29)
    "attribute_view": 11.6,  # its summary, text, report section and figure
    "attribute_cli": 16.5,  # `gemmdrift attribute` and its MODES (--primitives, --python plug in there)
    "changelog": 6,  # the numerics changelog's measured part and its release pairs (issue 30)
    "changelog_view": 7,  # the changelog's pages: Markdown and HTML from one list of blocks (issue 30)
    "changelog_predict": 12,  # the changelog's predicted section: dispatch differences, replayed envelopes (issue 30)
    "changelog_cli": 16,  # `gemmdrift changelog` (issue 30)
    "release_ops": 5,  # ops captured once, recomputed under another mlx release's interpreter (issue 29 item 4)
    "primitives_operands": 4.5, "primitives_ops": 7.5, "primitives": 8.6,  # the one-second gate (issue 29, item 6)
    "primitives_view": 8.7, "primitives_cli": 16,  # its text and JSON; its flags for `gemmdrift attribute`
    "clidoc": 18,  # the docs' flag tables, generated from the CLI's parsers (issue 32)
    "cli": 17, "__main__": 18, "": 19,  # "" is the package itself (gemmdrift/__init__.py)
}


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
    unknown = [n for n in names if n not in RANKS]
    assert not unknown, f"modules without a place in the house: {unknown} (add them to RANKS in {__file__})"


def test_no_module_imports_one_above_it():
    bad = []
    for name, path in _modules():
        for dep in sorted(_imports(name, path)):
            if dep not in RANKS:
                dep = dep.rpartition(".")[0] if dep.rpartition(".")[0] in RANKS else dep
            if dep == name:
                continue
            if RANKS.get(dep, -1) >= RANKS.get(name, 10**6):
                bad.append(f"{name or 'gemmdrift'} (rank {RANKS.get(name)}) imports {dep} (rank {RANKS.get(dep)})")
    assert not bad, "imports that point upwards (or sideways):\n" + "\n".join(bad)


def test_the_layering_check_sees_a_planted_cycle(tmp_path):
    planted = tmp_path / "stack.py"
    planted.write_text("def f():\n    from .report import build_report\n    from . import store, metrics\n")
    deps = _imports("stack", planted)
    assert deps == {"report", "store", "metrics"}
    assert [d for d in deps if RANKS[d] >= RANKS["stack"]] != []


@pytest.mark.parametrize("name", [n for n, _ in _modules() if n not in ("__main__",)])
def test_every_module_imports(name):
    importlib.import_module("gemmdrift" + (f".{name}" if name else ""))


def test_the_cli_defaults_are_the_library_defaults():
    """The CLI's defaults come from the library (gemmdrift.defaults), not copies in argparse."""
    from gemmdrift import cli, defaults, diverge, history, kernels, suite

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
