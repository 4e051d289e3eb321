"""The generic name → factory registry shared by attacks, defenses, datasets, models and losses."""
from __future__ import annotations

import pytest

from leakbench.errors import ConfigError, LeakbenchError
from leakbench.registry import Registry


class Alpha:
    """First component.

    More text that is not part of the one-line help.
    """

    def __init__(self, *, size: int = 1, name: str = "a") -> None:
        self.size, self.name = size, name


@pytest.fixture
def reg() -> Registry:
    r: Registry = Registry("widget")
    r.register("alpha", Alpha)

    @r.register("beta", help="the second one")
    def beta(**options):
        return ("beta", options)

    r.register("gamma-ray", lambda: "gamma")
    return r


def test_register_create_names(reg):
    assert reg.names() == ["alpha", "beta", "gamma-ray"]  # sorted, not in registration order
    assert list(reg) == reg.names()
    assert len(reg) == 3
    assert "alpha" in reg and "delta" not in reg and 3 not in reg
    # an option may be called "name" (create's own first parameter is positional-only)
    a = reg.create("alpha", size=7, name="x")
    assert isinstance(a, Alpha) and (a.size, a.name) == (7, "x")
    assert reg.create("beta", k=1) == ("beta", {"k": 1})
    assert reg.create("gamma-ray") == "gamma"
    assert reg.get("alpha") is Alpha


def test_decorator_returns_the_function_unchanged():
    r: Registry = Registry("thing")

    def f():
        return 1

    assert r.register("f")(f) is f
    assert r.register("g", f) is f
    assert r.get("f") is f and r.get("g") is f


def test_describe_uses_help_or_first_docstring_line(reg):
    assert reg.describe() == {"alpha": "First component.", "beta": "the second one", "gamma-ray": ""}


def test_duplicate_registration_is_an_error_and_keeps_the_first(reg):
    with pytest.raises(ValueError, match=r"widget 'alpha' is registered twice"):
        reg.register("alpha", lambda: None)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("beta")(lambda: None)
    assert reg.get("alpha") is Alpha
    assert len(reg) == 3


def test_unknown_name_lists_every_known_name_and_hints(reg):
    with pytest.raises(ConfigError) as info:
        reg.create("alpah")
    msg = str(info.value)
    assert "unknown widget 'alpah'" in msg
    assert "Did you mean 'alpha'?" in msg
    assert msg.endswith("Known widgets: alpha, beta, gamma-ray")
    # ConfigError is both a LeakbenchError and a ValueError (the DESIGN's contract).
    assert isinstance(info.value, ValueError) and isinstance(info.value, LeakbenchError)


def test_unknown_name_without_close_match_has_no_hint(reg):
    with pytest.raises(ConfigError) as info:
        reg.get("zzzzzzzz")
    msg = str(info.value)
    assert "Did you mean" not in msg
    for name in reg.names():
        assert name in msg


def test_names_in_message_follow_the_registry(reg):
    reg.register("delta", lambda: None)
    with pytest.raises(ConfigError, match="alpha, beta, delta, gamma-ray"):
        reg.get("nothing-like-it")


def test_non_string_name_is_a_config_error(reg):
    with pytest.raises(ConfigError, match=r"expected a widget name \(str\), got int"):
        reg.get(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="got NoneType"):
        reg.create(None)  # type: ignore[arg-type]


def test_empty_registry_lists_nothing():
    r: Registry = Registry("gizmo")
    assert r.names() == [] and len(r) == 0 and r.describe() == {}
    with pytest.raises(ConfigError, match="unknown gizmo 'x'. Known gizmos: $"):
        r.get("x")


def test_package_registries_resolve_through_the_same_class():
    import leakbench as lb
    from leakbench.losses import LOSSES

    for registry in (lb.ATTACKS, lb.DEFENSES, lb.DATASETS, lb.MODELS, LOSSES):
        assert isinstance(registry, Registry)
        assert registry.names() == sorted(registry.names()) and len(registry.names()) >= 1
    assert {"ce", "mse", "logistic", "exponential"} <= set(LOSSES.names())
    assert {"dlg", "inverting-gradients"} <= set(lb.ATTACKS.names())
    assert "none" in lb.DEFENSES


def test_plural_of_a_kind_ending_in_s():
    r: Registry = Registry("loss")
    r.register("ce", lambda: None)
    with pytest.raises(ConfigError, match="Known losses: ce$"):
        r.get("nope")
