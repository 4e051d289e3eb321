"""No circles in leakbench's imports (shared/DESIGN.md: no two files import each other, not even lazily).

The graph has one node per module of src/leakbench and an edge for every import of another leakbench
module found anywhere in the file's syntax tree: at module level, inside functions, under
``if TYPE_CHECKING``.  ``from . import name`` points at the submodule ``name`` when there is one, else at
the package.  Importing ``a.b`` runs ``a/__init__.py`` first, but that implicit step is not an edge (every
submodule would otherwise form a circle with its package).
"""
from __future__ import annotations

import ast
from pathlib import Path

import leakbench

ROOT = Path(leakbench.__file__).parent


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module → the leakbench modules it imports."""
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in files:
                        edges.add(sub)
                    elif target in files:
                        edges.add(target)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
        edges.discard(name)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(graph: dict[str, set[str]], component: list[str]) -> str:
    inside = set(component)
    return "\n".join(f"  {m} → {', '.join(sorted(graph[m] & inside))}" for m in component)


def test_the_checker_finds_a_circle_through_a_lazy_import(tmp_path):
    pkg = tmp_path / "leakbench"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    (pkg / "c.py").write_text("from . import a\n")
    graph = import_graph(pkg)
    assert graph["leakbench.a"] == {"leakbench.sub.b"} and graph["leakbench.c"] == {"leakbench.a"}
    assert circles(graph) == [["leakbench.a", "leakbench.sub.b"]]


def test_leakbench_imports_run_one_way():
    graph = import_graph()
    assert len(graph) > 100 and "leakbench.evaluation.running.run" in graph["leakbench.evaluation"]
    found = circles(graph)
    assert not found, "import circles (each module → the modules of its circle it imports):\n" + "\n".join(
        _describe(graph, c) for c in found)
