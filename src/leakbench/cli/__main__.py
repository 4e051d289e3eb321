"""``python -m leakbench.cli ...``: the ``leakbench`` command without the installed script."""
from . import app

app(prog_name="leakbench")
