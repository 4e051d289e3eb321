"""The report's reference-model membership section: verdict, table with honest low-FPR cells, log–log ROC, and the
DP-SGD audit with its red flag — on hand-made rows, and end to end with a deliberately broken (noiseless) DP-SGD."""
from __future__ import annotations

import re

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from leakbench.defenses import DPSGD
from leakbench.defenses.client import dp_gradient
from leakbench.evaluation import Sweep, load_spec
from leakbench.evaluation.membership.verdict import membership_defenses
from leakbench.report import plots, write_report
from leakbench.report.attack_section import Drawn
from leakbench.report.membership_section import BROKEN, audit_rows, reference_section


def _row(defense: str, attack: str, shift: float, *, n: int = 2000, audit: dict | None = None) -> dict:
    g = np.random.default_rng(len(defense) + 10 * len(attack))
    member = np.r_[np.ones(n // 2, bool), np.zeros(n - n // 2, bool)]
    score = g.normal(size=n) + shift * member
    metrics = {"auc": float(roc_auc_score(member, score)), "train_losses": [0.3, 0.31, 0.29],
               "test_accuracy": 0.8, "epsilon": 0.8 if defense.startswith("dpsgd") else None, **(audit or {})}
    return {"kind": "membership", "dataset": "photos", "model": "cnn", "defense": defense, "attack": attack,
            "status": "done", "spec": {"membership": {"form": "reference"}, "seed": 0, "attack": attack},
            "metrics": metrics, "per_sample": {"score": score.tolist(), "member": member.astype(int).tolist()}}


ONE_RUN = {"one_run_epsilon": 0.0, "one_run_canaries": 200, "one_run_guesses": 80, "one_run_correct": 41,
           "one_run_delta": 1e-5, "one_run_confidence": 0.99, "one_run_claimed": 0.66, "one_run_violated": False}
AUDIT = {"audit_tp": 600, "audit_members": 600, "audit_fp": 5, "audit_nonmembers": 600, "audit_delta": 1e-5,
         "audit_epsilon": 4.0}


def test_the_section_holds_the_verdict_the_table_the_log_log_roc_and_the_red_flag(tmp_path, monkeypatch):
    axes = []
    save = plots._save

    def keep(fig, path):
        axes.append([(ax.get_xscale(), ax.get_yscale()) for ax in fig.axes])
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    rows = [_row("none", "loss", 0.5), _row("none", "rmia", 1.0),
            _row("dpsgd:1,10", "loss", 3.0, audit=AUDIT), _row("dpsgd:1,10", "rmia", 3.0, audit=AUDIT)]
    drawn = Drawn()
    page = reference_section(membership_defenses(rows), tmp_path, drawn)
    # DP-SGD's strongest attack has the higher AUC here: none leaks least, decided over the paired points
    assert "<b>Verdict</b>" in page and "no defense within it leaks significantly less than none" in page
    assert "ahead by" in page
    # 1 000 non-members: TPR at 1 % FPR is measured, at 0.1 % it is not
    assert "not measurable at n = 1000" in page and re.search(r"\d+\.\d % \[\d+\.\d, \d+\.\d\]", page)
    assert "(no false positive among 1000)" in page  # TPR with no false positive, with its n
    # every ROC is on log–log axes (the overlay and its small multiples)
    assert drawn.plots and axes and all(scales == ("log", "log") for fig in axes for scales in fig)
    # the noiseless run's bound (TP 600/600, FP 5/600) exceeds ε = 0.8: flagged in red
    assert 'class="broken"' in page and BROKEN in page
    rows_ok = [_row("none", "rmia", 1.0),
               _row("dpsgd:1,10", "rmia", 0.0, audit={**AUDIT, "audit_tp": 300, "audit_fp": 300, **ONE_RUN})]
    page = reference_section(membership_defenses(rows_ok), tmp_path, Drawn())
    assert BROKEN not in page and "one run (Steinke" in page and "41 of 80 guesses right about 200 canaries" in page
    # the one-run audit alone flags a broken run
    broken = {**ONE_RUN, "one_run_epsilon": 2.8, "one_run_correct": 80, "one_run_violated": True}
    rows_bad = [rows_ok[0], _row("dpsgd:1,10", "rmia", 0.0, audit={**AUDIT, "audit_tp": 300, "audit_fp": 300,
                                                                     **broken})]
    assert BROKEN in reference_section(membership_defenses(rows_bad), tmp_path, Drawn())


def _audit_sweep(tmp_path, broken: bool, monkeypatch):
    """Random-label points (canaries, as Jagielski et al.), DP-SGD C = 1, σ = 10 (Opacus ε ≈ 0.48): correct or
    silently noiseless."""
    if broken:
        monkeypatch.setattr(DPSGD, "gradient", lambda self, model, params, x, y, loss_fn, generator: dp_gradient(
            model, params, x, y, loss_fn, max_norm=self.C, noise_multiplier=0.0, generator=generator))
    spec = load_spec({
        "name": "audit", "datasets": [{"name": "digits"}], "models": ["mlp:8"], "batch_sizes": [1],
        "membership": [{"dataset": {"name": "sphere", "options": {"n": 400, "d": 64, "rule": "random"}},
                        "model": {"spec": "mlp:128", "act": "relu"}, "attacks": ["membership-loss"],
                        "training": {"epochs": 15, "batch_size": 20, "lr": 2.0}, "pool": 400,
                        "reference_models": 1, "defenses": ["dpsgd:1,10"], "canaries": 200}]})
    sweep = Sweep(spec, tmp_path / "r.db", workers=1)
    sweep.run(progress=False)
    page = write_report(sweep.store, tmp_path / "report").index.read_text()
    found = membership_defenses(sweep.store.rows())
    sweep.store.close()
    return page, found[0]


@pytest.mark.slow
def test_a_noiseless_dpsgd_is_flagged_in_the_report_and_a_correct_one_is_not(tmp_path, monkeypatch):
    page, d = _audit_sweep(tmp_path / "ok", False, monkeypatch)
    assert d.epsilon < 1 and all(r["bound"] <= d.epsilon for r in audit_rows(d)) and BROKEN not in page
    assert d.one_run[0]["epsilon"] <= d.one_run[0]["claimed"] and not d.one_run[0]["violated"]
    assert 'id="threat-membership"' in page and "Reference-model attacks" in page
    page, d = _audit_sweep(tmp_path / "broken", True, monkeypatch)
    assert d.epsilon < 1 and any(r["bound"] > d.epsilon for r in audit_rows(d)), audit_rows(d)
    assert d.one_run[0]["violated"], d.one_run  # caught from one run with canaries too
    assert BROKEN in page and page.count('class="broken"') >= 2  # in the section and in the summary
