"""Deployment mode: no client data, so the stored reconstructions are unscored and the report says so."""
from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="Flower is an optional extra: pip install 'leakbench[flower]'")

import torch  # noqa: E402

import leakbench as lb  # noqa: E402
from leakbench.evaluation.store import Store  # noqa: E402
from leakbench.integrations.flower import AuditLog, Auditor, LocalTraining  # noqa: E402
from leakbench.report import write_report  # noqa: E402


def test_deployment_rows_are_unscored_with_the_attacks_confidence(tmp_path):
    data = lb.load("digits")
    before = lb.build("mlp:32", input_shape=data.shape, classes=10, act="relu", seed=0)
    after = lb.build("mlp:32", input_shape=data.shape, classes=10, act="relu", seed=0)
    x, y = data.images[:1], data.labels[:1]
    torch.nn.functional.cross_entropy(after(x), y).backward()
    with torch.no_grad():
        for p in after.parameters():
            p -= 0.1 * p.grad
    auditor = Auditor(["fc-inversion", {"name": "fc-inversion", "label": "fc-all", "options": {"rows": "all"}}])
    training = LocalTraining(batch_size=1, lr=0.1)
    outcomes = auditor.audit(before, after, training)  # no (x, y): the server of a real deployment
    assert [o.status for o in outcomes] == ["done", "done"] and not any(o.scored for o in outcomes)
    assert all("rmse" not in o.metrics and o.metrics["confidence_mean"] == 1.0 for o in outcomes)
    log = AuditLog(tmp_path / "audit.db", run="deployed")
    for choice, outcome in zip(auditor.choices, outcomes):
        log.record_update(round=1, client="7", mode="deployment", choice=choice, outcome=outcome, training=training)
    log.record_round(round=1, metrics={"accuracy": 0.25, "loss": 2.1}, source="server")
    log.close()
    with Store(tmp_path / "audit.db", readonly=True) as store:
        rows = store.rows(kind="federated")
        assert {r["spec"]["mode"] for r in rows} == {"deployment"} and all(r["rmse"] is None for r in rows)
        page = write_report(store, tmp_path / "report").index.read_text()
    assert "stored unscored" in page and "highest attack confidence" in page and "0.250" in page
    assert "holds no sweep: it holds 1 audited federated run(s) (deployed)" in page
    assert "RMSE</th>" not in page[page.index('id="federated"'):]


def test_auditing_the_same_run_again_replaces_its_rows(tmp_path):
    from leakbench.integrations.flower import Audited, attack_choices

    choice = attack_choices(["fc-inversion"])[0]
    training = LocalTraining(batch_size=1, lr=0.1)
    for node, rmse in ((11, 0.5), (12, 0.25)):  # a second simulation: new node ids, new scores
        log = AuditLog(tmp_path / "audit.db", run="again")
        outcome = Audited("fc-inversion", "fc-inversion", "done", True, metrics={"rmse": rmse, "psnr": 6.0})
        log.record_update(round=1, client="0", mode="simulation", choice=choice, outcome=outcome, training=training,
                          node=node)
        log.close()
    with Store(tmp_path / "audit.db", readonly=True) as store:
        rows = store.rows(kind="federated")
    assert len(rows) == 1 and rows[0]["rmse"] == 0.25 and rows[0]["metrics"]["node"] == 12
