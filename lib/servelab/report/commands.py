"""The commands section of a phase page: executed / reproduce / planned, visibly distinct."""
from __future__ import annotations

import html
import re
from pathlib import Path

import pandas as pd
from IPython.display import HTML

from servelab.core.scope import RunScope
from servelab.core.run import FILL_IN, LABELS, CommandRecord, read_commands

LABEL_TEXT = {"executed": "EXECUTED", "reproduce": "REPRODUCE", "planned": "PLANNED — NOT EXECUTED"}
LABEL_HELP = {
    "executed": "ran in this run (host, working directory, exit code and log shown)",
    "reproduce": "equivalent commands a reader can re-run",
    "planned": "not executed in this run; never evidence",
}


def commands_frame(run_dir: Path, phase: str | None = None) -> pd.DataFrame:
    recs = read_commands(run_dir, phase)
    return pd.DataFrame([{"label": r.label, "title": r.title, "host": r.host, "command": r.shell(),
                          "exit_code": r.exit_code, "start": r.start, "log": r.log} for r in recs],
                        columns=["label", "title", "host", "command", "exit_code", "start", "log"])


def _block(r: CommandRecord) -> str:
    meta = [f"host {r.host}"]
    if r.cwd:
        meta.append(f"cwd {r.cwd}")
    if r.start:
        meta.append(f"start {r.start}")
    if r.exit_code is not None:
        meta.append(f"exit {r.exit_code}")
    if r.log:
        meta.append(f"log {r.log}")
    if r.note:
        meta.append(r.note)
    title = f"<b>{html.escape(r.title)}</b> " if r.title else ""
    shell = r.shell()
    fill = "".join(f'<div class="servelab-fill-in"><small>fill in: <code>{k}</code> — {html.escape(v)}</small></div>'
                   for k, v in FILL_IN.items() if re.search(rf"\b{k}\b", shell))
    return (f'<div class="servelab-cmd servelab-cmd-{r.label}"><span class="servelab-label servelab-label-{r.label}">'
            f'{LABEL_TEXT[r.label]}</span>{title}<small>{html.escape(" · ".join(meta))}</small>\n'
            f'{html.escape(shell)}</div>{fill}')


def commands_html(run_dir: Path, phase: str | None = None) -> str:
    """HTML of the phase's commands grouped by label (all text escaped)."""
    recs = read_commands(run_dir, phase)
    parts = ['<div class="servelab-commands"><h3>Commands of this phase</h3>']
    for label in LABELS:
        group = [r for r in recs if r.label == label]
        if not group:
            continue
        parts.append(f"<h4>{html.escape(LABEL_TEXT[label].title())} <small>({html.escape(LABEL_HELP[label])})</small></h4>")
        parts += [_block(r) for r in group]
    if not recs:
        parts.append("<p>No commands were recorded.</p>")
    parts.append("</div>")
    # inline styles for JupyterLab, where the page template's CSS is absent
    style = ("<style>.servelab-cmd{font-family:monospace;white-space:pre-wrap;word-break:break-all;padding:6px 8px;"
             "margin:4px 0;border-radius:4px}.servelab-cmd-executed{background:#eaf7ea;border-left:5px solid #2e7d32}"
             ".servelab-cmd-reproduce{background:#e8f1fb;border-left:5px solid #2e6da4}.servelab-cmd-planned"
             "{background:#f4f4f4;border:2px dashed #999;color:#555}.servelab-label{display:inline-block;"
             "font-family:sans-serif;font-weight:700;font-size:.75em;padding:1px 6px;border-radius:3px;"
             "margin-right:6px;color:#fff}.servelab-label-executed{background:#2e7d32}.servelab-label-reproduce"
             "{background:#2e6da4}.servelab-label-planned{background:#888}</style>")
    return style + "".join(parts)


def show_commands(ctx: RunScope) -> HTML:
    """The commands section for a phase notebook."""
    return HTML(commands_html(ctx.run_dir, ctx.phase))
