"""Finding one's way through the report: the contents bar, collapsible sections and the metric picker.

Everything here is static HTML and CSS (no script, no network), so the page keeps working when opened from
disk with JavaScript off:

- :func:`contents_bar` — a bar that stays at the top of the window, with a link to every section and the
  metric picker;
- :func:`collapsible` — a section as ``<details>``/``<summary>`` (open or closed by default);
- the metric picker — one hidden radio button per metric (:func:`metric_radios`, the first children of
  ``<body>``) and ``<label for=…>`` buttons (:func:`metric_labels`) wherever a table offers a choice; the CSS
  (:data:`NAV_CSS`) shows the blocks of the checked metric only (:func:`per_metric`).  Printed (and in the PDF),
  every metric's block is shown, each under its name.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..metrics.scores import SCORES
from .markup import esc

#: the metrics a reader may pick for the attack tables, in the picker's order (RMSE first: S_D ranks by it).
PICKABLE = ("rmse", "psnr", "ssim", "label_acc")
#: the picker's short name of each metric.
METRIC_NAMES = {name: SCORES[name].label.replace(" (dB)", "") for name in PICKABLE}


def metric_id(metric: str) -> str:
    return f"metric-{metric.replace('_', '-')}"


def _picker_css() -> str:
    shown = ",".join(f"#{metric_id(m)}:checked~* .m-{m}" for m in PICKABLE)
    chosen = ",".join(f"#{metric_id(m)}:checked~* label[for={metric_id(m)}]" for m in PICKABLE)
    return (f"input.metric{{position:absolute;opacity:0;pointer-events:none}} .by-metric{{display:none}} "
            f"{shown}{{display:block}} "
            f"label.pick{{border:1px solid #bbb;border-radius:3px;padding:0 .35rem;margin:0 .1rem;cursor:pointer;"
            f"font-size:.8rem;white-space:nowrap}} {chosen}{{background:#2a5d9f;color:#fff;border-color:#2a5d9f}} "
            ".by-metric .metric-name{display:none} "
            "@media print{.by-metric{display:block!important} .by-metric .metric-name{display:block} "
            "nav.toc,.picker{display:none}}")


NAV_CSS = (
    "nav.toc{position:sticky;top:0;z-index:10;background:#fafafa;border-bottom:1px solid #ddd;padding:.35rem .6rem;"
    "margin:0 -1rem 1rem;font-size:.85rem;line-height:1.8} nav.toc a{margin-right:.8rem;white-space:nowrap} "
    "nav.toc .picker{float:right} [id]{scroll-margin-top:3.2rem} "
    "details.section>summary{cursor:pointer;list-style-position:outside} "
    "details.section>summary>h2{display:inline-block;border:0;margin:1.6rem 0 .4rem} "
    "details.section{border-bottom:1px solid #ddd;margin-bottom:.6rem} "
    "details.part>summary{cursor:pointer} details.part>summary>h4{display:inline-block;margin:1rem 0 .3rem} "
    + _picker_css()
)


def metric_radios() -> str:
    """The hidden radio buttons of the metric picker (RMSE checked); they must come first in ``<body>``."""
    return "".join(f'<input type="radio" class="metric" name="metric" id="{metric_id(m)}"'
                   f'{" checked" if i == 0 else ""} aria-label="{esc(METRIC_NAMES[m])}">'
                   for i, m in enumerate(PICKABLE))


def metric_labels(lead: str = "metric:") -> str:
    """Buttons that pick the metric of every attack table on the page."""
    return (f'<span class="picker">{esc(lead)} '
            + "".join(f'<label class="pick" for="{metric_id(m)}">{esc(METRIC_NAMES[m])}</label>' for m in PICKABLE)
            + "</span>")


def per_metric(blocks: Mapping[str, str]) -> str:
    """One block per metric (HTML), only the picked one shown (all when printed)."""
    return "".join(f'<div class="by-metric m-{m}"><p class="muted metric-name">{esc(METRIC_NAMES.get(m, m))}</p>'
                   f"{blocks[m]}</div>" for m in PICKABLE if m in blocks)


def contents_bar(entries: Sequence[tuple[str, str]], *, picker: bool) -> str:
    """The contents bar: ``(anchor id, title)`` links, and the metric picker when the page has attack tables."""
    links = "".join(f'<a href="#{esc(anchor)}">{esc(title)}</a>' for anchor, title in entries)
    return f'<nav class="toc" aria-label="contents">{metric_labels() if picker else ""}<b>Contents:</b> {links}</nav>'


def collapsible(anchor: str, title: str, body: str, *, open: bool = True, level: int = 2, attrs: str = "") -> str:
    """A section that folds: ``<details id=anchor>`` whose summary is the heading ``title`` (plain text)."""
    cls = "section" if level == 2 else "part"
    ident = f' id="{esc(anchor)}"' if anchor else ""
    return (f'<details class="{cls}"{ident}{" open" if open else ""}{attrs}><summary><h{level}>{esc(title)}'
            f"</h{level}></summary>{body}</details>")


__all__ = ["PICKABLE", "METRIC_NAMES", "NAV_CSS", "metric_id", "metric_radios", "metric_labels", "per_metric",
           "contents_bar", "collapsible"]
