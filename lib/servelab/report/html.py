"""Render an executed phase notebook to a teaching HTML page with the servelab template (offline).

Notebook markdown links to the project's documentation as ``../docs/<file>.md#<anchor>`` (a path that works in
a clone, where ``notebooks/`` sits next to ``docs/``). A rendered page lives at ``<run>/<phase>/report.html``, so
the documents are published into ``<run>/docs/`` — as Markdown and as offline HTML — and the page's links are
rewritten to the HTML (``../docs/<file>.html#<anchor>``): the same relative path resolves, the archive stays
self-contained.
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable

import mistune
import nbformat
from nbconvert import HTMLExporter

from servelab.core.paths import project_root
from servelab.core.redact import known_secrets, redact, redact_html, scrub_notebook_node
from servelab.core.run import now_iso
from servelab.report.commands import commands_html
from servelab.report.answers import stated_headline
from servelab.report.findings import findings_html

TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
# plotly's notebook renderer always adds a MathJax <script src="https://cdnjs..."> to each figure; our figures use
# no LaTeX, and a shared page must not reach the network: external scripts are dropped from outputs
EXTERNAL_SCRIPT_RE = re.compile(r'<script[^>]*\ssrc="https?://[^"]*"[^>]*>\s*</script>', re.IGNORECASE)
# ](../docs/method.md#rules) in a notebook, ](metrics.md#ttft) inside a document
DOCS_LINK_RE = re.compile(r"\]\(\.\./docs/([A-Za-z0-9_-]+)\.md(#[A-Za-z0-9_-]*)?\)")
SIBLING_DOC_LINK_RE = re.compile(r"\]\(([A-Za-z0-9_-]+)\.md(#[A-Za-z0-9_-]*)?\)")
DOC_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>servelab — {title}</title>
<style>
  body {{ font-family: sans-serif; max-width: 1100px; margin: 0 auto; padding: 12px; line-height: 1.45; }}
  table {{ border-collapse: collapse; margin: 8px 0; }}
  th, td {{ border: 1px solid #ccc; padding: 3px 6px; vertical-align: top; }}
  code, pre {{ background: #f5f5f5; }} pre {{ padding: 8px; overflow-x: auto; }}
  a {{ color: #2e6da4; }}
</style></head>
<body><p><small>servelab documentation · <a href="../index.html">run index</a></small></p>
{body}
</body></html>
"""


def docs_html_links(markdown: str) -> str:
    """``](../docs/<file>.md#a)`` → ``](../docs/<file>.html#a)``: the published HTML next to the pages."""
    return DOCS_LINK_RE.sub(lambda m: f"](../docs/{m[1]}.html{m[2] or ''})", markdown)


def publish_docs(run_dir: Path, docs_dir: Path | None = None) -> list[Path]:
    """Write every ``docs/*.md`` of the project into ``<run_dir>/docs/`` as the Markdown itself and as an offline
    HTML page (links between documents rewritten to the HTML). Returns the HTML files; none without a docs folder."""
    src = Path(docs_dir) if docs_dir is not None else project_root() / "docs"
    if not src.is_dir():
        return []
    out_dir = Path(run_dir) / "docs"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for md in sorted(p for p in src.glob("*.md") if not p.name.startswith(".")):
        text = md.read_text(encoding="utf-8")
        shutil.copyfile(md, out_dir / md.name)
        body = mistune.html(SIBLING_DOC_LINK_RE.sub(lambda m: f"]({m[1]}.html{m[2] or ''})", text))
        out = out_dir / f"{md.stem}.html"
        out.write_text(DOC_PAGE.format(title=html.escape(md.stem), body=body), encoding="utf-8")
        written.append(out)
    return written


def render_notebook(executed: Path, out_html: Path, meta: dict[str, Any], known: Iterable[str] | None = None) -> Path:
    """Write ``out_html`` from the executed notebook; ``meta`` (run_id, phase, target, status, title) goes
    to the page header. Secrets are redacted (:mod:`servelab.core.redact`: ``known`` values — default the process
    environment's — and anything that looks like one) in every cell and output, and once more on the finished
    page; nbconvert escapes the rest."""
    known = tuple(known_secrets() if known is None else known)
    nb = scrub_notebook_node(nbformat.read(str(executed), as_version=4), known)
    meta = redact(meta, known)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = docs_html_links(cell.source)
        if cell.cell_type == "code":
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                if "text/html" in data:
                    text = "".join(data["text/html"]) if isinstance(data["text/html"], list) else data["text/html"]
                    data["text/html"] = EXTERNAL_SCRIPT_RE.sub("", text)
    phase_dir = out_html.parent
    entry = json.loads((phase_dir / "phase.json").read_text()) if (phase_dir / "phase.json").exists() else {}
    phase = meta.get("phase") or phase_dir.name
    nb.metadata["servelab"] = {**meta, "rendered": now_iso(),
                               # built here, escaped by their builders: the findings open the page, the commands
                               # section closes it — on every page, whatever the notebook holds
                               "findings_html": findings_html({**entry, "headline": stated_headline(phase_dir.parent,
                                                                                                     entry)}),
                               "commands_html": commands_html(phase_dir.parent, phase)}
    exporter = HTMLExporter(template_name="servelab", extra_template_basedirs=[str(TEMPLATES)])
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": meta.get("title", executed.stem)}})
    out_html.parent.mkdir(parents=True, exist_ok=True)
    out_html.write_text(redact_html(body, known), encoding="utf-8")
    publish_docs(out_html.parent.parent)          # <run>/<phase>/report.html → <run>/docs/
    return out_html


LATER_FAILURE_START, LATER_FAILURE_END = "<!-- servelab:later-failure -->", "<!-- /servelab:later-failure -->"


def later_failure_html(when: str, status: str, reason: str, page: str | None) -> str:
    """The banner a kept good page carries once a later attempt failed: when, how, why and where its page is."""
    what = "was interrupted" if status == "interrupted" else "failed"
    link = (f' (page: <a href="{html.escape(page, quote=True)}">{html.escape(page)}</a>)' if page else "")
    return (f'{LATER_FAILURE_START}<div class="servelab-later-failure" role="alert" style="background:#fde2e1;'
            f'border-left:6px solid #c0392b;padding:10px 14px;margin:8px 0;font-family:sans-serif">'
            f'<b>A later attempt at {html.escape(when)} {what}:</b> {html.escape(reason or status)}{link}'
            f'<br><small>This page is the last good attempt of this phase, kept as it was.</small></div>'
            f'{LATER_FAILURE_END}')


def mark_later_failure(page: Path, when: str, status: str, reason: str, failed_page: str | None) -> Path:
    """Put (or replace) the later-failure banner at the top of the rendered page ``page`` (after its header),
    leaving the rest of the page as it was rendered."""
    text = page.read_text(encoding="utf-8")
    banner = later_failure_html(when, status, reason, failed_page)
    start, end = text.find(LATER_FAILURE_START), text.find(LATER_FAILURE_END)
    if start >= 0 and end > start:
        text = text[:start] + banner + text[end + len(LATER_FAILURE_END):]
    else:
        at = text.find("</header>")
        at = at + len("</header>") if at >= 0 else max(text.find(">", text.find("<body")) + 1, 0)
        text = text[:at] + banner + text[at:]
    tmp = page.with_name(f".{page.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, page)
    return page
