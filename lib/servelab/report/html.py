"""Render an executed phase notebook to a teaching HTML page with the servelab template (offline)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import nbformat

from servelab.core.run import now_iso, redact_text
from servelab.report.commands import commands_html
from servelab.report.findings import findings_html

TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
# plotly's notebook renderer always adds a MathJax <script src="https://cdnjs..."> to each figure; our figures use
# no LaTeX, and a shared page must not reach the network: external scripts are dropped from outputs
EXTERNAL_SCRIPT_RE = re.compile(r'<script[^>]*\ssrc="https?://[^"]*"[^>]*>\s*</script>', re.IGNORECASE)


def render_notebook(executed: Path, out_html: Path, meta: dict[str, Any]) -> Path:
    """Write ``out_html`` from the executed notebook; ``meta`` (run_id, phase, target, status, title) goes
    to the page header. Secrets that slipped into outputs are redacted; nbconvert escapes the rest."""
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(executed), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = redact_text(cell.source)
            for out in cell.get("outputs", []):
                if "text" in out:
                    out["text"] = redact_text(out["text"])
                data = out.get("data", {})
                if "text/html" in data:
                    html = "".join(data["text/html"]) if isinstance(data["text/html"], list) else data["text/html"]
                    data["text/html"] = EXTERNAL_SCRIPT_RE.sub("", redact_text(html))
    phase_dir = out_html.parent
    entry = json.loads((phase_dir / "phase.json").read_text()) if (phase_dir / "phase.json").exists() else {}
    phase = meta.get("phase") or phase_dir.name
    nb.metadata["servelab"] = {**meta, "rendered": now_iso(),
                               # built here, escaped by their builders: the findings open the page, the commands
                               # section closes it — on every page, whatever the notebook holds
                               "findings_html": findings_html(entry),
                               "commands_html": commands_html(phase_dir.parent, phase)}
    exporter = HTMLExporter(template_name="servelab", extra_template_basedirs=[str(TEMPLATES)])
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": meta.get("title", executed.stem)}})
    out_html.parent.mkdir(parents=True, exist_ok=True)
    out_html.write_text(body, encoding="utf-8")
    return out_html
