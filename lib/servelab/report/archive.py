"""The archive: ``outputs/<run_id>/index.html`` (one investigation) and ``outputs/index.html`` (all runs).

Plain static HTML, no scripts, every value escaped; works opened from disk or from any static server.
"""
from __future__ import annotations

import html
import json
import zipfile
from pathlib import Path
from typing import Any, Iterable

from servelab.core.paths import outputs_root
from servelab.core.notebooks import NOTEBOOKS
from servelab.core.run import now_iso, read_manifest
from servelab.report.answers import stated_headline
from servelab.report.findings import headline_rows
from servelab.core.redact import MAX_SCRUB_BYTES, is_text_file, known_secrets, redact_file_bytes
from servelab.measure.case_record import read_summaries
from servelab.report.ledger import ledger
from servelab.report.milestones import milestones
from servelab.report.run_summary import BADGE_CLASS, SOURCE_KINDS, phase_sources
from servelab.report import run_summary as rs

CSS = """body{font-family:sans-serif;max-width:1100px;margin:20px auto;color:#222}
table{border-collapse:collapse;width:100%;margin:8px 0}th,td{border:1px solid #ddd;padding:6px 8px;text-align:left;
vertical-align:top}th{background:#f3f6fa}.ok{color:#2e7d32;font-weight:600}.bad{color:#c0392b;font-weight:600}
.run{color:#b58900;font-weight:600}.samples{background:#fff4ce;padding:1px 5px;border-radius:3px;font-size:.85em}
.badge{display:inline-block;padding:1px 6px;border-radius:3px;font-size:.8em;font-weight:600;margin:1px 2px 1px 0}
.badge-live{background:#e3f3e4;color:#1b5e20}.badge-samples{background:#fff4ce;color:#7a5c00}
.badge-model{background:#ece6f6;color:#4a2b7a}
.summary{background:#f3f8fd;border:1px solid #c9ddf0;border-left:6px solid #2e6da4;padding:6px 16px 10px;margin:8px 0 18px}
.summary h2{font-size:1.15em;margin:6px 0}.summary table{margin:4px 0}.summary th{width:9em}
.verdict-warning{border-left:4px solid #c0392b;padding-left:8px;margin:6px 0}
.verdict-ok{border-left:4px solid #2e7d32;padding-left:8px;margin:6px 0}
.verdict-info{border-left:4px solid #2e6da4;padding-left:8px;margin:6px 0}
a{color:#2e6da4}small{color:#666}"""


def _status_class(status: str) -> str:
    return {"success": "ok", "failed": "bad", "running": "run", "unsupported": "run"}.get(status, "")


def _headline(h: dict[str, Any]) -> str:
    """The phase's headline as the findings box shows it: labels and units in words, sensible precision."""
    return "<br>".join(f"{html.escape(k)}: <b>{html.escape(v)}</b>" for k, v in headline_rows(h or {}))


def source_badges(entry: dict[str, Any]) -> str:
    """The phase's data badges: measured live / recorded sample data / model only, each with what it is."""
    return "".join(f'<span class="badge badge-{BADGE_CLASS[s["kind"]]}" title="{html.escape(str(s.get("what", "")))}">'
                   f'{html.escape(SOURCE_KINDS[s["kind"]])}</span>' for s in phase_sources(entry))


def _summary_html(run_dir: Path) -> str:
    """The run summary that opens the index (``report.run_summary``): what ran where, where each phase's numbers
    come from, and the run-level verdicts with their evidence."""
    try:
        facts, sources, verdicts = rs.facts(run_dir), rs.sources_rows(run_dir), rs.verdicts(run_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:   # the index is still written; it says why
        return (f"<section class='summary' id='run-summary'><h2>Run summary</h2><p class='bad'>could not be built: "
                f"{html.escape(type(exc).__name__)}: {html.escape(str(exc))}</p></section>")
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in facts)
    for label, items in sources:
        if not items:
            continue
        kind = next(k for k, v in SOURCE_KINDS.items() if v == label)
        cells = "<br>".join(f'<a href="{html.escape(p)}/report.html">{html.escape(p)}</a>'
                            f"{' — ' + html.escape(w) if w else ''}" if (run_dir / p / "report.html").is_file()
                            else f"{html.escape(p)}{' — ' + html.escape(w) if w else ''}" for p, w in items)
        rows += (f'<tr><th><span class="badge badge-{BADGE_CLASS[kind]}">{html.escape(label)}</span></th>'
                 f"<td>{cells}</td></tr>")
    items = []
    for v in verdicts:
        ev = ", ".join(f'<a href="{_href(run_dir, href) or html.escape(href, quote=True)}">{html.escape(label)}</a>'
                       if href.startswith("#") or _href(run_dir, href) else html.escape(label)
                       for label, href in v.evidence)
        items.append(f'<div class="verdict-{html.escape(v.level)}">{html.escape(v.text)}'
                     + (f"<br><small>evidence: {ev}</small>" if ev else "") + "</div>")
    return ("<section class='summary' id='run-summary'><h2>Run summary</h2><table>" + rows + "</table>"
            + ("<h2>Verdicts for the whole run</h2>" + "".join(items) if items else "") + "</section>")


def _headline_note(entry: dict[str, Any]) -> str:
    """Above a headline whose numbers are not (all) measured on this target: whose numbers they are."""
    other = [s for s in phase_sources(entry) if s["kind"] != "live"]
    if not other:
        return ""
    return "".join(f'<small><span class="badge badge-{BADGE_CLASS[s["kind"]]}">{html.escape(SOURCE_KINDS[s["kind"]])}'
                   f"</span> {html.escape(str(s.get('what') or ''))}</small><br>" for s in other)


def write_run_index(run_dir: Path) -> Path:
    """``outputs/<run_id>/index.html``: the run summary, then the phases with status, data badges, headline
    numbers and links."""
    m = read_manifest(run_dir)
    rows = []
    for phase in sorted(m.get("phases", {}), key=lambda p: int(p[5:]) if p[5:].isdigit() else 99):
        e = m["phases"][phase]
        report = run_dir / phase / "report.html"
        link = (f'<a href="{html.escape(phase)}/report.html">{html.escape(phase)}</a>' if report.exists()
                else html.escape(phase))
        status = str(e.get("status", ""))
        samples = "<br>" + source_badges(e)
        not_exec = e.get("not_executed") or []
        why = (f"<br><small class='why'>{html.escape(str(e['error']))}</small>"
               if status != "success" and e.get("error") else "")
        headline = stated_headline(run_dir, e)          # each number as its recorded fact states it
        kept = e.get("kept_page") if isinstance(e.get("kept_page"), dict) else None
        if kept and report.exists():
            # a later attempt failed: the page linked is the last good one; the failed attempt's page beside it
            link += (f"<br><small>page of the last good attempt (ended {html.escape(str(kept.get('ended') or '-'))})"
                     "</small>")
            failed = e.get("failed_page")
            if failed and (run_dir / phase / str(failed)).is_file():
                link += (f'<br><small><a href="{html.escape(phase)}/{html.escape(str(failed), quote=True)}">'
                         f"page of the {html.escape(status)} attempt</a></small>")
            headline = headline or kept.get("headline") or {}
        rows.append(f"<tr><td>{link}<br><small>{html.escape(NOTEBOOKS.get(phase, ''))}</small></td>"
                    f'<td class="{_status_class(status)}">{html.escape(status)}{samples}{why}</td>'
                    f"<td><small>{html.escape(str(e.get('started', '')))}<br>{html.escape(str(e.get('ended', '')))}"
                    f"</small></td><td>{_headline_note(e)}{_headline(headline)}</td>"
                    f"<td>{html.escape(', '.join(map(str, not_exec))) or '-'}</td></tr>")
    tool = m.get("tool", {})
    body_ledger = _cases_html(run_dir) + _ledger_html(run_dir) + _milestones_html(run_dir) + _lessons_html(m)
    body = (f"<h1>servelab run {html.escape(m.get('run_id', run_dir.name))}</h1>" + _summary_html(run_dir) +
            f"<p>target <b>{html.escape(str(m.get('target', '')))}</b> · created {html.escape(str(m.get('created', '')))}"
            f" · servelab {html.escape(str(tool.get('version', '')))} @ {html.escape(str(tool.get('commit') or '-'))[:12]}"
            f"{' (dirty)' if tool.get('dirty') else ''} · <a href='manifest.json'>manifest.json</a>"
            f" · <a href='commands.jsonl'>commands.jsonl</a> · <a href='../index.html'>all runs</a></p>"
            "<table><tr><th>phase</th><th>status</th><th>started / ended</th><th>headline</th>"
            "<th>not executed</th></tr>" + "".join(rows) + "</table>" + body_ledger +
            f"<p><small>written {html.escape(now_iso())}</small></p>")
    out = run_dir / "index.html"
    out.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>servelab "
                   f"{html.escape(run_dir.name)}</title><style>{CSS}</style></head><body>{body}</body></html>")
    return out


STATUS_CLASS = {"supported": "bad", "refuted": "ok", "open": "", "inconclusive": "run", "contested": "run",
                "met": "ok", "not met": "bad", "not started": "", "pass": "ok", "fail": "bad", "not measured": ""}


def _href(run_dir: Path, rel: str) -> str | None:
    """``rel`` as an escaped href when it names a file inside the run folder (relative, no scheme, no ``..``,
    a page anchor allowed); ``None`` otherwise, so a missing table is never a dead link."""
    path, _, anchor = str(rel).partition("#")
    parts = Path(path).parts
    if not path or ":" in path or path.startswith(("/", "\\")) or ".." in parts:
        return None
    if not (run_dir / path).is_file():
        return None
    return html.escape(path + (f"#{anchor}" if anchor else ""), quote=True)


def _file_links(run_dir: Path, rels: list[str]) -> str:
    """Each file as a link named by its path in the run folder, or marked missing."""
    out = []
    for rel in rels:
        href = _href(run_dir, rel)
        out.append(f'<a href="{href}">{html.escape(rel)}</a>' if href
                   else f'<span class="bad">{html.escape(rel)} (missing)</span>')
    return ", ".join(out)


def _evidence_html(run_dir: Path, e: dict[str, Any]) -> str:
    """One piece of evidence: the phase (linked to the section of its page), the verdict, the summary, and the
    tables it rests on (linked to the files)."""
    href = _href(run_dir, e.get("link", ""))
    phase = html.escape(str(e.get("phase", "")))
    head = f'<a href="{href}">{phase}</a>' if href else phase
    sample = ' <span class="samples">recorded sample data</span>' if e.get("from_samples") else ""
    tables = e.get("tables") or []
    rests = f"<br><small>rests on: {_file_links(run_dir, tables)}</small>" if tables else ""
    return (f'{head}: <span class="{STATUS_CLASS.get(str(e.get("verdict")), "")}">{html.escape(str(e.get("verdict")))}'
            f"</span>{sample} — {html.escape(str(e.get('summary', '')))}{rests}")


def _ledger_html(run_dir: Path) -> str:
    df = ledger(run_dir)
    rows = []
    for _, r in df.iterrows():
        ev = "<br>".join(_evidence_html(run_dir, e) for e in r["evidence"])
        if r["status"] == "not applicable" or not ev:
            note = r["decided_by"] if r["status"] == "not applicable" else f"decided by: {r['decided_by']}"
            ev = f"<small>{html.escape(note)}</small>" + (f"<br>{ev}" if ev else "")
        rows.append(f"<tr><td>{html.escape(r['id'])}</td><td>{html.escape(r['hypothesis'])}"
                    f"<br><small>{html.escape(r['source'])}</small></td>"
                    f'<td class="{STATUS_CLASS.get(r["status"], "")}">{html.escape(r["status"])}</td><td>{ev}</td></tr>')
    return ("<h2>Investigation ledger</h2><p><small>supported = the bottleneck is real (act on it); refuted = "
            "ruled out with evidence; open = no evidence yet. Each piece of evidence links the section of the phase "
            "page and the tables it rests on; evidence from recorded sample data is never more than inconclusive "
            "for this target.</small></p><table><tr><th>id</th><th>hypothesis</th>"
            "<th>status</th><th>evidence</th></tr>" + "".join(rows) + "</table>")


def _cases_html(run_dir: Path) -> str:
    """Measured cases per phase from their summaries: how many, how many VALID, the INVALID ones with their first
    reason, the schema version; summaries that do not follow the case schema are listed as such."""
    errors: list[str] = []
    sums = read_summaries(run_dir, errors=errors)
    if not sums and not errors:
        return ""
    by_phase: dict[str, list[dict[str, Any]]] = {}
    for s in sums:
        by_phase.setdefault(s["phase"], []).append(s)
    rows = []
    for phase in sorted(by_phase, key=lambda p: int(p[5:]) if p[5:].isdigit() else 99):
        ss = by_phase[phase]
        bad = [s for s in ss if s["verdict"]["status"] != "VALID"]
        versions = ", ".join(sorted({str(s["schema_version"]) for s in ss}))
        listed = "<br>".join(f"{html.escape(s['case_id'])}: {html.escape('; '.join(s['verdict']['reasons'][:1]))}"
                             for s in bad[:8]) + (" …" if len(bad) > 8 else "")
        rows.append(f"<tr><td>{html.escape(phase)}</td><td>{len(ss)}</td><td class='ok'>{len(ss) - len(bad)}</td>"
                    f"<td class='{'bad' if bad else ''}'>{len(bad)}</td><td><small>{listed or '-'}</small></td>"
                    f"<td>{html.escape(versions)}</td></tr>")
    for e in errors[:8]:
        rows.append(f"<tr><td colspan='6' class='bad'><small>{html.escape(e)}</small></td></tr>")
    return ("<h2 id='measured-cases'>Measured cases</h2><p><small>From each case's "
            "<code>cases/&lt;case&gt;/summary.json</code>; a case "
            "is a result only when its verdict is VALID.</small></p><table><tr><th>phase</th><th>cases</th>"
            "<th>VALID</th><th>INVALID</th><th>INVALID cases (first reason)</th><th>summary schema</th></tr>"
            + "".join(rows) + "</table>")


def _milestones_html(run_dir: Path) -> str:
    rows = []
    for m in milestones(run_dir):
        checks = "<br>".join(f'<span class="{STATUS_CLASS.get(c.status, "")}">{html.escape(c.status)}</span> '
                             f"{html.escape(c.check)} <small>— {html.escape(c.detail)}"
                             + (f" · {_file_links(run_dir, c.tables)}" if c.tables else "") + "</small>"
                             for c in m.checks)
        rows.append(f"<tr><td>{html.escape(m.id)}</td><td>{html.escape(m.title)}</td>"
                    f'<td class="{STATUS_CLASS.get(m.status, "")}">{html.escape(m.status)}</td><td>{checks}</td></tr>')
    return ("<h2>Milestones</h2><table><tr><th>id</th><th>milestone</th><th>status</th><th>checks</th></tr>"
            + "".join(rows) + "</table>")


def _lessons_html(m: dict[str, Any]) -> str:
    """The archive rule (``docs/method.md#archive``): final successful experiments in the body; failed attempts compressed into a
    lessons section at the end (phase, when, what failed, with which parameters)."""
    failed = [a for a in m.get("attempts", []) if a.get("status") not in ("success", "unsupported")]
    if not failed:
        return ""
    def row(a: dict[str, Any]) -> str:
        not_run = a.get("not_executed")
        extra = (f"<br><small>not executed: {html.escape(', '.join(map(str, not_run)))}</small>" if not_run else "")
        params = html.escape(json.dumps(a.get("params", {}), ensure_ascii=False)[:300])
        page = a.get("page")
        if page and ".." not in Path(str(page)).parts and (Path(str(page)).suffix == ".html"):
            extra += f"<br><small><a href=\"{html.escape(str(page), quote=True)}\">its page</a></small>"
        when = a.get("started") or a.get("ended") or "—"          # an interrupted attempt may have no start
        return (f"<tr><td>{html.escape(str(a.get('phase', '')))}</td><td><small>{html.escape(str(when))}"
                f"</small></td><td class='bad'>{html.escape(str(a.get('status', '')))}</td>"
                f"<td>{html.escape(str(a.get('error') or '-'))}{extra}</td><td><small>{params}</small></td></tr>")
    rows = "".join(row(a)
                   for a in failed)
    return ("<h2 class='servelab-lessons'>Lessons — failed attempts (经验教训)</h2><p><small>Kept for the record; "
            "never evidence. The body above shows each phase's latest run.</small></p><table><tr><th>phase</th>"
            "<th>started</th><th>status</th><th>what failed</th><th>parameters</th></tr>" + rows + "</table>")


CACHE_PARTS = {"__pycache__", ".servelab_cache"}     # folders a bundle leaves out: caches, rebuilt on demand


def zip_run(run_dir: Path, out: Path | None = None, known: Iterable[str] | None = None) -> Path:
    """One shareable bundle of a run: pages, tables, manifest, commands, logs (no caches).

    Every text member enters the zip through :func:`servelab.core.redact.redact_file_bytes` — the last line of
    defence: ``known`` secret values (default: the process environment's) and anything that looks like a secret
    are replaced, whatever wrote the file."""
    known = tuple(known_secrets() if known is None else known)
    write_run_index(run_dir)
    out = out or run_dir.parent / f"{run_dir.name}.zip"
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for f in sorted(run_dir.rglob("*")):
            if f.is_file() and not f.is_symlink() and not CACHE_PARTS & set(f.parts) and f.suffix != ".parquet":
                arc = str(Path(run_dir.name) / f.relative_to(run_dir))
                if not is_text_file(f) or f.stat().st_size > MAX_SCRUB_BYTES:
                    z.write(f, arc)               # traces, images: binary, streamed as they are
                    continue
                info = zipfile.ZipInfo.from_file(f, arc)
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, redact_file_bytes(f.name, f.read_bytes(), known))
    return out


def write_root_index(root: Path | None = None) -> Path:
    """``outputs/index.html``: every run, newest first, with its phases and their status."""
    root = root or outputs_root()
    root.mkdir(parents=True, exist_ok=True)
    runs = []
    for d in root.iterdir():
        if d.is_dir() and (d / "manifest.json").exists():
            try:
                runs.append((d, json.loads((d / "manifest.json").read_text())))
            except json.JSONDecodeError:
                continue
    runs.sort(key=lambda x: x[1].get("created", ""), reverse=True)
    rows = []
    for d, m in runs:
        phases = " ".join(f'<span class="{_status_class(str(e.get("status", "")))}">{html.escape(p)}</span>'
                          for p, e in sorted(m.get("phases", {}).items()))
        rows.append(f'<tr><td><a href="{html.escape(d.name)}/index.html">{html.escape(d.name)}</a></td>'
                    f"<td>{html.escape(str(m.get('target', '')))}</td><td>{html.escape(str(m.get('created', '')))}</td>"
                    f"<td>{phases}</td></tr>")
    body = ("<h1>servelab archive</h1><table><tr><th>run</th><th>target</th><th>created</th><th>phases</th></tr>"
            + "".join(rows) + "</table>")
    out = root / "index.html"
    out.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>servelab archive</title>"
                   f"<style>{CSS}</style></head><body>{body}</body></html>")
    return out
