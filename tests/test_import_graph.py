"""The package graph of llmopt has no cycle, counting every import of an llmopt module: at module
level, inside functions (deferred), under `if TYPE_CHECKING:`, `from llmopt.x import y` and relative
imports alike. A node is a package under llmopt/ (models, quant, layers, engine, ...) or a top-level
module (defaults, errors, units, validate, fsutil, data, ...); `llmopt/__init__.py` is the node
`llmopt`. An edge A -> B is any module of A importing any module of B.

Deferred (function-level) imports of llmopt modules hide such cycles, so in the packages below one
stays only where it keeps start-up fast (a torch-free entry point) or an optional dependency
optional, and says so in a `# deferred: ...` comment on its line or the line above.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "llmopt"
# where the deferred-import rule holds (packages under llmopt/): every one but the command line,
# whose modules import the library inside each command so that `llmopt --help` and a bad flag never
# load torch (tests/cli/test_startup.py checks that)
RULE_PACKAGES = tuple(sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "cli"))


@dataclass(frozen=True)
class Import:
    source: str        # importing module, e.g. llmopt.quant.pipeline
    target: str        # imported module, e.g. llmopt.models.loader
    path: str          # file, relative to the package root's parent
    line: int
    end_line: int
    deferred: bool     # inside a function


def _module_name(root: Path, path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def _is_module(root: Path, name: str) -> bool:
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    base = root / rel
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports_in(node: ast.AST, deferred: bool = False):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, deferred
        yield from _imports_in(child, deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                      ast.Lambda)))


def collect(root: Path = ROOT) -> list[Import]:
    """Every import of a module of the package at `root` by a module of it."""
    top = root.name
    found = []
    for path in sorted(root.rglob("*.py")):
        source, is_pkg = _module_name(root, path)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, deferred in _imports_in(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = source.split(".") if is_pkg else source.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # `from llmopt import defaults` imports the module llmopt.defaults
                subs = [f"{module}.{a.name}" for a in node.names if _is_module(root, f"{module}.{a.name}")]
                targets = subs if len(subs) == len(node.names) else [module, *subs]
            for t in targets:
                if t == top or t.startswith(top + "."):
                    found.append(Import(source, t, str(path.relative_to(root.parent)), node.lineno,
                                        node.end_lineno or node.lineno, deferred))
    return found


def node_of(module: str) -> str:
    """The graph node of a module: its package under the root, or itself for a top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(imports: list[Import]) -> dict[tuple[str, str], list[Import]]:
    """(A, B) -> the imports that make the edge A -> B (A != B)."""
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for imp in imports:
        a, b = node_of(imp.source), node_of(imp.target)
        if a != b:
            edges[(a, b)].append(imp)
    return dict(edges)


def cycles(edges) -> list[list[str]]:
    """Every elementary cycle of the graph, each as a node path starting at its smallest node."""
    succ: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        succ[a].add(b)
    found = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for n in sorted(succ[node]):
            if n == start:
                found.append(list(path))
            elif n > start and n not in path:
                path.append(n)
                walk(start, n, path)
                path.pop()

    for start in sorted(succ):
        walk(start, start, [start])
    return found


def describe(cycle: list[str], edges) -> str:
    hops = []
    for a, b in zip(cycle, cycle[1:] + cycle[:1]):
        sites = ", ".join(f"{i.path}:{i.line}{' (deferred)' if i.deferred else ''}" for i in edges[(a, b)])
        hops.append(f"  {a} -> {b}: {sites}")
    return " -> ".join(cycle + cycle[:1]) + "\n" + "\n".join(hops)


def _comment_lines(path: Path) -> set[int]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return {t.start[0] for t in tokens if t.type == tokenize.COMMENT and "deferred" in t.string}


def undocumented_deferred(root: Path = ROOT, imports: list[Import] | None = None) -> list[str]:
    """Function-level imports of the package's modules, in RULE_PACKAGES, without a `# deferred`
    comment on their lines or the line above."""
    bad, comments = [], {}
    for imp in imports if imports is not None else collect(root):
        rel = imp.path.split("/", 1)[1]
        if not imp.deferred or rel.split("/")[0] not in RULE_PACKAGES:
            continue
        path = root.parent / imp.path
        lines = comments.setdefault(path, _comment_lines(path))
        if not lines & set(range(imp.line - 1, imp.end_line + 1)):
            bad.append(f"{imp.path}:{imp.line} imports {imp.target}")
    return sorted(set(bad))


def test_package_graph_has_no_cycle():
    edges = package_graph(collect())
    found = cycles(edges)
    assert not found, f"{len(found)} cycle(s) in the package graph:\n" + "\n".join(describe(c, edges) for c in found)


def test_deferred_imports_say_why():
    bad = undocumented_deferred()
    assert not bad, ("function-level imports of llmopt modules without a `# deferred: <why>` comment (keep one only "
                     "for a fast start-up or an optional dependency; else import at module level):\n  "
                     + "\n  ".join(bad))


# -- the checks themselves fail on a cycle and on an undocumented deferred import --------------------
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        f = root / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root


def test_a_deferred_cycle_is_found(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "util.py": "",
        "a/__init__.py": "",
        "a/x.py": "from pkg.b.y import f\nfrom pkg import util\n",
        "b/__init__.py": "",
        "b/y.py": "def f():\n    from ..a import x\n    return x\n",
        "c/__init__.py": "from pkg.a import x\n",
    })
    imports = collect(root)
    edges = package_graph(imports)
    assert set(edges) == {("a", "b"), ("a", "util"), ("b", "a"), ("c", "a")}
    assert cycles(edges) == [["a", "b"]]
    assert "pkg/b/y.py:2 (deferred)" in describe(["a", "b"], edges)


def test_an_undocumented_deferred_import_is_found(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "quant/__init__.py": "",
        "quant/p.py": ("def f():\n    from pkg.models import m\n"
                       "def g():\n    # deferred: optional dependency\n    from pkg.models import m\n"
                       "def h():\n    from pkg.models import m  # deferred: fast start-up\n"),
        "models/__init__.py": "",
        "models/m.py": "",
        "cli/c.py": "def f():\n    from pkg.models import m\n",     # the command line: outside the rule
    })
    assert undocumented_deferred(root) == ["pkg/quant/p.py:2 imports pkg.models.m"]


@pytest.mark.parametrize("graph, want", [({("a", "b"), ("b", "c")}, []),
                                         ({("a", "b"), ("b", "c"), ("c", "a"), ("c", "b")}, [["a", "b", "c"], ["b", "c"]])])
def test_cycles(graph, want):
    assert cycles({e: [] for e in graph}) == want


if __name__ == "__main__":   # the current cycles, with the imports that make each edge
    edges = package_graph(collect())
    found = cycles(edges)
    print(f"{len(found)} cycle(s)")
    for c in found:
        print(describe(c, edges))
    print("\n".join(undocumented_deferred()))
