"""The findings box that opens every phase page: what the phase found, in sentences and headline numbers.

A phase closes with ``finish_phase(ctx, headline={...}, findings=[...])``; the page renders both at its top,
so a reader gets the answer before the method. Headline keys carry their unit as a suffix
(``p95_tpot_ms``, ``busy_pct``, ``busbw_gbps``); the box turns them into labelled values with the unit in
words and sensible precision. Everything is escaped.
"""
from __future__ import annotations

import html
import math
from typing import Any

import pandas as pd

from servelab.core.facts import Fact
from servelab.report.run_summary import phase_sources

# key suffix → unit shown (longest suffixes first)
UNITS: tuple[tuple[str, str], ...] = (
    ("_tok_per_s", "tok/s"), ("_tok_s", "tok/s"), ("_tps", "tok/s"), ("_rps", "req/s"), ("_per_s", "/s"),
    ("_tflops", "TFLOP/s"), ("_gbps", "GB/s"), ("_gib", "GiB"), ("_mib", "MiB"), ("_kib", "KiB"), ("_mb", "MB"),
    ("_gb", "GB"), ("_bytes", "bytes"), ("_mhz", "MHz"), ("_pct", "%"), ("_ms", "ms"), ("_us", "µs"),
    ("_ns", "ns"), ("_ps", "/s"), ("_s", "s"),
)
WORDS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E", "tps": "TPS", "kv": "KV", "slo": "SLO",
         "nccl": "NCCL", "gpu": "GPU", "cpu": "CPU", "p50": "P50", "p90": "P90", "p95": "P95", "p99": "P99",
         "cv": "CV", "pp": "PP", "tp": "TP", "ab": "A/B", "id": "id", "busbw": "bus bandwidth", "comm": "comm",
         "e2el": "E2E", "rss": "RSS", "mib": "MiB", "gib": "GiB", "c": "C"}


# names that hold a fraction in [0, 1]: every page shows them as a percentage (one unit per quantity across a run)
FRACTION_SUFFIXES = ("hit_rate", "acceptance_rate", "_fraction", "_frac", "_share")
FRACTION_KEYS = frozenset({"target_rate", "expected_rate", "kv_peak_active", "kv_usage", "kv_active"})


def is_fraction_key(name: Any) -> bool:
    n = "_".join(str(name).strip().lower().replace("(", " ").replace(")", " ").split())
    return (n.endswith(FRACTION_SUFFIXES) or n in FRACTION_KEYS) and "pct" not in n and "%" not in str(name)


STAT_SUFFIXES = frozenset({"mean", "max", "min", "median", "p50", "p90", "p95", "p99", "std", "sum", "total"})


def split_unit(key: str) -> tuple[str, str]:
    """``P1_p50_ttft_ms`` → (``P1 P50 TTFT``, ``ms``); a statistic after the unit moves before it:
    ``p95_tpot_increase_ms_mean`` → (``P95 TPOT increase mean``, ``ms``)."""
    head, _, stat = key.rpartition("_")
    if head and stat.lower() in STAT_SUFFIXES:
        label, unit = split_unit(head)
        if unit:
            return f"{label} {WORDS.get(stat.lower(), stat)}", unit
    unit = ""
    base = key
    for suffix, u in UNITS:
        if key.lower().endswith(suffix) and len(key) > len(suffix):
            base, unit = key[: -len(suffix)], u
            break
    base = base.replace("_per_s_", "/s_")                # median_tok_per_s_per_user → median tok/s per user
    words = [WORDS.get(w.lower(), w) for w in base.split("_") if w]
    return " ".join(words), unit


def format_value(value: Any) -> str:
    """Numbers to 3–4 significant digits, no Python reprs (None → —, bools → yes/no, lists joined)."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        a = abs(value)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{value:,.0f}"
        # three significant digits below 1, written out: 0.0000651, never 6.51e-05
        text = f"{value:.1f}" if a >= 100 else (f"{value:.2f}" if a >= 1 else
                                                f"{value:.{max(3, 2 - math.floor(math.log10(a)))}f}".rstrip("0"))
        if 1 <= a < 100 and value != round(value) and float(text) == round(value):
            return f"{value:.6g}"        # a value that is not whole never reads as a count (1.000244, not 1.00)
        return text
    if hasattr(value, "item"):              # numpy scalars
        return format_value(value.item())
    if isinstance(value, (list, tuple)):
        return ", ".join(format_value(v) for v in value) or "—"
    if isinstance(value, dict):
        return "; ".join(f"{k}: {format_value(v)}" for k, v in value.items()) or "—"
    return str(value)


def headline_rows(headline: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for key, value in headline.items():
        if isinstance(value, Fact):                # a number the phase gave with its source and samples
            value = value.stated()
        label, unit = split_unit(str(key))
        if is_fraction_key(key) and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and 0 <= value <= 1:
            value, unit = 100 * value, "%"
        text = format_value(value)
        numeric = isinstance(value, (int, float)) or hasattr(value, "item")
        rows.append((label, f"{text} {unit}".strip() if text != "—" and unit and numeric else text))
    return rows


SOURCE_STYLE = {"live": ("#e3f3e4", "#1b5e20", "Measured live"),
                "samples": ("#fff4ce", "#7a5c00", "Recorded sample data — not measured in this run"),
                "model": ("#ece6f6", "#4a2b7a", "Model only — nothing measured")}


def source_badge_html(phase_entry: dict[str, Any]) -> str:
    """Where the page's numbers come from, at its top: one badge per source (measured live on the target,
    recorded sample data, a model), each saying which (``report.run_summary.phase_sources``)."""
    rows = []
    for s in phase_sources(phase_entry):
        bg, fg, title = SOURCE_STYLE[s["kind"]]
        rows.append(f'<div class="servelab-source servelab-source-{html.escape(s["kind"])}" style="background:{bg};'
                    f'border-left:5px solid {fg};padding:4px 10px;margin:4px 0"><b style="color:{fg}">'
                    f'{html.escape(title)}</b>: {html.escape(str(s.get("what") or ""))}</div>')
    return "".join(rows)


def findings_html(phase_entry: dict[str, Any]) -> str:
    """The box: where its numbers come from (badges), the phase's finding sentences, then its headline numbers
    (labels and units in words)."""
    sentences = [s for s in phase_entry.get("findings") or [] if str(s).strip()]
    rows = headline_rows(phase_entry.get("headline") or {})
    if not sentences and not rows:
        return ""
    parts = ['<section class="servelab-findings" aria-label="findings">', source_badge_html(phase_entry),
             "<h2>Findings</h2>"]
    if phase_entry.get("from_samples") and not phase_entry.get("sources"):
        parts.append("<p><b>From recorded sample data</b>, not measured in this run.</p>")
    if sentences:
        parts.append("<ul>" + "".join(f"<li>{html.escape(str(s))}</li>" for s in sentences) + "</ul>")
    if rows:
        cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
        parts.append(f'<table class="servelab-headline">{cells}</table>')
    if phase_entry.get("not_executed"):
        parts.append("<p>Not executed: " + html.escape(", ".join(map(str, phase_entry["not_executed"]))) + "</p>")
    parts.append("</section>")
    return "".join(parts)


def headline_table(headline: dict[str, Any]) -> Any:
    """The headline as a two-column table for a notebook cell (what the findings box shows)."""
    return pd.DataFrame(headline_rows(headline), columns=["headline", "value"])


def ab_findings(ab: Any, metrics: dict[str, str] | None = None) -> list[str]:
    """Two sentences about an A/B (a ``servelab.measure.abtest.ABResult``): whether it is valid (one variable
    changed, or confounded / profiled-vs-clean: no conclusion), and its verdict per compared run and metric (Δ of
    the means against the baseline and whether it is outside the repeat-based noise band). ``metrics`` names the
    metrics to state (key → words); default: every metric compared."""
    out = []
    variable = ", ".join(ab.variable) or "(none declared)"
    if ab.confounded or ab.profiled_vs_clean:
        keys = ", ".join(list(ab.confounds["key"])[:5]) if not ab.confounds.empty else ""
        out.append(f"The A/B is not valid: besides {variable}, {len(ab.confounds)} other setting(s) changed"
                   + (f" ({keys})" if keys else "")
                   + (" and a profiled run is compared with a clean one" if ab.profiled_vs_clean else "")
                   + " — no conclusion about the variable.")
    else:
        comp = ab.comparison
        bad = comp[comp["verdict"] == "invalid"] if comp is not None and not comp.empty else None
        if bad is not None and not bad.empty:
            runs = ", ".join(dict.fromkeys(str(r) for r in bad["b_run"]))
            out.append(f"The A/B is not valid: only {variable} changed between the runs, but a compared case has an "
                       f"INVALID side ({runs}) — its changes are not a result.")
        else:
            out.append(f"The A/B is valid as a one-variable A/B: only {variable} changed between the runs.")
    comp = ab.comparison
    if comp is None or comp.empty:
        out.append("No case was compared: no A/B verdict.")
        return out
    parts = []
    for run, g in comp.groupby("b_run", sort=False):
        cases = []
        for case, gc in g.groupby("case_id", sort=False):
            items = []
            for r in gc.itertuples():
                if metrics is not None and r.metric not in metrics:
                    continue
                label = (metrics or {}).get(r.metric) or split_unit(r.metric)[0]
                if r.verdict == "invalid":         # an INVALID side's change is not a result: no number for it
                    items.append(f"{label} not compared (an INVALID side)")
                    continue
                delta = "" if r.delta_pct is None or math.isnan(r.delta_pct) else f" {r.delta_pct:+.1f} %"
                band = "" if r.noise_band_pct is None or math.isnan(r.noise_band_pct) \
                    else f", noise band ±{r.noise_band_pct:.1f} %"
                items.append(f"{label}{delta} ({r.verdict}{band})")
            if items:
                cases.append((f"{case} " if g["case_id"].nunique() > 1 else "") + ", ".join(items))
        if cases:
            parts.append(f"{run}: " + "; ".join(cases))
    base = (ab.runs[0].label or ab.runs[0].run_id) if getattr(ab, "runs", None) else "the baseline"
    text = f"A/B verdict against {base}: " + " — ".join(parts)
    if set(comp["verdict"]) <= {"no repeats", "no data"}:
        text += " (one repeat per side: the noise band is unknown, so no change is a verdict yet)"
    out.append(text + ".")
    return out
