"""Defense spec parsing: identity, instances, composition order, argument checks."""
from __future__ import annotations

import pytest
import torch

from leakbench.defenses import DEFENSES, Composition, Defense, Identity, parse
from leakbench.errors import ConfigError


class _Scale(Defense):
    """test-only: multiply every tensor by ``factor``."""

    def __init__(self, factor: float = 2.0) -> None:
        self.factor = factor

    @property
    def spec(self) -> str:  # type: ignore[override]
        return f"_test_scale:{self.factor:g}"

    def apply_gradients(self, grads, *, generator):
        return [g * self.factor for g in grads]


class _Shift(Defense):
    """test-only: add ``amount`` (a required argument) to every tensor."""

    def __init__(self, amount) -> None:
        self.amount = amount

    @property
    def spec(self) -> str:  # type: ignore[override]
        return f"_test_shift:{self.amount:g}"

    def apply_gradients(self, grads, *, generator):
        return [g + self.amount for g in grads]


class _Options(Defense):
    """test-only: records how its arguments were converted."""

    spec = "_test_options"

    def __init__(self, count: int = 1, flag: bool = False, level: float | None = None, *, hidden: int = 0) -> None:
        self.count, self.flag, self.level, self.hidden = count, flag, level, hidden


TEST_DEFENSES = {"_test_scale": _Scale, "_test_shift": _Shift, "_test_options": _Options}


@pytest.fixture(autouse=True)
def test_defenses():
    """Register the test-only defenses in the global DEFENSES and remove them afterwards."""
    for name, cls in TEST_DEFENSES.items():
        DEFENSES.register(name, cls)
    try:
        yield
    finally:
        for name in TEST_DEFENSES:
            DEFENSES._items.pop(name, None)
            DEFENSES._help.pop(name, None)


GEN = torch.Generator().manual_seed(0)


def _grads():
    return [torch.tensor([1.0, -2.0]), torch.tensor([[0.5]])]


def _apply(defense, grads=None):
    return defense.apply_gradients(grads if grads is not None else _grads(), generator=GEN)


@pytest.mark.parametrize("spec", [None, "none", " none ", "none:"])
def test_none_is_the_identity(spec):
    d = parse(spec)
    assert isinstance(d, Identity) and d.spec == "none"
    grads = _grads()
    out = _apply(d, grads)
    assert all(a is b for a, b in zip(out, grads))


def test_defense_instance_is_returned_as_is():
    d = _Scale(5.0)
    assert parse(d) is d


def test_single_spec_builds_the_registered_class():
    d = parse("_test_scale:3")
    assert type(d) is _Scale and d.factor == 3.0 and d.spec == "_test_scale:3"
    assert torch.equal(_apply(d)[0], torch.tensor([3.0, -6.0]))
    assert parse("_test_scale").factor == 2.0  # the default when no argument is given


def test_composition_applies_left_to_right():
    a = parse("_test_scale:3+_test_shift:1")
    b = parse(" _test_shift : 1 + _test_scale : 3 ")
    assert isinstance(a, Composition) and [type(p) for p in a.parts] == [_Scale, _Shift]
    assert [type(p) for p in b.parts] == [_Shift, _Scale]
    assert torch.equal(_apply(a)[0], torch.tensor([3.0 * 1 + 1, 3.0 * -2 + 1]))
    assert torch.equal(_apply(b)[0], torch.tensor([3.0 * (1 + 1), 3.0 * (-2 + 1)]))
    assert torch.equal(_apply(a)[1], torch.tensor([[2.5]]))
    assert a.spec == "_test_scale:3+_test_shift:1"
    assert b.spec == "_test_shift:1+_test_scale:3"
    # a composition re-parses to the same defense
    assert parse(a.spec).spec == a.spec


def test_composition_with_none_is_harmless():
    d = parse("none+_test_scale:2+none")
    assert torch.equal(_apply(d)[0], torch.tensor([2.0, -4.0]))
    assert d.spec == "none+_test_scale:2+none"


def test_too_many_arguments():
    with pytest.raises(ConfigError) as info:
        parse("_test_scale:1,2")
    msg = str(info.value)
    assert "defense '_test_scale' takes factor, got '1,2'" in msg and "'_test_scale:1,2'" in msg
    with pytest.raises(ConfigError, match="defense 'none' takes no arguments, got '0.5'"):
        parse("none:0.5")
    # keyword-only parameters are not positional spec arguments
    with pytest.raises(ConfigError, match="takes count,flag,level, got '1,true,2,3'"):
        parse("_test_options:1,true,2,3")


def test_missing_required_argument_is_a_config_error():
    with pytest.raises(ConfigError, match=r"defense '_test_shift' needs amount.*'_test_shift'"):
        parse("_test_shift")
    with pytest.raises(ConfigError, match="needs amount"):
        parse("_test_scale:2+_test_shift")


def test_non_numeric_argument():
    with pytest.raises(ConfigError, match="expected a number for factor of defense '_test_scale', got 'big'"):
        parse("_test_scale:big")
    with pytest.raises(ConfigError, match="expected a number for amount"):
        parse("_test_shift:1e")
    with pytest.raises(ConfigError, match="expected a number for count"):
        parse("_test_options:1.5")  # an int parameter


def test_arguments_take_the_type_of_their_default():
    d = parse("_test_options:4,true,0.25")
    assert d.count == 4 and type(d.count) is int
    assert d.flag is True
    assert d.level == 0.25 and type(d.level) is float
    assert d.hidden == 0
    assert parse("_test_options:4,false").flag is False
    assert parse("_test_options:4,0").flag is False
    with pytest.raises(ConfigError, match="expected true or false for flag"):
        parse("_test_options:4,maybe")
    assert parse("_test_shift:0.5").amount == 0.5  # no default: a float


def test_unknown_defense_lists_known_names_from_the_registry():
    with pytest.raises(ConfigError) as info:
        parse("_test_scal:2")
    msg = str(info.value)
    assert "unknown defense '_test_scal'" in msg and "Did you mean '_test_scale'?" in msg
    assert msg.endswith("Known defenses: " + ", ".join(DEFENSES.names()))
    for name in ("none", *TEST_DEFENSES):
        assert name in msg


@pytest.mark.parametrize("bad", ["", "   ", 3, 0.5, ["none"]])
def test_bad_spec_types(bad):
    with pytest.raises(ConfigError, match="expected a defense spec such as"):
        parse(bad)


def test_empty_part_is_an_unknown_defense():
    with pytest.raises(ConfigError, match="unknown defense ''"):
        parse("_test_scale:2+")


def test_registry_is_restored_by_the_fixture():
    # the autouse fixture registered them for this test; the module-level list must not leak
    assert set(TEST_DEFENSES) <= set(DEFENSES.names())


def test_one_grammar_gives_family_parameters_and_arguments():
    from leakbench.defenses import family_of, parse

    d = parse("clip:4+noise:0.01")
    assert d.family == "clip+noise" and d.arguments == "4, 0.01"
    assert d.parameters == {"clip": {"C": 4.0, "scope": "global"}, "noise": {"sigma": 0.01}}
    assert parse("local:2,0.1,4").parameters == {"k": 2, "lr": 0.1, "b": 4, "shuffle": False}
    assert family_of("none") == ("none", "") and family_of("prune:0.9,layer") == ("prune", "0.9,layer")
    assert family_of("mystery:3") == ("mystery", "3")  # a store's unregistered defense still groups
