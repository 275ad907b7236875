"""Visible notices on a phase page (sample data, planned commands, invalid results)."""
from __future__ import annotations

import html

from IPython.display import HTML

STYLES = {
    "samples": ("#fff4ce", "#b58900", "Recorded sample data"),
    "warning": ("#fde2e1", "#c0392b", "Warning"),
    "info": ("#e8f1fb", "#2e6da4", "Note"),
}


def banner_html(text: str, kind: str = "samples", title: str | None = None) -> str:
    """An HTML block (escaped) that stands out on the rendered page; ``kind`` is samples | warning | info."""
    bg, fg, default_title = STYLES[kind]
    return (f'<div class="servelab-banner servelab-banner-{kind}" style="background:{bg};border-left:6px solid {fg};'
            f'padding:10px 14px;margin:8px 0;font-family:sans-serif"><b style="color:{fg}">'
            f'{html.escape(title or default_title)}</b><br>{html.escape(text)}</div>')


def sample_banner(text: str) -> HTML:
    """Say, on the page, that this phase shows recorded data from ``data/samples/`` and not a live run."""
    return HTML(banner_html(text, "samples", "Recorded sample data — not measured in this run"))


def banner(text: str, kind: str = "info", title: str | None = None) -> HTML:
    return HTML(banner_html(text, kind, title))
