"""The report's text section: token-accuracy tables and original/recovered sentences, HTML-escaped."""
from __future__ import annotations

import re

import pytest

import leakbench as lb
from leakbench.report import write_report
from leakbench.report.text_section import mark_tokens

pytestmark = pytest.mark.usefixtures("one_thread")

HOSTILE = ["<script>alert('x')</script> & friends",
           "Tom & Jerry <b>bold</b> claims",
           "a \"quoted\" <img src=x onerror=y> line"]


def test_mark_tokens_escapes_every_piece_and_highlights_matching_positions():
    top, bottom = mark_tokens(["<a", " &", " b"], ["<a", " x"], [True, False, False])
    assert top == "<mark>&lt;a</mark> &amp; b"
    assert bottom == '<mark>&lt;a</mark><mark class="miss"> x</mark>'


def test_the_report_shows_a_text_section_with_escaped_sentences(tmp_path):
    corpus = tmp_path / "hostile.txt"
    corpus.write_text("\n".join(HOSTILE) + "\n", encoding="utf-8")
    spec = {"name": "text-report",
            "datasets": [{"name": "text", "options": {"files": [str(corpus)], "context": 24}, "label": "hostile"}],
            "models": [{"spec": "gpt:layers=2,width=64,heads=2", "label": "gpt"}],
            "batch_sizes": [1], "images": 3, "seeds": [0], "attacks": ["dager"], "defenses": ["none"]}
    summary = lb.evaluate(spec, db=tmp_path / "r.db")
    assert summary.counts == {"done": 3}
    files = write_report(tmp_path / "r.db", tmp_path / "report")
    page = files.index.read_text(encoding="utf-8")
    assert "Text reconstruction scores" in page and "Original and recovered sentences" in page
    assert "token accuracy ± 95 % CI" in page and "chance token acc." in page
    # the sentences are there, escaped: no tag of the user's text reaches the page
    plain = re.sub(r'</?mark( class="miss")?>', "", page)
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; friends" in plain
    assert "Tom &amp; Jerry &lt;b&gt;bold&lt;/b&gt; claims" in plain
    assert "<script>alert" not in page and "<b>bold" not in page and "<img src=x" not in page
    # DAGER recovers them exactly (token accuracy 1.000 ± 0.000 over n = 3 batches), every token highlighted
    assert "1.000 ± 0.000 (n = 3)" in page
    table = page[page.index('class="sentences"'):]
    assert 'class="miss"' not in table[:table.index("</table>")]
    assert not files.grids  # no image grids for text
    assert len(re.findall(r"<td class=\"l\">recovered</td>", page)) == 3
    # the text scores are columns of results.csv (empty for image trials)
    import csv

    with open(files.csv, newline="", encoding="utf-8") as f:
        records = list(csv.DictReader(f))
    assert [float(r["token_acc"]) for r in records] == [1.0, 1.0, 1.0]
    assert all(float(r["chance_token_acc"]) < 0.5 and r["rmse"] == "" for r in records)
