"""The report of a store holding hand-made rows of all five threat models: one non-empty section each, the
verdict, Table 4/5, Figure 3, weights counts beside their controls, membership ROC; labels with ``$`` (matplotlib
mathtext) and ``=`` (spreadsheet formulas) are drawn literally; no "nan" is printed as a number."""
from __future__ import annotations

import html.parser
import math
import re
from dataclasses import dataclass

import numpy as np
import pytest
from matplotlib.image import imread
from matplotlib.text import Text

from leakbench.evaluation import Store
from leakbench.evaluation.running.images import save_trial_files
from leakbench.evaluation.trials.trial import THREAT_MODELS
from leakbench.evaluation.verdicts.strongest import strongest
from leakbench.evaluation.trials.trial import TrialResult, TrialSpec
from leakbench.report import write_report
from leakbench.report.plots import pareto_plot, plain, roc_plot, sd_heatmap

DATASET = "=cmd"   # a spreadsheet formula as a dataset label
DOLLAR = "a$b$c"   # mathtext would print "abc" with an italic b
CRASH = "x$^$y"    # mathtext raises on this one


@dataclass(frozen=True)
class Spec(TrialSpec):
    """A trial spec that names its threat model (as the evaluation core's rows do)."""

    threat_model: str = "eavesdropper"


def _add(store, spec, status="done", metrics=None, arrays=None, error=None, per_sample=None):
    store.add([spec])
    result = TrialResult(key=spec.key, status=status, metrics=metrics or {}, arrays=arrays or {}, error=error,
                         per_sample=per_sample or {})
    files = save_trial_files(store.images_dir, result, png=False) if arrays else {}
    store.commit(result, files)


def _images(rng, b, noise):
    x = rng.random((b, 1, 8, 8)).astype(np.float32)
    rec = np.clip(x + noise * rng.normal(size=x.shape), 0, 1).astype(np.float32)
    # stored in reverse, as an attack returns them unordered; ``order`` matches them back to x
    return {"x": x, "reconstruction": rec[::-1].copy(), "order": np.arange(b)[::-1].copy()}


def build(path):
    rng = np.random.default_rng(0)
    store = Store(path)
    common = dict(dataset=DATASET, model="mlp:20", dataset_key=DATASET, model_key="mlp:20")
    rmse = {"none": 0.02, "noise:0.1": 0.30, "prune:0.9": 0.20, "dpsgd:1.1": 0.45}
    for threat in ("eavesdropper", "informed-eavesdropper"):
        for defense, base in rmse.items():
            for b in (1, 2):
                for attack, factor in ((DOLLAR, 1.0), ("ig", 1.3), (CRASH, 1.6)):
                    for seed in (0, 1, 2, 3):
                        spec = Spec(kind="attack", defense=defense, batch_size=b, seed=seed, attack=attack,
                                    attack_key=attack, threat_model=threat, **common)
                        value = base * factor * b * (1 + 0.1 * seed) * (0.8 if threat != "eavesdropper" else 1)
                        _add(store, spec, metrics={"rmse": value, "mse": value ** 2, "psnr": -20 * math.log10(value),
                                                   "chance_rmse": 0.5},
                             arrays=_images(rng, b, value), per_sample={"psnr": [-20 * math.log10(value)] * b})
        # the unusable rows: never the strongest, each listed with its reason
        _add(store, Spec(kind="attack", defense="none", batch_size=1, attack="fast", attack_key="fast",
                         threat_model=threat, **common), status="failed", metrics={"rmse": 0.0}, error="boom")
        _add(store, Spec(kind="attack", defense="none", batch_size=1, attack="nanny", attack_key="nanny",
                         threat_model=threat, **common), metrics={"rmse": float("nan")})
        _add(store, Spec(kind="attack", defense="none", batch_size=2, attack="rgap", attack_key="rgap",
                         threat_model=threat, **common), status="n/a", error="rgap inverts one sample")
    for defense, loss, eps in (("none", 1.0, None), ("noise:0.1", 0.9, None), ("prune:0.9", 1.3, None),
                               ("dpsgd:1.1", 1.6, 4.2)):
        for b in (1, 2):
            for seed in (0, 1, 2):  # three training seeds, paired with the undefended run's
                _add(store, Spec(kind="utility", defense=defense, batch_size=b, utility={"seed": seed}, **common),
                     metrics={"train_loss": loss + 0.01 * b + 0.02 * seed, "train_accuracy": 0.8,
                              "test_accuracy": 0.8 - loss / 10 + 0.01 * seed, "epsilon": eps, "samples_seen": 1000,
                              "initial_loss": 2.3})
    for b in (1, 2):
        _add(store, Spec(kind="bound", defense="noise:0.1", batch_size=b, **common), metrics={"exact_rmse": 0.5 * b})
    for attack in ("rtf", "cocktail-party"):
        for b in (1, 2):
            _add(store, Spec(kind="attack", defense="noise:0.1", batch_size=b, attack=attack, attack_key=attack,
                             options={"server": {"imprint": {"bins": 8}}} if attack == "rtf" else {},
                             threat_model="malicious-server", **common),
                 metrics={"rmse": 0.01 * b if attack == "rtf" else 0.2}, arrays=_images(rng, b, 0.01))
    counts = {"n_train": 20, "n_nonmembers": 20, "candidates": 40, "diverged": 3, "members_nn": 6,
              "nonmembers_nn": 1, "members_ssim_0.4": 19, "control_ssim_0.4": 20, "members_ssim_0.6": 4,
              "control_ssim_0.6": 0}
    for attack, residual in (("kkt", 0.05), ("univariate", None)):
        x = rng.random((4, 1, 8, 8)).astype(np.float32)
        _add(store, Spec(kind="weights", attack=attack, attack_key=attack, threat_model="published-weights",
                         **common), metrics={**counts, "kkt_residual": residual},
             arrays={"x": x, "reconstruction": np.clip(x + 0.05, 0, 1)})
    _add(store, Spec(kind="weights", attack="model-inversion", attack_key="model-inversion",
                     threat_model="published-weights", **common), status="failed", error="diverged everywhere")
    for setting, shift in (("known", 1.5), ("leaked", 0.5), (CRASH, 0.0)):
        member = np.r_[np.ones(50, bool), np.zeros(50, bool)]
        scores = rng.normal(size=100) + shift * member
        _add(store, Spec(kind="membership", attack="membership-margin", attack_key="membership-margin",
                         options={"setting": setting}, threat_model="membership", **common),
             metrics={"auc": 0.5 + shift / 4, "tpr_at_fpr_0.01": 0.02 * shift, "tpr_at_fpr_0.001": float("nan"),
                      "members": 50, "nonmembers": 50}, arrays={"scores": scores, "is_member": member})
    _add(store, Spec(kind="membership", attack="membership-margin", attack_key="membership-margin",
                     options={"setting": "bounded"}, threat_model="membership", **common),
         metrics={"auc": 0.55, "tpr_at_fpr_0.01": 0.01, "tpr_at_fpr_0.001": 0.0, "members": 50, "nonmembers": 50})
    return store


class Sections(html.parser.HTMLParser):
    """Per ``<section data-threat>``: table body rows and images; all visible text outside <pre>."""

    def __init__(self):
        super().__init__()
        self.current, self.filled, self.images, self.in_tbody, self.in_pre = None, {}, [], 0, 0
        self.data, self.hovers = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section" and "data-threat" in attrs:
            self.current = attrs["data-threat"]
            self.filled[self.current] = 0
        self.in_tbody += tag == "tbody"
        self.in_pre += tag == "pre"
        if self.current and ((tag == "tr" and self.in_tbody) or tag == "img"):
            self.filled[self.current] += 1
        if tag == "img":
            self.images.append(attrs["src"])
        for name in ("title", "alt"):
            if name in attrs:
                self.hovers.append(attrs[name])

    def handle_endtag(self, tag):
        if tag == "section":
            self.current = None
        self.in_tbody -= tag == "tbody"
        self.in_pre -= tag == "pre"

    def handle_data(self, data):
        if not self.in_pre:
            self.data.append(data)

    @property
    def text(self) -> str:
        """The page's text, then its hover texts and image descriptions."""
        return "".join(self.data) + "\n" + "\n".join(self.hovers)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("threats")
    with build(root / "results.db") as store:
        rows = store.rows()
        files = write_report(store, root / "report")
    page = files.index.read_text(encoding="utf-8")
    parser = Sections()
    parser.feed(page)
    return rows, files, page, parser


def test_one_non_empty_section_per_threat_model(report):
    rows, files, page, parser = report
    assert files.threats == list(THREAT_MODELS)
    assert list(parser.filled) == list(THREAT_MODELS)
    assert all(n > 0 for n in parser.filled.values()), parser.filled
    assert f'data-threats="{" ".join(THREAT_MODELS)}"' in page
    for src in parser.images:
        image = imread(files.index.parent / src)
        assert image.shape[0] > 50 and image.std() > 0
    assert len(parser.images) == len(files.plots) + len(files.grids)
    # three S_D heatmaps and Figure 3s (one per gradient threat model), one ROC; grids for every setting + weights
    assert sum("/sd-" in str(p) for p in files.plots) == 3 and sum("/roc-" in str(p) for p in files.plots) == 1
    assert sum("privacy-utility" in str(p) for p in files.plots) == 3
    assert len(files.grids) == 2 * 4 * 2 + 2 + 2


def test_sd_never_crosses_threat_models_or_picks_unusable_rows(report):
    rows, files, page, parser = report
    best = {(s.threat_model, s.defense, s.batch_size): s for s in strongest(rows)}
    assert best["eavesdropper", "none", 1].attack == DOLLAR
    assert best["malicious-server", "noise:0.1", 1].attack == "rtf"
    assert ("eavesdropper", "noise:0.1", 1) in best and best["eavesdropper", "noise:0.1", 1].attack == DOLLAR
    assert all(s.attack not in ("fast", "nanny", "rgap") for s in best.values())
    # the malicious-server rows are named as such in the summary, with what the server ships
    summary = page.split("<h2>Summary</h2>")[1].split("<section")[0]
    assert "4 trial(s) assume a <b>malicious server</b>" in summary and "the server ships: imprint (bins 8)" in summary
    assert "cocktail-party, rtf" in summary


def test_verdict_tables_and_notes(report):
    rows, files, page, parser = report
    text = parser.text
    # budget 0.1 (upper end of the utility interval over 3 seeds): noise:0.1 trains at a lower loss (a gain,
    # shown as measured) and leaks least; at B = 2 every attack on it ends above chance
    assert ("At a utility loss ≤ 0.1 (upper 95 % bound, 3 training seeds) — B = 1: noise:0.1 leaks least (SD 0.345 "
            "± 0.030, n = 4), ahead by 0.322 ± 0.028; B = 2: noise:0.1 stops every attack run here (n = 4).") in text
    # at any cost: DP-SGD (capped at chance) stops every attack at B = 1; at B = 2 the cheapest of three that do
    assert "dpsgd:1.1 (ε = 4.20) stops every attack run here (n = 4)" in text
    assert "noise:0.1 stops every attack run here (n = 4); equivalent: dpsgd:1.1, prune:0.9" in text
    assert "-0.100 ± 0.000 (seeds = 3)" in text and "a negative utility loss" in text
    assert "ε = 4.20" in text
    assert "Cramér–Rao bound (unbiased estimators)" in text and "lower bound on what an attack" in text
    assert "no gradient-matching attack ran" not in text  # the labels here name no registered attack
    # Table 4: mean ± 95 % interval over the four batches, n/a and failed with their reasons on hover
    assert "0.023 ± 0.002 (n = 4)" in text
    assert "Cramér–Rao bound (unbiased estimators)–0.500––" in text  # Table 4's last row: noise:0.1 only
    # chance (a flat image at the data mean, RMSE 0.5 here): a row per table, cells not significantly below it
    assert "chance0.5000.5000.5000.500" in text and "not significantly below chance (0.500, a flat image" in text
    assert re.search(r'<td class="best chance"><span title="not significantly below chance[^"]*">0\.690 ± ', page)
    assert "rgap inverts one sample" in text and "failed: boom" in text and "non-finite result" in text
    # weights: counts beside their controls, the evidence sentence, the failed attack's reason
    # each count with its 95 % Clopper–Pearson interval; bold (evidence) only where Fisher's exact test says so
    assert "6 / 20 [0.12, 0.54] vs 1 / 20 [0.00, 0.25]" in text and "19 / 20 [0.75, 1.00] vs 20 / 20" in text
    assert "4 / 20 [0.06, 0.44] vs 0 / 20 [0.00, 0.17]" in text
    assert "above chance (Fisher's exact test p = 0.046)" in text
    assert re.search(r"<b>6 / 20 \[0\.12, 0\.54\] vs 1 / 20", page) and not re.search(r"<b>19 / 20", page)
    assert "only where it exceeds its control" in text and "diverged everywhere" in text
    assert "0.0500" in text  # KKT residual
    # membership: AUC per setting; a NaN TPR is printed as "–"
    assert "0.875 [0.79, 0.93]" in text and "bounded" in text and "TPR at 0.1 % FPR" in text
    # 50 non-members cannot measure a TPR at 1 % or 0.1 % FPR: greyed with the count it would need
    assert "TPR at 1 % FPR not measurable with 50 non-members (needs 1000)" in text
    assert "needs at least 10000 (ten false positives at that rate)" in page


def test_labels_are_literal_and_no_nan_is_printed(report):
    rows, files, page, parser = report
    text = parser.text
    assert DOLLAR in text and CRASH in text and DATASET in text
    assert "&lt;" not in DATASET and "<script>alert" not in page
    numbers = text.replace("non-finite result (NaN/inf)", "")  # the reason names them; no value prints them
    assert not re.search(r"\b(nan|inf)\b", numbers, re.I), re.findall(r".{40}\b(?:nan|inf)\b.{20}", numbers, re.I)
    with files.csv.open(encoding="utf-8") as f:
        header = f.readline().strip().split(",")
    assert header[:3] == ["key", "kind", "threat_model"]


def test_plain_escapes_mathtext():
    assert Text()._preprocess_math(plain(DOLLAR)) == (DOLLAR, False)
    assert Text()._preprocess_math(plain(CRASH)) == (CRASH, False)


def test_plots_draw_dollar_labels(tmp_path):
    from leakbench.evaluation.verdicts.rules import PrivacyUtilityPoint
    from leakbench.evaluation.verdicts.strongest import Strongest

    best = [Strongest(dataset=DATASET, model="m", defense="none", batch_size=1, attack=CRASH, rmse=0.1, psnr=20.0,
                      ssim=None)]
    assert sd_heatmap(best, tmp_path / "h.png", title=CRASH).is_file()
    point = PrivacyUtilityPoint(dataset=DATASET, model="m", defense="noise:0.1", batch_size=1, attack=CRASH,
                                rmse=0.2, train_loss=1.0, train_loss_increase=0.1, test_accuracy=None,
                                accuracy_drop=None, utility_loss=0.1)
    assert pareto_plot([point], tmp_path / "p.png", title=CRASH).is_file()
    curve = (CRASH, np.array([0.0, 0.5, 1.0]), np.array([0.0, 0.8, 1.0]))
    assert roc_plot([curve], tmp_path / "r.png", title=CRASH).is_file()
    assert pareto_plot([], tmp_path / "none.png") is None and roc_plot([], tmp_path / "none.png") is None


def test_numbers_and_file_names():
    from leakbench.report.markup import num, pct, slug

    assert [num(v) for v in (None, float("nan"), np.float32("nan"), float("inf"), True)] == ["–"] * 5
    assert (num(np.float32(0.25)), num(np.int64(3)), num(-1e-9), pct(np.float64(0.031))) == ("0.250", "3", "0.000",
                                                                                             "3.1 %")
    assert slug("a$b", 1) != slug("a-b", 1) and slug("=cmd").startswith("cmd-")
    assert re.fullmatch(r"[A-Za-z0-9.-]+", slug("../../etc", "x y", "$")) and slug("$$") != slug("$")


def test_verdict_sentence_states_decision_margin_and_n():
    from leakbench.evaluation.verdicts.stats import Interval
    from leakbench.evaluation.verdicts.strongest import INCOMPLETE
    from leakbench.evaluation.verdicts.rules import Verdict
    from leakbench.report.verdict_text import summary_sentence, verdict_table

    def v(b, status, defense, tied=(), n=12, incomplete=None):
        return Verdict(threat_model="eavesdropper", dataset="d", model="m", batch_size=b, budget=0.1,
                       defense=defense, attack="ig", rmse=0.3, utility_loss=0.02, baseline_rmse=0.02,
                       baseline_attack="ig", chance_rmse=0.3, baseline_chance=0.3, status=status, tied=list(tied),
                       n=n, seeds=3, sd=Interval(0.3, 0.29, 0.31, n), margin=Interval(0.1, 0.08, 0.12, n),
                       incomplete=incomplete)
    text = summary_sentence([v(4, "tied", "prune:0.9", ["noise:0.01"]), v(1, "stops", "noise:0.1", ["dpsgd:1,1"]),
                             v(8, "decided", "graddrop:0.5")])
    assert text.startswith("At a utility loss ≤ 0.1 (upper 95 % bound, 3 training seeds) — B = 1: ")
    assert text.index("B = 1") < text.index("B = 4") < text.index("B = 8")  # by batch size, not as strings
    assert "<b>noise:0.1</b> stops every attack run here (n = 12); equivalent: <b>dpsgd:1,1</b>" in text
    assert "tied with <b>noise:0.01</b>" in text and "ahead by 0.100 ± 0.020" in text
    assert len(text.split("—")[1].split(";")) == 4  # one clause per B (and the list inside B = 1)
    assert "lower bound" in summary_sentence([v(1, "decided", "prune:0.9", incomplete=INCOMPLETE)])
    assert "too few to decide" in summary_sentence([v(1, "undecided", "prune:0.9", n=1)])
    html = verdict_table([v(1, "stops", "noise:0.1")])
    assert "0.300 ± 0.010 (n = 12)" in html


def test_the_summary_says_per_attack_whether_the_client_would_have_refused_the_model():
    from leakbench.report.html import _summary

    rows = [{"kind": "attack", "threat_model": "malicious-server", "attack": a, "metrics": {"client_check": c},
             "spec": {"server": {"move": "trap_weights", "options": {}}}}
            for a, c in (("trap-weights", 1.0), ("trap-weights", 1.0), ("fishing", 0.0))]
    text = _summary(["malicious-server"], rows, [], [], [], False)
    assert "fishing: refused in 0 of 1; trap-weights: refused in 2 of 2" in text
