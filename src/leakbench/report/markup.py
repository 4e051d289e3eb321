"""HTML building blocks of the report: escaping, numbers (never "nan"), tables, file names, image tags."""
from __future__ import annotations

import hashlib
import html
import math
import numbers
import re
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Sequence

#: what a missing or non-finite number is printed as.
MISSING = "–"


def esc(value: Any) -> str:
    """``value`` as HTML text (quotes escaped too, so it is safe in attributes)."""
    return html.escape(str(value), quote=True)


def num(value: Any, digits: int = 3) -> str:
    """A number with ``digits`` decimals; None, NaN and ±inf print as "–" (never "nan"); no "-0.000"."""
    if value is None or isinstance(value, bool):
        return MISSING
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        if not math.isfinite(value):
            return MISSING
        return f"{0.0 if abs(value) < 0.5 * 10 ** -digits else value:.{digits}f}"
    return esc(value)


def pct(value: Any, digits: int = 1) -> str:
    """A fraction as a percentage ("–" when missing or non-finite)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        return MISSING
    return f"{100 * float(value):.{digits}f} %"


def hover(text: str, title: str) -> str:
    """``text`` (already HTML) with ``title`` (plain text) shown on hover."""
    return f'<span title="{esc(title)}">{text}</span>'


def cell_html(cell: Any, *, left: bool = False, tag: str = "td") -> str:
    """A cell: HTML text or a ``(html, css_class)`` pair or ``(html, css_class, extra_attributes)``."""
    if isinstance(cell, tuple):
        text, cls, *extra = cell
    else:
        text, cls, extra = cell, "", []
    cls = " ".join(c for c in (cls, "l" if left else "") if c)
    attrs = (f' class="{cls}"' if cls else "") + "".join(f" {a}" for a in extra)
    return f"<{tag}{attrs}>{text}</{tag}>"


def table(header: Sequence[Any], rows: Iterable[Sequence[Any]], *, left: int = 1, head_html: str = "",
          css: str = "") -> str:
    """A table; header strings are escaped here, row cells are already HTML (see :func:`cell_html`).

    ``head_html`` replaces the generated header row (for grouped headers).
    """
    head = head_html or "<tr>" + "".join(cell_html(esc(h), left=i < left, tag="th")
                                         for i, h in enumerate(header)) + "</tr>"
    body = "".join("<tr>" + "".join(cell_html(c, left=i < left) for i, c in enumerate(row)) + "</tr>"
                   for row in rows)
    cls = f' class="{css}"' if css else ""
    return f"<table{cls}><thead>{head}</thead><tbody>{body}</tbody></table>"


def slug(*parts: Any) -> str:
    """A file-name-safe join of ``parts``, unique per ``parts`` (a short hash of them ends it)."""
    raw = "\x00".join(str(p) for p in parts)
    digest = hashlib.sha256(raw.encode()).hexdigest()
    clean = re.sub(r"[^A-Za-z0-9.]+", "-", "_".join(str(p) for p in parts)).strip("-.")[:100]
    return f"{clean}-{digest[:6]}" if clean else digest[:12]


def img(path: Path, root: Path, alt: str) -> str:
    return f'<img src="{esc(path.relative_to(root).as_posix())}" alt="{esc(alt)}">'


def figure(path: Path, root: Path, caption: str) -> str:
    return f"<figure>{img(path, root, caption)}<figcaption>{esc(caption)}</figcaption></figure>"


def muted(text_html: str) -> str:
    return f'<p class="muted">{text_html}</p>'


__all__ = ["MISSING", "esc", "num", "pct", "hover", "cell_html", "table", "slug", "img", "figure", "muted"]
