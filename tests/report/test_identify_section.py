"""The report's identifiability table: IIP and registered PSNR beside their chance, attacks grouped by tags."""
from __future__ import annotations

from leakbench.report.identify_section import attack_cell, identify_table, tag_badges


def _row(attack, defense, iip, chance=0.004, **extra):
    return {"kind": "attack", "status": "done", "rmse": 0.1, "attack": attack, "defense": defense,
            "dataset": "digits", "model": "mlp:20", "threat_model": "eavesdropper",
            "metrics": {"iip_pixel": iip, "chance_iip_pixel": chance, "psnr_registered": 20.0,
                        "chance_psnr_registered": 12.0, **extra}}


def test_identify_table_shows_scores_with_chance_grouped_by_tags():
    rows = [_row("kkt", "none", 0.5), _row("fc-inversion", "none", 1.0), _row("fc-inversion", "none", 0.5),
            _row("robbing-the-fed", "noise:0.1", 0.25), {**_row("dlg", "none", 1.0), "status": "failed"}]
    html = identify_table(rows, "eavesdropper", "digits", "mlp:20")
    assert "IIP (pixel)" in html and "registered PSNR" in html and "LPIPS" not in html.split("</table>")[0]
    assert "0.75 <small>(chance 0.00)</small>" in html  # fc-inversion's mean over two trials
    assert "dlg" not in html  # a failed trial is no measurement
    assert html.index("fc-inversion") < html.index("robbing-the-fed") < html.index("kkt")  # ordered by tags
    assert 'class="tag"' in html and "modified-model" in html
    assert identify_table(rows, "eavesdropper", "digits", "cnn") == ""
    assert "declares no threat tags" in tag_badges(())
    labelled = [{**_row("ig", "none", 1.0), "spec": {"attack": "inverting-gradients"}}]  # a spec's label
    assert "bn-stats" not in identify_table(labelled, "eavesdropper", "digits", "mlp:20").split("<p")[0]
    assert "labels" in identify_table(labelled, "eavesdropper", "digits", "mlp:20")
    assert 'title="needs: gradient, update, labels"' in attack_cell("ig", "inverting-gradients")


def test_plugin_metrics_stored_with_trials_become_columns_and_a_stored_format_cannot_size_the_page():
    info = {"max-err": {"label": "max error", "higher_is_better": False, "fmt": ".2f", "origin": "mine"},
            "wide": {"label": "wide", "higher_is_better": True, "fmt": "999999999f", "origin": "mine"}}
    rows = [_row("kkt", "none", 0.5, **{"max-err": 0.25, "chance_max-err": 0.75, "wide": 2.0, "chance_wide": 1.0,
                                        "metric_info": info})]
    html = identify_table(rows, "eavesdropper", "digits", "mlp:20")
    assert "Identifiability and plug-in metrics" in html and "max error ↓ (plug-in mine)" in html
    assert "0.25 <small>(chance 0.75)</small>" in html  # the plug-in's own format
    assert "wide ↑ (plug-in mine)" in html and "2 <small>(chance 1)</small>" in html  # refused format: .4g
    assert len(html) < 20_000
    plain = identify_table([_row("kkt", "none", 0.5)], "eavesdropper", "digits", "mlp:20")
    assert "plug-in" not in plain and "<h4>Identifiability by threat needs" in plain


def test_an_adaptive_attack_is_marked_in_its_cell():
    cell = attack_cell("soteria-adaptive")
    assert '<span class="tag">' in cell and '">adaptive</span></span>' in cell
    assert "adaptive" not in attack_cell("inverting-gradients").split("needs:")[0]
    assert 'class="tag"' not in attack_cell("inverting-gradients")
