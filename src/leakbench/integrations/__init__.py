"""Integrations with training frameworks, each an optional extra that ``import leakbench`` never loads.

- :mod:`leakbench.integrations.flower` — audit a Flower federated run round by round
  (``pip install 'leakbench[flower]'``).
"""
