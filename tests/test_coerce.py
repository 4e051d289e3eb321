"""The one option coercer shared by the CLI's data options and every attack's options."""
from __future__ import annotations

from typing import Any, Optional
from collections.abc import Sequence

import pytest

from leakbench.attacks import create
from leakbench.coerce import coerce
from leakbench.errors import ConfigError


@pytest.mark.parametrize("text, annotation, expected", [
    ("100", int, 100), ("0.5", float, 0.5), ("yes", bool, True), ("off", bool, False), ("x", str, "x"),
    ("none", Optional[int], None), ("3", int | None, 3), ("a, b", Sequence[str], ["a", "b"]),  # noqa: UP045 (both spellings are read)
    ("2", int | str, "2"), ("1e-3", Any, 1e-3), ("null", Any, None), ("adam", Any, "adam"),
])
def test_text_becomes_the_declared_type(text, annotation, expected):
    assert coerce(text, annotation, name="k", owner="o") == expected


def test_typed_values_pass_untouched_and_bad_text_names_the_option():
    assert coerce(7, str, name="k", owner="o") == 7
    with pytest.raises(ConfigError, match=r"expected int for option 'iterations' of attack 'dlg', got 'many'"):
        create("dlg", iterations="many")  # the attack's options go through the same coercer
    with pytest.raises(ConfigError, match="expected bool for option 'k' of o"):
        coerce("maybe", bool, name="k", owner="o")
