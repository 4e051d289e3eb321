"""The terminal's verdict lines: plain text of the report's summary sentence, one per threat model and model."""
from __future__ import annotations

import sys
from pathlib import Path

from leakbench.cli.evaluate import verdict_texts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluation" / "verdicts"))
from test_verdicts import attack_rows, noisy, utility_rows  # noqa: E402


def test_verdict_lines_are_plain_text_with_n():
    rows = [*attack_rows("none", noisy(0.05)), *attack_rows("noise:0.1", noisy(0.50, seed=1)),
            *utility_rows("none", [1.0, 1.01, 0.99]), *utility_rows("noise:0.1", [1.02, 1.03, 1.02])]
    lines = verdict_texts(rows)
    assert lines == ["eavesdropper · photos · cnn: At a utility loss ≤ 0.1 (upper 95 % bound, 3 training seeds) — "
                     "B = 4: noise:0.1 stops every attack run here (n = 12)."]
