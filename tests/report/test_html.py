"""The HTML report: every referenced file exists and decodes, tables hold the store's numbers, CSV matches."""
from __future__ import annotations

import csv
import html.parser
import math
import numpy as np
import pytest
from matplotlib.image import imread

from leakbench.evaluation import Store, evaluate, strongest
from leakbench.evaluation.trials.trial import TrialResult, TrialSpec
from leakbench.report import write_report
from leakbench.report.export import RESULT_COLUMNS, parquet_available

SPEC = {
    "name": "report-test",
    "datasets": [{"name": "digits"}],
    "models": [{"spec": "mlp:20", "act": "relu"}],
    "batch_sizes": [1, 2],
    "images": 2,
    "attacks": [{"name": "inverting-gradients", "options": {"iterations": 5}, "label": "ig"},
                {"name": "fc-inversion", "preset": "quick"}, {"name": "rgap", "preset": "quick"}],
    "defenses": ["none", "noise:0.05"],
}


class Sources(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.links, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs["src"])
        if tag == "a":
            self.links.append(attrs["href"])

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    evaluate(SPEC, root / "results.db")
    # utility rows as the utility trials write them, so the privacy–utility plot is drawn
    with Store(root / "results.db") as store:
        for defense, loss, acc in (("none", 0.30, 0.90), ("noise:0.05", 0.45, 0.80)):
            t = TrialSpec(kind="utility", dataset="digits", model="mlp:20", defense=defense,
                          dataset_key="digits", model_key="mlp:20(act=relu)")
            store.add([t])
            store.commit(TrialResult(key=t.key, status="done",
                                     metrics={"train_loss": loss, "train_accuracy": acc, "test_accuracy": acc}))
    files = write_report(root / "results.db", root / "report")
    return root, files


def test_report_references_only_files_that_exist_and_decode(report):
    root, files = report
    page = files.index.read_text()
    parser = Sources()
    parser.feed(page)
    assert len(parser.images) == len(files.plots) + len(files.grids) >= 2 + 4
    for src in parser.images + [link for link in parser.links if not link.startswith("#")]:
        assert not src.startswith(("http:", "https:", "/")), src  # relative: opens from disk without a server
        path = files.index.parent / src
        assert path.is_file(), src
        if src.endswith(".png"):
            image = imread(path)
            assert image.shape[0] > 50 and image.shape[1] > 50 and image.std() > 0
    assert any(src.startswith("plots/privacy-utility") for src in parser.images)
    assert any(src.startswith("plots/sd-") for src in parser.images)
    assert all(link[1:] in page for link in parser.links if link.startswith("#"))  # in-page anchors exist
    assert "data-images-ok" in page or "image-check" in page


def test_report_tables_match_the_store(report):
    root, files = report
    with Store(root / "results.db") as store:
        rows = store.rows()
    page = files.index.read_text()
    for s in strongest(rows):
        assert s.attack in page
        assert f"{s.rmse:.3f}" in page
    assert "fc-inversion" in page and "rgap inverts one sample" in page  # the n/a reason is shown
    with files.csv.open() as f:
        records = list(csv.DictReader(f))
    assert len(records) == len(rows)
    assert list(records[0]) == ["key", "kind", "threat_model", *RESULT_COLUMNS[2:]]
    assert {r["threat_model"] for r in records} == {"eavesdropper"}
    by_key = {r["key"]: r for r in rows}
    for rec in records:
        row = by_key[rec["key"]]
        assert rec["status"] == row["status"]
        if row["rmse"] is not None:
            assert math.isclose(float(rec["rmse"]), row["rmse"], rel_tol=1e-9)
    with files.strongest_csv.open() as f:
        assert len(list(csv.DictReader(f))) == len(strongest(rows))
    assert (files.parquet is not None) == parquet_available()


def test_report_shows_identifiability_with_chance_and_threat_tags(report):
    root, files = report
    with Store(root / "results.db") as store:
        done = [r for r in store.rows(kind="attack", status="done")]
    assert done and all(0 <= r["metrics"]["iip_pixel"] <= 1 and "chance_iip_pixel" in r["metrics"] for r in done)
    page = files.index.read_text()
    assert "Identifiability by threat needs" in page and "(chance " in page and 'class="tag"' in page


def test_grid_shows_matched_reconstructions(report):
    root, files = report
    grid = next(p for p in files.grids if "-none-1-" in p.name)
    assert grid.is_file()
    with Store(root / "results.db") as store:
        row = next(r for r in store.rows(kind="attack", status="done") if r["attack"] == "fc-inversion"
                   and r["defense"] == "none" and r["batch_size"] == 1)
    arrays = np.load(row["npz"])
    assert np.allclose(arrays["reconstruction"][arrays["order"]], arrays["x"], atol=1e-4)  # exact attack


def test_missing_database_is_a_clear_error(tmp_path):
    from leakbench.errors import ConfigError

    with pytest.raises(ConfigError, match="no such file"):
        write_report(tmp_path / "absent.db", tmp_path / "out")
    assert not (tmp_path / "absent.db").exists()
