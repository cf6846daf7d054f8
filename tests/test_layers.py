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
    "errors": 0, "files": 1, "text": 1, "metrics": 1, "schedules": 1, "dispatch": 1, "checks": 1, "prompts": 2,
    "envinfo": 1,
    "result": 2, "gguf_gemma": 2,
    "models": 3,
    "taps": 4,
    # measurements: each returns a Result
    "kernels.capture": 5, "kernels.paths": 6, "kernels.table": 7, "kernels.ops": 8, "kernels.runs": 9,
    "kernels": 10, "stack": 5, "diverge": 5, "history": 5,
    # downstream of a Result
    "summaries": 11, "plots": 11,
    "legacy": 12,
    "store": 13,
    "report": 14,
    "suite": 15,
    "cli": 16, "__main__": 17, "": 18,  # "" is the package itself (gemmdrift/__init__.py)
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
