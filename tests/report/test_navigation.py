"""The report's navigation: the contents bar, collapsible sections, the metric picker of Table 4 (every metric in
the HTML), image grids laid out one row per batch size, the sweep spec as readable YAML, ROC curves that stay
distinguishable when they overlap."""
from __future__ import annotations

import html
import math
import re

import numpy as np
import pytest
import yaml
from matplotlib.image import imread

from leakbench.evaluation import Store
from leakbench.evaluation.running.images import save_trial_files
from leakbench.evaluation.trials.trial import TrialResult, TrialSpec
from leakbench.report import write_report
from leakbench.report.navigation import METRIC_NAMES, PICKABLE, metric_id
from leakbench.report.plots import roc_plot
from leakbench.report.spec_text import readable_yaml

#: (attack, defense, B) → (rmse, psnr, ssim, label accuracy); distinctive numbers to find in the page
SCORES = {("ig", "none", 1): (0.0412, 27.71, 0.9123, 1.0), ("ig", "none", 4): (0.1111, 19.08, 0.6543, 0.75),
          ("ig", "noise:0.1", 1): (0.3021, 10.4, 0.1234, 0.0), ("ig", "noise:0.1", 4): (0.3333, 9.54, 0.0987, 0.25),
          ("fc", "none", 1): (0.0577, 24.78, 0.8765, None), ("fc", "none", 4): (0.2222, 13.06, 0.4321, None),
          ("fc", "noise:0.1", 1): (0.4012, 7.93, 0.0555, None), ("fc", "noise:0.1", 4): (0.4444, 7.04, 0.0444, None)}
SPEC_TEXT = yaml.safe_dump({"name": "nav", "description": "ε-DP on 32×32 photos, " + "a long sentence " * 12,
                            "defenses": ["none", "noise:0.1"], "batch_sizes": [1, 4]}, sort_keys=False)


def build(path):
    rng = np.random.default_rng(0)
    store = Store(path)
    store.set_meta("sweep", "nav")
    store.set_meta("spec", SPEC_TEXT)
    for (attack, defense, b), (rmse, psnr, ssim, acc) in SCORES.items():
        for seed in (0, 1):
            spec = TrialSpec(kind="attack", dataset="digits", model="mlp:16", dataset_key="digits",
                             model_key="mlp:16", defense=defense, batch_size=b, seed=seed, attack=attack,
                             attack_key=attack)
            metrics = {"rmse": rmse, "mse": rmse ** 2, "psnr": psnr, "ssim": ssim, "chance_rmse": 0.5,
                       **({"label_acc": acc} if acc is not None else {})}
            x = rng.random((b, 1, 8, 8)).astype(np.float32)
            rec = np.clip(x + rmse * rng.normal(size=x.shape), 0, 1).astype(np.float32)
            result = TrialResult(key=spec.key, status="done", metrics=metrics, per_sample={"psnr": [psnr] * b},
                                 arrays={"x": x, "reconstruction": rec, "order": np.arange(b)})
            store.add([spec])
            store.commit(result, save_trial_files(store.images_dir, result, png=False))
    return store


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("nav")
    with build(root / "results.db") as store:
        files = write_report(store, root / "report")
    return files, files.index.read_text(encoding="utf-8")


def test_contents_bar_links_every_section(report):
    files, page = report
    nav = re.search(r'<nav class="toc"[^>]*>(.*?)</nav>', page, re.S)
    assert nav is not None and page.index("<nav") < page.index("<h1>")  # at the top (sticky in CSS)
    links = re.findall(r'href="#([^"]+)"', nav.group(1))
    assert links == ["summary", "threat-eavesdropper", "problems", "spec"]
    for anchor in links:
        assert f'id="{anchor}"' in page
    assert "position:sticky" in page


def test_sections_fold_and_the_summary_is_open(report):
    files, page = report
    folds = dict(re.findall(r'<details class="section" id="(\w+)"([^>]*)>', page))
    assert "open" in folds["summary"] and "open" not in folds["spec"] and "open" not in folds["problems"]
    threat = re.search(r'<section class="threat" id="threat-eavesdropper"[^>]*><details class="section"( open)?',
                       page)
    assert threat is not None and threat.group(1) == " open"
    assert re.search(r"<summary><h2>Summary</h2></summary>", page)
    assert "<script" not in page.split("<main>")[0]  # the picker and the folds need no script
    assert "http://" not in page and "https://" not in page  # opens from disk with no network


def test_metric_picker_offers_every_metric(report):
    files, page = report
    for m in PICKABLE:  # one hidden radio each (RMSE checked), a button for it in the bar and above each table
        assert re.search(rf'<input type="radio" class="metric" name="metric" id="{metric_id(m)}"', page)
        assert page.count(f'<label class="pick" for="{metric_id(m)}">{METRIC_NAMES[m]}</label>') >= 2
        assert f"#{metric_id(m)}:checked~* .m-{m}" in page  # CSS shows the picked metric's blocks
    assert 'id="metric-rmse" checked' in page and len(re.findall(r"<input[^>]* checked", page)) == 1
    for b in (1, 4):
        block = page.split(f"<h5>B = {b}</h5>")[1]
        for m in PICKABLE:
            assert f'<div class="by-metric m-{m}">' in block.split("<h5>")[0]
    blocks = {m: "".join(re.findall(rf'<div class="by-metric m-{m}">(.*?)</table></div>', page, re.S))
              for m in PICKABLE}
    for rmse, psnr, ssim, acc in SCORES.values():
        assert f"{rmse:.3f}" in blocks["rmse"]
        assert f"{psnr:.2f} (n = 2)" in blocks["psnr"]
        assert f"{ssim:.3f} (n = 2)" in blocks["ssim"]
        if acc is not None:
            assert f"{acc:.2f} (n = 2)" in blocks["label_acc"]
    assert "does not recover labels" in blocks["label_acc"]  # fc has no label accuracy: said, not left blank
    # the best of each column by the metric's own direction: PSNR higher is better
    assert re.search(r'<td class="best">27\.71 \(n = 2\)</td>', blocks["psnr"])
    assert not re.search(r'<td class="best">24\.78', blocks["psnr"])
    assert "@media print{.by-metric{display:block!important}" in page  # the PDF shows every metric


def test_grids_are_laid_out_one_row_per_batch_size(report):
    files, page = report
    rows = re.findall(r'<div class="grid-row" data-batch-size="(\d+)"><h5>B = (\d+)</h5><div class="grids">(.*?)'
                      r"</div></div>", page, re.S)
    assert [(a, b) for a, b, _ in rows] == [("1", "1"), ("4", "4")]
    for size, _, body in rows:
        figures = re.findall(r"<figure><img[^>]*><figcaption>([^<]*)</figcaption></figure>", body)
        assert len(figures) == 2  # one per defense setting, each caption directly under its own grid
        assert all(f"· B = {size} ·" in html.unescape(c) for c in figures)
    assert ".grids figcaption{display:table-caption;caption-side:bottom}" in page
    assert len(files.grids) == 4


def test_spec_is_shown_as_readable_yaml(report):
    files, page = report
    assert "\\u03B5" in SPEC_TEXT or "\\u03b5" in SPEC_TEXT  # what the store holds: escaped
    spec = html.unescape(re.search(r'<pre class="spec">(.*?)</pre>', page, re.S).group(1))
    assert "ε-DP on 32×32 photos" in spec and "\\u" not in spec and "\\\n" not in spec
    assert yaml.safe_load(spec) == yaml.safe_load(SPEC_TEXT)
    assert readable_yaml("not: [valid") == "not: [valid" and readable_yaml("") == ""
    assert readable_yaml(yaml.safe_dump({"a": "one\ntwo\n"})) == "a: |\n  one\n  two\n"


def test_overlapping_roc_curves_stay_distinguishable(tmp_path):
    fpr = np.linspace(0, 1, 60)
    tpr = np.sqrt(fpr)
    curves = [(name, fpr, tpr) for name in ("known", "leaked", "bounded")]  # three identical curves
    path = roc_plot(curves, tmp_path / "roc.png")
    image = imread(path)
    single = imread(roc_plot(curves[:1], tmp_path / "one.png"))
    assert image.shape[0] > single.shape[0] * 1.3  # small multiples under the overlay, one per curve
    from leakbench.report.plots import ROC_STYLES

    assert len(set(map(str, ROC_STYLES))) == len(ROC_STYLES) >= 3
    assert math.isfinite(float(image.std())) and image.std() > 0
