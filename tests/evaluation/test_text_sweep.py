"""Text in sweep specs: text trials through the store and back, resumption, modality refusals, the text verdict."""
from __future__ import annotations

import math

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError
from leakbench.evaluation.sweep_spec.modality import is_mismatch, pair_refusal
from leakbench.evaluation.trials.plan import plan
from leakbench.evaluation.running.run import run_trial
from leakbench.evaluation.sweep_spec.model import load_spec
from leakbench.evaluation.verdicts.stats import bootstrap_mean
from leakbench.evaluation.store import Store
from leakbench.evaluation.verdicts.rules import privacy_utility, verdicts
from leakbench.evaluation.verdicts.strongest import strongest
from leakbench.evaluation.verdicts.utility import utility_table
from leakbench.evaluation.trials.attack import TEXT_METRICS

pytestmark = pytest.mark.usefixtures("one_thread")

#: a tiny decoder (B·T = 8 < width 32: DAGER's span test applies) on 8-token held-out sentences
TINY = {
    "name": "text-tiny",
    "datasets": [{"name": "text", "options": {"context": 8, "split": "test", "limit": 60}, "label": "text"}],
    "models": [{"spec": "gpt:layers=2,width=32,heads=2", "label": "gpt"}],
    "batch_sizes": [1],
    "images": 2,
    "seeds": [0],
    "attacks": ["dager"],
    "defenses": ["none", {"noise": [0.01]}],
}


def test_a_text_sweep_round_trips_its_scores_through_the_store_and_resumes(tmp_path):
    db = tmp_path / "t.db"
    summary = lb.evaluate(TINY, db=db)
    assert summary.counts == {"done": 4} and summary.ran == 4
    rows = Store(db, readonly=True).rows()
    by_defense = {}
    for r in rows:
        m = r["metrics"]
        # every text score and its chance level is stored, finite, in [0, 1]; the image columns stay empty
        for k in TEXT_METRICS:
            assert 0.0 <= m[k] <= 1.0 and 0.0 <= m[f"chance_{k}"] <= 1.0, k
        assert m["modality"] == "text" and math.isclose(m["token_error"], 1 - m["token_acc"])
        assert r["rmse"] is None and r["psnr"] is None
        assert r["per_sample"]["token_acc"] and len(r["per_sample"]["token_acc"]) == 1
        by_defense.setdefault(r["defense"], []).append(m)
    # DAGER recovers the undefended sentences exactly (Petrov et al. 2024), unigram draws do not
    assert all(m["token_acc"] == 1.0 and m["exact"] == 1.0 for m in by_defense["none"])
    assert all(m["chance_exact"] == 0.0 and m["chance_token_acc"] < 0.5 for m in by_defense["none"])
    # σ = 0.01 fills the span: DAGER recovers nothing, scored as the empty output (token accuracy 0) with the reason
    assert all(m["token_acc"] == 0.0 and "noise fills its span" in m["nothing_recovered"]
               for m in by_defense["noise:0.01"])
    again = lb.evaluate(TINY, db=db)
    assert again.ran == 0 and again.skipped == 4


def test_an_image_attack_on_text_is_refused_at_spec_check_time_naming_the_field():
    spec = {**TINY, "attacks": ["dager", {"name": "inverting-gradients", "preset": "quick"}]}
    with pytest.raises(ConfigError, match=r"attacks\[1\]\.name.*'inverting-gradients' reconstructs images.*"
                                          r"token sequences.*dager, tag or lamp"):
        load_spec(spec)
    with pytest.raises(ConfigError, match=r"models\[0\]\.spec.*'mlp:16' reads images"):
        load_spec({**TINY, "models": ["mlp:16"]})
    with pytest.raises(ConfigError, match=r"attacks\[0\]\.name.*'tag' reconstructs token sequences"):
        load_spec({**TINY, "datasets": ["digits"], "models": ["mlp:16"], "attacks": ["tag"]})


def test_a_mixed_spec_runs_cross_modality_pairs_as_not_applicable_with_the_reason():
    spec = load_spec({**TINY, "datasets": [*TINY["datasets"], "digits"], "models": [*TINY["models"], "mlp:16"],
                      "attacks": ["dager", {"name": "fc-inversion", "preset": "quick"}]})
    trials = [t for t in plan(spec) if t.kind == "attack"]
    assert len(trials) == 2 * 2 * 2 * 2 * 2  # datasets × models × defenses × batches × attacks
    fits = {("text", "gpt:layers=2,width=32,heads=2", "dager"), ("digits", "mlp:16", "fc-inversion")}
    for t in trials:
        reason = pair_refusal(t.dataset, t.model, t.attack)
        assert (reason is None) == ((t.dataset, t.model, t.attack) in fits)
    image_on_text = next(t for t in trials if (t.dataset, t.model, t.attack) == ("text", "gpt:layers=2,width=32,"
                                                                                 "heads=2", "fc-inversion"))
    result = run_trial(image_on_text)
    assert result.status == "n/a" and is_mismatch(result.error)
    assert "attack 'fc-inversion' reconstructs images and dataset 'text' holds token sequences" in result.error
    gpt_on_digits = next(t for t in trials if (t.dataset, t.model) == ("digits", "gpt:layers=2,width=32,heads=2"))
    result = run_trial(gpt_on_digits)
    assert result.status == "n/a" and "reads token sequences and dataset 'digits' holds images" in result.error


def _row(attack: str, defense: str, batch: int, acc: float, chance: float = 0.02) -> dict:
    return {"kind": "attack", "status": "done", "dataset": "text", "model": "gpt", "attack": attack,
            "defense": defense, "batch_size": 1, "seed": 0, "batch": batch, "rmse": None,
            "spec": {"attack": attack, "seed": 0, "batch": batch},
            "metrics": {"modality": "text", "token_acc": acc, "token_error": 1 - acc,
                        "chance_token_acc": chance, "chance_token_error": 1 - chance},
            "per_sample": {"token_error": [1 - acc], "chance_token_error": [1 - chance]}}


def test_a_text_verdict_ranks_by_token_accuracy_with_its_chance_level_and_intervals():
    gen = torch.Generator().manual_seed(0)
    rows, accs = [], {}
    for b in range(8):
        strong = 0.9 + 0.1 * float(torch.rand(1, generator=gen))   # no defense: DAGER near exact
        weak = 0.3 + 0.2 * float(torch.rand(1, generator=gen))     # TAG
        noisy = 0.02 + 0.01 * (float(torch.rand(1, generator=gen)) - 0.5)  # under noise: around the chance 0.02
        rows += [_row("dager", "none", b, strong), _row("tag", "none", b, weak),
                 _row("tag", "noise:0.1", b, noisy), _row("dager", "noise:0.1", b, 0.0)]
        accs.setdefault("none", []).append(strong)
    best = {s.defense: s for s in strongest(rows)}
    none, noise = best["none"], best["noise:0.1"]
    assert none.metric == noise.metric == "token_error"
    assert none.attack == "dager"  # the highest token accuracy is the strongest attack
    # S_D's interval is the bootstrap of the token accuracies, mirrored (an independent computation)
    acc = bootstrap_mean(accs["none"])
    assert math.isclose(1 - none.sd.mean, acc.mean) and none.sd.n == 8
    assert math.isclose(1 - none.sd.high, acc.low) and math.isclose(1 - none.sd.low, acc.high)
    assert not none.stops and noise.stops  # nothing significantly above the unigram chance under noise
    util = [{"kind": "utility", "status": "done", "dataset": "text", "model": "gpt", "defense": d, "batch_size": 0,
             "spec": {"utility": {"seed": s}}, "metrics": {"train_loss": loss + 0.01 * s, "test_accuracy": 0.1}}
            for d, loss in (("none", 6.0), ("noise:0.1", 6.02)) for s in range(3)]
    found = verdicts(privacy_utility(list(best.values()), utility_table(util)))
    pick = next(v for v in found if math.isinf(v.budget))
    assert pick.defense == "noise:0.1" and pick.status.startswith("stops")
