"""No attack file imports another attack file: shared code lives in the top-level modules of leakbench.attacks."""
import ast
from pathlib import Path

import leakbench.attacks as attacks_pkg

ROOT = Path(attacks_pkg.__file__).parent
ATTACK_DIRS = ("gradient", "trained")


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
                if level == 1 or (level == 2 and module.split(".")[0] in ATTACK_DIRS):
                    offenders.append(f"{folder}/{path.name} imports {'.' * level}{module}")
    assert offenders == []


def test_shared_attack_modules_import_no_attack_file():
    offenders = []
    for path in sorted(ROOT.glob("*.py")):
        if path.name == "__init__.py":
            continue
        for level, module in _relative_imports(path):
            if level == 1 and module.split(".")[0] in ATTACK_DIRS:
                offenders.append(f"{path.name} imports .{module}")
    assert offenders == []
