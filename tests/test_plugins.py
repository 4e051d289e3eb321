"""Plug-ins (leakbench.plugins): a user's module adds a defense, an attack and a metric with the register decorators,
and the spec's plugins:, --plugin and entry points bring it into sweeps, workers and the CLI."""
from __future__ import annotations

import csv
import importlib.metadata
import itertools
import json
import sys
import textwrap

import pytest
from typer.testing import CliRunner

import leakbench as lb
from leakbench import plugins
from leakbench.attacks import ATTACKS
from leakbench.cli import app
from leakbench.data import DATASETS
from leakbench.defenses import DEFENSES
from leakbench.errors import ConfigError
from leakbench.evaluation import Store, load_spec
from leakbench.evaluation.trials.plan import plan
from leakbench.evaluation.running.run import run_trial
from leakbench.metrics import METRICS, SCORES
from leakbench.models import MODELS
from leakbench.report import write_report

_COUNT = itertools.count()

#: a plug-in as a researcher writes it: a defense (20 lines), an attack and a metric; {tag} keeps names apart
PLUGIN = '''
"""A test plug-in."""
from dataclasses import dataclass

import torch

from leakbench.attacks import Attack, Reconstruction, register as register_attack
from leakbench.defenses import Defense, register as register_defense
from leakbench.metrics import register as register_metric


@register_defense("flip-{tag}", help="negate and scale every shared tensor (flip-{tag}:scale)")
class Flip(Defense):
    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def apply_gradients(self, grads, *, generator):
        return [-self.scale * g for g in grads]


@register_attack
class Guess(Attack):
    """uniform noise of the batch's shape"""
    name = "guess-{tag}"

    @dataclass
    class Options:
        scale: float = 1.0

    def run(self, obs, *, seed=0, callback=None, progress=None):
        g = torch.Generator().manual_seed(seed)
        return Reconstruction(images=self.options.scale * torch.rand((obs.batch_size, *obs.input_shape), generator=g))


@register_metric("l1-{tag}", higher_is_better=False, label="L1 {tag}")
def l1(reconstruction, original):
    return (reconstruction - original).abs().flatten(1).mean(1)
'''


def _forget(name: str) -> None:
    """Undo a plug-in: its registrations, its module and what leakbench.plugins knows of it."""
    for registry in (ATTACKS, DEFENSES, METRICS, DATASETS, MODELS):
        for entry in list(registry._items):
            if plugins.unit_of(registry._origin.get(entry, "")) == name:
                registry.unregister(entry)
                SCORES.pop(entry, None) if registry is METRICS else None
    sys.modules.pop(name, None)
    plugins._LOADED.pop(name, None)
    plugins._DIGESTS.pop(name, None)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """``make(text=PLUGIN) -> (module name, tag, path)``: a plug-in module written into tmp_path, on sys.path."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def make(text: str = PLUGIN, *, folder=tmp_path):
        tag = f"{next(_COUNT)}x{id(tmp_path) % 10_000}"
        name = f"lbplug_{tag}"
        path = folder / f"{name}.py"
        path.write_text(textwrap.dedent(text).replace("{tag}", tag))
        made.append(name)
        return name, tag, path

    yield make
    for name in made:
        _forget(name)


def _spec(name: str, tag: str, **extra) -> dict:
    return {"name": f"plug-{tag}", "plugins": [name], "datasets": [{"name": "digits", "options": {"limit": 40}}],
            "models": [{"spec": "cnn:3-4-2-1", "act": "tanh"}], "batch_sizes": [2], "images": 2,
            "attacks": [f"guess-{tag}", "fc-inversion"], "defenses": ["none", f"flip-{tag}:2"], **extra}


# --------------------------------------------------------------------------- loading


def test_spec_plugins_are_imported_before_names_resolve_and_enter_the_keys_of_the_trials_using_them(plugin):
    name, tag, _ = plugin()
    spec = load_spec(_spec(name, tag))  # names checked: they exist only once the plug-in is imported
    assert f"guess-{tag}" in ATTACKS and f"flip-{tag}" in DEFENSES and f"l1-{tag}" in METRICS
    trials = plan(spec)
    digest = plugins.digest(name)
    for t in trials:
        # every attack trial is scored by the plug-in's metric; the defense and attack are its own
        assert t.plugins == {name: digest}
        assert t.identity()["plugins"] == {name: digest}
    assert ATTACKS.origin(f"guess-{tag}") == name and plugins.origin_text(name) == f"{name} (spec)"


def test_builtin_trials_keep_their_keys_and_a_changed_plugin_is_a_new_trial(plugin):
    name, tag, path = plugin()
    own = {**_spec(name, tag), "plugins": [], "attacks": ["fc-inversion"], "defenses": ["none"]}
    builtin = [t.key for t in plan(load_spec(own))]
    assert "plugins" not in plan(load_spec(own))[0].identity()  # no plug-in: the key it had before plug-ins existed
    spec = load_spec(_spec(name, tag))
    before = {(t.attack, t.defense): t.key for t in plan(spec)}
    assert before[("fc-inversion", "none")] != builtin[0]  # the plug-in's metric now scores it too
    path.write_text(path.read_text() + "\n# edited\n")
    plugins._DIGESTS.pop(name)  # what a new process sees
    after = {(t.attack, t.defense): t.key for t in plan(spec)}
    assert not set(before.values()) & set(after.values())
    _forget(name)
    assert [t.key for t in plan(load_spec(own))] == builtin


def test_a_trial_refuses_a_plugin_edited_since_it_was_planned(plugin):
    name, tag, path = plugin()
    trial = plan(load_spec(_spec(name, tag)))[0]
    path.write_text(path.read_text() + "\n# edited\n")
    plugins._DIGESTS.pop(name)
    with pytest.raises(ConfigError, match=f"plug-in '{name}' changed since this trial was planned"):
        plugins.ensure(trial.plugins)


def test_a_worker_imports_the_plugins_a_trial_names(plugin):
    """What a fresh pool worker or Ray actor does: the trial's plug-ins are imported before any name resolves."""
    name, tag, _ = plugin()
    trial = next(t for t in plan(load_spec(_spec(name, tag))) if t.attack == f"guess-{tag}")
    _forget(name)  # as in a process that never imported it
    assert f"guess-{tag}" not in ATTACKS
    result = run_trial(trial)
    assert result.status == "done", result.error
    assert f"l1-{tag}" in result.metrics and name in sys.modules


def test_components_of_a_module_imported_by_hand_are_plugins_too(plugin):
    """`import my_plugin` in a script (not listed anywhere): its trials still carry it, so workers import it."""
    name, tag, _ = plugin()
    __import__(name)
    spec = load_spec({**_spec(name, tag), "plugins": []})
    assert all(t.plugins == {name: plugins.digest(name)} for t in plan(spec))
    assert plugins.origin_text(name) == f"{name} (imported)"


def test_a_spec_names_modules_never_files_nor_the_current_directory(plugin, tmp_path, monkeypatch):
    name, tag, path = plugin()
    with pytest.raises(ConfigError, match=r"field plugins\[0\].*a spec names modules, not files.*--plugin PATH"):
        load_spec({**_spec(name, tag), "plugins": [str(path)]})
    here = tmp_path / "here"
    here.mkdir()
    local, _, _ = plugin(folder=here)
    monkeypatch.chdir(here)
    monkeypatch.setattr(sys, "path", ["", *sys.path])  # as `python -m` / `python -c` put it
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with pytest.raises(ConfigError, match=f"plug-in '{local}' \\(spec\\): no such module on the Python path"):
        plugins.load([local], source="spec")
    assert local not in sys.modules
    assert plugins.load([f"./{local}.py"], source="--plugin") == [local]  # a path the user names is imported


def test_entry_points_of_installed_packages_are_loaded_before_a_registry_resolves(plugin, monkeypatch):
    name, tag, _ = plugin()
    ep = importlib.metadata.EntryPoint(name="mine", value=name, group=plugins.GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [ep] if group == plugins.GROUP else [])
    monkeypatch.setitem(plugins._ENTRY_POINTS, "state", "todo")
    assert f"flip-{tag}" in DEFENSES  # the first look-up imports it
    assert lb.defenses.parse(f"flip-{tag}:3").scale == 3.0
    assert plugins.origin_text(DEFENSES.origin(f"flip-{tag}")) == f"{name} (entry point mine)"
    monkeypatch.setitem(plugins._ENTRY_POINTS, "state", "todo")
    monkeypatch.setenv(plugins.NO_ENTRY_POINTS_ENV, "1")
    _forget(name)
    assert f"flip-{tag}" not in DEFENSES


# --------------------------------------------------------------------------- the command line

runner = CliRunner()


def _one_line(result, *fragments: str) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_plugin_option_on_list_shows_where_each_name_comes_from(plugin):
    name, tag, path = plugin()
    result = runner.invoke(app, ["list", "defenses", "--plugin", str(path)], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if f"flip-{tag}" in line)
    assert f"{name} (--plugin: {path})" in row
    assert "leakbench" in next(line for line in result.output.splitlines() if " prune " in line)
    result = runner.invoke(app, ["list", "metrics", "--plugin", name], env={"COLUMNS": "300"})
    assert result.exit_code == 0 and f"l1-{tag}" in result.output


def test_dry_run_lists_the_plugins_a_run_imports(plugin, tmp_path):
    name, tag, path = plugin()
    spec = tmp_path / "sweep.yaml"
    spec.write_text(json.dumps({**_spec(name, tag), "plugins": []}))
    result = runner.invoke(app, ["evaluate", str(spec), "--dry-run", "--plugin", str(path)])
    assert result.exit_code == 0, result.output
    assert f"plug-ins: {name} (--plugin: {path})" in result.output and "4 trial(s)" in result.output
    # --defense adds a setting (the plug-in's) to the spec's: every attack runs against it
    result = runner.invoke(app, ["evaluate", str(spec), "--dry-run", "--plugin", str(path), "--defense", f"flip-{tag}:3"])
    assert result.exit_code == 0 and "6 trial(s)" in result.output, result.output
    _one_line(runner.invoke(app, ["evaluate", str(spec), "--dry-run", "--defense", "flip-nothing"]),
              "unknown defense 'flip-nothing'")


@pytest.mark.parametrize("body, what", [
    ("raise RuntimeError('no GPU here')", "importing it failed: RuntimeError: no GPU here; fix the module"),
    ("def broken(:\n    pass", "importing it failed: SyntaxError"),
    ("import not_a_module_anywhere_42", "importing it failed: ModuleNotFoundError: No module named "
                                        "'not_a_module_anywhere_42'; install what it needs"),
])
def test_a_broken_plugin_is_one_line_naming_it(plugin, body, what):
    name, _, path = plugin(body)
    _one_line(runner.invoke(app, ["list", "attacks", "--plugin", str(path)]), f"plug-in '{path}' (--plugin)", what)
    _one_line(runner.invoke(app, ["list", "attacks", "--plugin", name]), f"plug-in '{name}' (--plugin)", what)


def test_a_missing_plugin_is_one_line(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("plugins: [no_such_plugin_here]\ndatasets: [digits]\nmodels: [mlp:4]\nbatch_sizes: [1]\n"
                    "attacks: [dlg]\n")
    _one_line(runner.invoke(app, ["evaluate", str(spec), "--dry-run"]), "s.yaml line 1, field plugins[0]",
              "plug-in 'no_such_plugin_here' (spec): no such module on the Python path")
    _one_line(runner.invoke(app, ["list", "attacks", "--plugin", "./nothing.py"]), "no such .py file")


# --------------------------------------------------------------------------- metrics


def test_registered_metrics_are_computed_by_compare_and_stored_by_sweeps(plugin, tmp_path):
    name, tag, _ = plugin()
    spec = {**_spec(name, tag), "attacks": [f"guess-{tag}"], "defenses": [f"flip-{tag}:2"]}
    summary = lb.evaluate(spec, tmp_path / "r.db")
    assert summary.counts == {"done": 1}
    with Store(tmp_path / "r.db") as store:
        row = store.rows(kind="attack")[0]
    assert row["metrics"][f"l1-{tag}"] > 0 and len(row["per_sample"][f"l1-{tag}"]) == 2
    assert row["metrics"]["cosine"] is not None
    x = lb.load("digits", limit=4).batch(2, seed=0)[0]
    scores = lb.compare(0.5 * x, x)
    assert scores[f"l1-{tag}"] == pytest.approx(float((0.5 * x).abs().mean()))
    assert SCORES[f"l1-{tag}"].label == f"L1 {tag}" and not SCORES[f"l1-{tag}"].column
    # its chance level: the same metric on the flat image at the chance level
    assert scores[f"chance_l1-{tag}"] == pytest.approx(float((x.mean() - x).abs().mean()))
    # the trial says how to show it, so the report and the CSV carry it without importing the plug-in
    assert row["metrics"]["metric_info"] == {f"l1-{tag}": {"label": f"L1 {tag}", "higher_is_better": False,
                                                            "fmt": ".4g", "origin": name}}
    files = write_report(tmp_path / "r.db", tmp_path / "report")
    page = files.index.read_text()
    assert f"L1 {tag} ↓ (plug-in {name})" in page and "Identifiability and plug-in metrics" in page
    value = format(row["metrics"][f"l1-{tag}"], ".4g")
    assert f"{value} <small>(chance {format(row['metrics'][f'chance_l1-{tag}'], '.4g')})</small>" in page
    with files.csv.open() as f:
        record = next(r for r in csv.DictReader(f) if r["kind"] == "attack")
    assert float(record[f"plugin:l1-{tag}"]) == pytest.approx(row["metrics"][f"l1-{tag}"])
    assert float(record[f"plugin:chance_l1-{tag}"]) == pytest.approx(row["metrics"][f"chance_l1-{tag}"])


def test_a_score_without_a_function_and_a_failing_metric_are_refused(plugin, monkeypatch):
    x = lb.load("digits", limit=4).batch(2, seed=0)[0]
    monkeypatch.setitem(SCORES, "orphan", lb.metrics.MetricInfo("orphan", higher_is_better=True))
    with pytest.raises(ConfigError, match="score 'orphan' is listed in SCORES but has no function in METRICS"):
        lb.compare(x, x)
    SCORES.pop("orphan")
    name, tag, _ = plugin(PLUGIN + "\n@register_metric('bad-{tag}', higher_is_better=True)\ndef bad(a, b):\n"
                                   "    return a.sum()\n")
    __import__(name)
    with pytest.raises(ConfigError, match=f"metric 'bad-{tag}' \\(from {name}\\) returned 1 value"):
        lb.compare(x, x)


# --------------------------------------------------------------------------- workers and Ray (slow: processes start)


@pytest.mark.slow
def test_a_yaml_sweep_with_a_plugin_runs_in_two_workers_into_the_report(plugin, tmp_path):
    """The issue's case: a user's defense and attack in a sweep with --workers 2, verdicts and report included."""
    name, tag, _ = plugin()
    spec = tmp_path / "sweep.yaml"
    spec.write_text(json.dumps(_spec(name, tag)))
    db, out = tmp_path / "r.db", tmp_path / "report"
    result = runner.invoke(app, ["evaluate", str(spec), "--db", str(db), "--workers", "2", "--report", str(out)])
    assert result.exit_code == 0, result.output
    with Store(db) as store:
        rows = store.rows()
    assert {(r["attack"], r["defense"]) for r in rows} == {(a, d) for a in (f"guess-{tag}", "fc-inversion")
                                                           for d in ("none", f"flip-{tag}:2")}
    assert all(r["status"] in ("done", "n/a") for r in rows), [r["error"] for r in rows]
    assert all(r["spec"]["plugins"] == {name: plugins.digest(name)} for r in rows)
    assert {r["worker"] for r in rows} != {lb.evaluation.trials.trial.worker_id()}  # run in the workers
    assert any(r["metrics"].get(f"l1-{tag}") is not None for r in rows if r["status"] == "done")
    page = (out / "index.html").read_text()
    assert f"flip-{tag}" in page and f"guess-{tag}" in page
    again = runner.invoke(app, ["evaluate", str(spec), "--db", str(db), "--workers", "2", "-q"])
    assert again.exit_code == 0 and not again.output.strip()


@pytest.mark.slow
def test_a_plugin_named_by_path_runs_on_ray_actors(plugin, tmp_path):
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    from leakbench.evaluation import Sweep
    from leakbench.evaluation.running.ray_runner import RayRunner

    name, tag, path = plugin()
    plugins.load([str(path)], source="--plugin")
    spec = {**_spec(name, tag), "plugins": [], "attacks": [f"guess-{tag}"]}
    runner_ = RayRunner("local", num_cpus=2)
    try:
        summary = Sweep(spec, tmp_path / "ray.db", runner=runner_).run()
    finally:
        runner_.close()
        if ray.is_initialized():
            ray.shutdown()
    assert summary.counts == {"done": 2}, summary
    with Store(tmp_path / "ray.db") as store:
        rows = store.rows()
    assert all(r["metrics"][f"l1-{tag}"] > 0 for r in rows)
    assert {r["worker"] for r in rows} != {lb.evaluation.trials.trial.worker_id()}  # run by the actors
