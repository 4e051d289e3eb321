"""The ``leakbench`` command line: one Typer app, one module per command group.

    leakbench attack --data photos --model convnet --attack inverting-gradients --batch-size 1 --out runs/x
    leakbench list attacks
    leakbench demo

Every :class:`~leakbench.errors.LeakbenchError` a command raises is printed as
one red line ``error: <message>`` on stderr and the command exits with code 2
(no traceback).  See ``docs/cli.md``.  A new command group is a module here that
decorates functions with ``@app.command`` (or adds a sub-Typer to ``app``) and is
imported below.
"""
from . import attack, demo, evaluate, listing  # noqa: F401  (command registration)
from . import analyze  # noqa: F401,E402  (command registration: leakbench analyze)
from . import membership  # noqa: F401,E402  (command registration: leakbench membership)
from .attack import RunResult, RunSpec, execute
from .common import EXIT_USAGE, app, fail, parse_assignments, reports_errors
from .listing import REGISTRIES, attack_presets

__all__ = ["app", "EXIT_USAGE", "fail", "reports_errors", "parse_assignments", "RunSpec", "RunResult", "execute",
           "REGISTRIES", "attack_presets"]
