"""The demo's structure at a tiny budget, end to end: every threat model runs and fills its report section."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from leakbench.evaluation import Sweep, load_spec
from leakbench.evaluation.sweep_spec.bundled import preset_path
from leakbench.evaluation.trials.trial import THREAT_MODELS
from leakbench.report import write_report

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_report.py"
_spec = importlib.util.spec_from_file_location("check_report_demo", SCRIPT)
check_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_report)


def _tiny_demo() -> dict:
    """The bundled demo with its data, models and budgets shrunk; its attacks, threat models and rules kept."""
    spec = load_spec(preset_path("demo")).model_dump()
    spec["datasets"] = [{"name": "photos", "options": {"size": 16, "limit": 160}}]
    for m in spec["models"]:
        if m["spec"].startswith(("convnet", "cnn")):
            m["spec"], m["options"] = "cnn:3-4-2-1", {}
        if m["server"] and m["server"]["imprint"]:
            m["server"]["imprint"]["bins"], m["server"]["public"] = 16, 32
        if m["server"] and m["server"]["random_head"]:
            m["server"]["random_head"]["width"] = 300
    spec["batch_sizes"], spec["images"] = [1, 4], 1
    spec["defenses"] = ["none", "noise:0.01"]
    for a in spec["attacks"]:
        if a["name"] in ("inverting-gradients", "liu2024", "cocktail-party"):
            a["options"] = {**a["options"], "iterations": 10}
            if a["name"] == "cocktail-party":
                a["options"]["inversion_iterations"] = 5
        if a["name"] == "tensor-features":
            a["options"] = {"trials": 2, "refine": 5, "inversion_iterations": 5}
    spec["include"] = [{**r, "batch_size": [1, 4]} for r in spec["include"]]
    for rule in spec["include"]:  # a rule value matching no defense left is refused: keep the ones still here
        if isinstance(rule.get("defense"), list):
            rule["defense"] = [d for d in rule["defense"] if d in ("none", "noise", "noise:0.01")]
    # exclude rules on defenses dropped above would select nothing (refused): drop them
    spec["exclude"] = [r for r in spec.get("exclude") or []
                       if r.get("defense") is None or r["defense"] in ("none", "noise", "noise:0.01")]
    for entry in spec["weights"]:
        entry["target"]["per_class"] = 4
        entry["target"]["options"]["steps"] = 300
        entry["attacks"][0]["options"].update(runs=1, iterations=40, candidates=8)
    for entry in spec["membership"]:
        if entry["target"] is None:  # reference models against the CNN: a small pool, one model, one epoch
            entry.update(dataset={"name": "photos", "options": {"size": 16, "limit": 160}}, pool=80,
                         reference_models=1, training={"epochs": 1, "batch_size": 16, "lr": 0.05, "loss": "ce"},
                         defenses=["none", "noise:0.01"])
            entry["model"].update(spec="cnn:3-4-2-1", options={})
            continue
        entry["target"]["per_class"] = 4
        entry["target"]["options"]["steps"] = 200
    next(e for e in spec["membership"] if e["target"])["target"]["dataset"]["options"] = {"n": 60, "d": 100}
    spec["utility"] = {"epochs": 1, "lr": 0.05}
    return spec


@pytest.mark.slow  # every threat model of the demo, about a minute: `make test-slow` (`make demo` runs it all)
def test_every_threat_model_of_the_demo_runs_and_fills_its_section(tmp_path):
    sweep = Sweep(load_spec(_tiny_demo()), tmp_path / "results.db", workers=1)
    sweep.run(progress=False)
    rows = sweep.store.rows()
    done = {r["threat_model"] for r in rows if r["status"] == "done" and r["kind"] != "utility"}
    assert done == set(THREAT_MODELS), sorted((r["threat_model"], r["attack"], r["status"], r["error"]) for r in rows)
    attack = [r for r in rows if r["kind"] == "attack"]
    na = [r for r in attack if r["status"] == "n/a"]
    assert len(na) < len(attack) / 3 and all(r["error"] for r in na)
    # the only failures allowed: an attack that determined nothing (a flat fallback image is never scored)
    failed = [(r["attack"], r["error"]) for r in rows if r["status"] == "failed"]
    assert all("determined nothing" in (e or "") for _, e in failed), failed
    files = write_report(sweep.store, tmp_path / "report")
    page = files.index.read_text()
    for threat in THREAT_MODELS:
        body = re.search(rf'<section class="threat" id="threat-{threat}"[^>]*>(.*?)</section>', page, re.S)
        assert body is not None, threat
        assert "<table" in body.group(1) or "<img" in body.group(1), threat
    assert "Reference-model attacks" in page and "<b>Verdict</b>" in page  # membership on the CNN
    sweep.store.close()
    browser = check_report.find_browser()
    if browser is not None:  # as a person sees it: every image decodes, every threat section has content
        result = check_report.check(files.index, browser)
        assert result.passed and not result.empty and set(result.expected) == set(THREAT_MODELS), result
