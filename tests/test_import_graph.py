"""No circles in leakbench's imports (shared/DESIGN.md: no two files import each other, not even lazily), no
import that runs back up the floors of docs/architecture.md, and no file above 600 lines.

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


#: the floors of leakbench's top-level modules and packages, ground floor first (docs/architecture.md): a module
#: imports its own floor or the floors below.  The root package ``leakbench`` (its face, ``__version__``) is no floor.
FLOORS = [
    {"errors"},
    {"plugins", "coerce", "budget", "progress", "text_batch", "_startup"},
    {"registry"},
    {"losses", "data", "metrics"},
    {"models"},
    {"defenses", "captured"},
    {"threat"},
    {"analysis"},
    {"attacks"},
    {"evaluation"},
    {"report", "integrations"},
    {"cli"},
]
#: the rooms inside a package, ground first: a room imports its own room or the rooms below; the package's
#: ``__init__`` (its face) stands above them all.
ROOMS = {
    "attacks": [{"base", "batch", "labels", "observed"}, {"solvers"}, {"gradient", "trained", "text", "membership"}],
    "evaluation": [{"training"}, {"sweep_spec"}, {"trials"}, {"verdicts"}, {"membership"}, {"running"}, {"store"},
                   {"sweep"}],
}
MAX_LINES = 600


def _rank(module: str, floors=FLOORS, rooms=ROOMS) -> tuple[int, int]:
    parts = module.split(".")[1:]
    floor = next(i for i, names in enumerate(floors) if parts[0] in names)
    inner = rooms.get(parts[0])
    if inner is None:
        return floor, 0
    if len(parts) == 1:
        return floor, len(inner)
    return floor, next(i for i, names in enumerate(inner) if parts[1] in names)


def upward(graph: dict[str, set[str]], floors=FLOORS, rooms=ROOMS) -> list[str]:
    """Every import from a lower floor (or room) to a higher one, as 'a → b'."""
    found = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            if "." not in a or "." not in b:
                continue
            if _rank(b, floors, rooms) > _rank(a, floors, rooms):
                found.append(f"{a} → {b}")
    return found


def test_every_module_stands_on_a_floor_and_in_a_room():
    """A new top-level module or room must be placed in FLOORS / ROOMS (and in docs/architecture.md)."""
    unplaced = []
    for module in import_graph():
        if module == "leakbench":
            continue
        try:
            _rank(module)
        except StopIteration:
            unplaced.append(module)
    assert unplaced == [], f"place these in FLOORS / ROOMS of tests/test_import_graph.py: {unplaced}"


def test_the_checker_finds_an_import_that_runs_back_up():
    graph = {"leakbench.low.a": {"leakbench.high.b"}, "leakbench.high.b": {"leakbench.low.a"},
             "leakbench.pkg.ground": {"leakbench.pkg.top.c"}, "leakbench.pkg.top.c": {"leakbench.pkg.ground"}}
    floors = [{"low"}, {"high"}, {"pkg"}]
    rooms = {"pkg": [{"ground"}, {"top"}]}
    assert upward(graph, floors, rooms) == ["leakbench.low.a → leakbench.high.b",
                                            "leakbench.pkg.ground → leakbench.pkg.top.c"]


def test_no_import_runs_back_up():
    found = upward(import_graph())
    assert found == [], "imports from a lower floor or room to a higher one:\n  " + "\n  ".join(found)


def test_no_file_above_600_lines():
    """Files are split by job before they grow past 600 lines (the package, its tests and benchmarks)."""
    repo = ROOT.parents[1]
    long = []
    for folder in ("src", "tests", "benchmarks"):
        for path in sorted((repo / folder).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > MAX_LINES:
                long.append(f"{path.relative_to(repo)}: {lines}")
    assert long == [], f"files above {MAX_LINES} lines (split them by job):\n  " + "\n  ".join(long)
