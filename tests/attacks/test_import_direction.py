"""No attack file imports another attack file: shared code lives in the contract modules of leakbench.attacks and
in its solvers/ room (docs/architecture.md).  A membership attack imports its room's registry (membership/base.py)."""
import ast
from pathlib import Path

import leakbench.attacks as attacks_pkg

ROOT = Path(attacks_pkg.__file__).parent
ATTACK_DIRS = ("gradient", "trained", "membership")
#: a sibling an attack file may import: the room's registry
ROOM_BASE = {"membership": "base"}


def _relative_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            found.append((node.level, node.module or ""))
    return found


def test_attack_files_import_no_sibling_attack():
    offenders = []
    for folder in ATTACK_DIRS:
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name == "__init__.py":
                continue
            for level, module in _relative_imports(path):
                sibling = level == 1 and module.split(".")[0] != ROOM_BASE.get(folder)
                if sibling or (level == 2 and module.split(".")[0] in ATTACK_DIRS):
                    offenders.append(f"{folder}/{path.name} imports {'.' * level}{module}")
    assert offenders == []


def test_shared_attack_modules_import_no_attack_file():
    offenders = []
    for path in sorted([*ROOT.glob("*.py"), *(ROOT / "solvers").glob("*.py")]):
        if path.name == "__init__.py":
            continue
        depth = len(path.relative_to(ROOT).parts)  # 1: a contract module, 2: a solver
        for level, module in _relative_imports(path):
            if level == depth and module.split(".")[0] in ATTACK_DIRS + ("text",):
                offenders.append(f"{path.relative_to(ROOT)} imports {'.' * level}{module}")
    assert offenders == []
