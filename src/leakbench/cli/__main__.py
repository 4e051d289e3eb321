"""``python -m leakbench.cli ...``: the ``leakbench`` command without the installed script."""
from . import app

if __name__ == "__main__":  # spawned sweep workers import this module again: they must not run the command
    app(prog_name="leakbench")
