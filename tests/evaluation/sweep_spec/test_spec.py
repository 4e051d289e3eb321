"""Sweep specs: good specs load and expand; bad ones give one ConfigError naming the line, the field and the fix."""
from __future__ import annotations

import textwrap

import pytest

from leakbench.attacks import ATTACKS
from leakbench.errors import ConfigError
from leakbench.evaluation import load_spec, plan
from leakbench.evaluation.sweep_spec.entries import DefenseEntry

GOOD = """\
name: t
datasets:
  - name: digits
    options: {size: 8}
models:
  - cnn:3-4-2-1
  - {spec: "mlp:20", act: relu, training: {epochs: 0}}
batch_sizes: [1, 2]
images: 2
attacks:
  - dlg
  - {name: inverting-gradients, preset: quick, options: {iterations: 5}, label: ig}
defenses:
  - none
  - {prune: [0.5, 0.9]}
  - {spec: "clip:{C}+noise:{s}", grid: {C: [2, 4], s: [0.01]}}
seeds: [0, 1]
exclude:
  - {attack: dlg, batch_size: 2}
"""


def write(tmp_path, text: str):
    path = tmp_path / "spec.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_good_spec_loads_and_expands(tmp_path):
    spec = load_spec(write(tmp_path, GOOD))
    assert spec.defense_specs() == ["none", "prune:0.5", "prune:0.9", "clip:2+noise:0.01", "clip:4+noise:0.01"]
    assert [a.key for a in spec.attacks] == ["dlg", "ig"]
    trials = plan(spec)
    # 2 models × 5 defenses × 2 seeds × (B=1: 2 batches × 2 attacks + B=2: 1 batch × ig only)
    assert len(trials) == 2 * 5 * 2 * (2 * 2 + 1)
    assert len({t.key for t in trials}) == len(trials)
    assert not any(t.attack == "dlg" and t.batch_size == 2 for t in trials)
    assert {t.defense for t in trials} == set(spec.defense_specs())


def test_include_rules_and_text_source():
    text = GOOD.replace("exclude:\n  - {attack: dlg, batch_size: 2}\n",
                        "include:\n  - {defense: prune, model: mlp:20}\n")
    trials = plan(load_spec(text + "\n"))
    assert trials and all(t.defense.startswith("prune:") and t.model == "mlp:20" for t in trials)


def test_defense_shorthands():
    assert DefenseEntry.model_validate("clip:4").expand() == ["clip:4"]
    assert DefenseEntry.model_validate({"dpsgd": [[1, 0.1], [2, 0.1]]}).expand() == ["dpsgd:1,0.1", "dpsgd:2,0.1"]
    assert DefenseEntry.model_validate({"noise": 0.1}).expand() == ["noise:0.1"]


def test_bundled_demo_spec_is_valid():
    from leakbench.cli.demo import demo_spec_path

    spec = load_spec(demo_spec_path())  # its plan is checked in test_presets.py (planning it takes seconds)
    assert spec.batch_sizes == [1, 4, 8, 64]
    assert {a.name for a in spec.attacks} <= set(ATTACKS.names())


@pytest.mark.parametrize("old, new, line, fragments", [
    ("  - dlg\n", "  - dgl\n", 11, ["attacks[0].name", "unknown attack 'dgl'", "Did you mean 'dlg'", "Known attacks"]),
    ("{prune: [0.5, 0.9]}", "{prnue: [0.5, 0.9]}", 15, ["defenses[1]", "unknown defense 'prnue'", "prune"]),
    ("{prune: [0.5, 0.9]}", "{prune: [abc]}", 15, ["defenses[1]", "expected a number", "abc"]),
    ("images: 2", "imagse: 2", 9, ["field imagse", "unknown field 'imagse'", "known fields", "images"]),
    ("images: 2", "images: 0", 9, ["field images", "greater than or equal to 1", "got 0"]),
    ("images: 2", "images: many", 9, ["field images", "valid integer", "'many'"]),
    ("batch_sizes: [1, 2]", "batch_sizes: [1, 0]", 8, ["field batch_sizes", "batch sizes ≥ 1"]),
    ("preset: quick", "preset: quik", 12, ["attacks[1].preset", "unknown preset 'quik'", "known presets"]),
    ("options: {iterations: 5}", "options: {iters: 5}", 12,
     ["attacks[1].options.iters", "unknown option 'iters'", "iterations"]),
    ("  - name: digits\n", "  - name: digitz\n", 3, ["datasets[0].name", "unknown dataset 'digitz'"]),
    ("options: {size: 8}", "options: {sise: 8}", 4, ["datasets[0].options.sise", "unknown option", "size"]),
    ("  - cnn:3-4-2-1\n", "  - gizmo:3\n", 6, ["models[0].spec", "gizmo"]),
    ("{attack: dlg, batch_size: 2}", "{atack: dlg}", 19, ["exclude[0].atack", "unknown rule key", "attack"]),
    ("grid: {C: [2, 4], s: [0.01]}", "grid: {C: [2, 4]}", 16, ["defenses[2]", "no values for ['s']"]),
    ("seeds: [0, 1]", "seeds: [0, 1]\nseeds: [2]", 18, ["duplicate key 'seeds'"]),
    ("  - {name: inverting-gradients, preset: quick, options: {iterations: 5}, label: ig}",
     "  - {name: dlg, preset: quick}", 12, ["attacks[1]", "listed twice", "label"]),
    ("datasets:\n  - name: digits\n    options: {size: 8}\n", "", 1, ["field datasets", "missing", "add it"]),
    ("images: 2", "images: [2", 10, ["not valid YAML"]),
])
def test_bad_spec_names_line_field_and_fix(tmp_path, old, new, line, fragments):
    assert old in GOOD
    path = write(tmp_path, GOOD.replace(old, new))
    with pytest.raises(ConfigError) as info:
        load_spec(path)
    message = str(info.value)
    assert message.startswith(f"spec.yaml line {line}"), message
    for fragment in fragments:
        assert fragment in message, message
    assert "\n" not in message


def test_every_problem_of_a_spec_is_reported_in_one_line(tmp_path):
    """One pass: a misspelt dataset, attack, defense and rule key are all named, first problem first."""
    text = (GOOD.replace("  - name: digits\n", "  - name: digitz\n").replace("  - dlg\n", "  - dgl\n")
            .replace("{prnue", "{prune").replace("{prune: [0.5, 0.9]}", "{prnue: [0.5, 0.9]}")
            .replace("{attack: dlg, batch_size: 2}", "{atack: dlg}"))
    with pytest.raises(ConfigError) as info:
        load_spec(write(tmp_path, text))
    message = str(info.value)
    assert message.startswith("spec.yaml line 3, field datasets[0].name: unknown dataset 'digitz'"), message
    assert "(and 3 more: " in message and "\n" not in message
    order = [message.index(f) for f in ("datasets[0].name", "attacks[0].name", "defenses[1]", "exclude[0].atack")]
    assert order == sorted(order), message
    # each problem alone gives the same line as its part of the whole
    alone = GOOD.replace("  - dlg\n", "  - dgl\n")
    with pytest.raises(ConfigError) as one:
        load_spec(write(tmp_path, alone))
    assert str(one.value).split(" (and ")[0] in message


def test_pydantic_problems_are_all_listed_too(tmp_path):
    text = GOOD.replace("images: 2", "images: 0").replace("batch_sizes: [1, 2]", "batch_sizes: [1, 0]")
    with pytest.raises(ConfigError) as info:
        load_spec(write(tmp_path, text))
    message = str(info.value)
    assert "(and 1 more: " in message and "field images" in message and "field batch_sizes" in message, message


def test_a_long_list_of_problems_is_counted_past_the_listed_ones(tmp_path):
    text = GOOD.replace("defenses:\n  - none\n", "defenses:\n" + "".join(f"  - bad{i}\n" for i in range(9)))
    with pytest.raises(ConfigError) as info:
        load_spec(write(tmp_path, text))
    message = str(info.value)
    assert message.count("unknown defense") == 6 and "(and 8 more: " in message
    assert message.endswith("; 3 more not listed)"), message


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_spec(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_spec(write(tmp_path, "- just\n- a list\n"))


def test_rules_about_attacks_never_drop_utility_or_bound_trials():
    spec = load_spec({**yaml_safe(GOOD), "utility": {"epochs": 1}, "bounds": {"cramer_rao": True},
                      "defenses": ["none", "noise:0.01", "prune:0.5"],
                      "exclude": [{"attack": "ig", "defense": "prune", "batch_size": 2}],
                      "include": [{"attack": "ig"}]})
    trials = plan(spec)
    kinds = {k: [t for t in trials if t.kind == k] for k in ("attack", "utility", "bound")}
    # models × defenses × batch sizes (the defended training uses each attack batch size), untouched by attack rules
    assert len(kinds["utility"]) == 2 * 3 * len(spec.batch_sizes) * 3  # × three training seeds (the default)
    assert {t.defense for t in kinds["bound"]} == {"none", "noise:0.01", "prune:0.5"}
    assert all(t.attack_key == "ig" for t in kinds["attack"])
    assert not any(t.defense == "prune:0.5" and t.batch_size == 2 for t in kinds["attack"])
    assert trials[0].kind == "utility"


def yaml_safe(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)
