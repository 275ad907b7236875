"""Headless Chromium screenshots of rendered pages (Debian's chromium; no browser download)."""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts" / "screenshots"


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(page: Path, name: str, width: int = 1200, height: int = 2400) -> Path:
    """Render ``page`` (file://) in headless Chromium with JS time to draw; returns the PNG path."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    out = ARTIFACTS / f"{name}.png"
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", "--hide-scrollbars", f"--window-size={width},{height}",
                        "--virtual-time-budget=10000", f"--screenshot={out}", page.resolve().as_uri()],
                       check=True, capture_output=True, timeout=120)
    return out


def content_fraction(png: Path) -> float:
    """Fraction of pixels that are not the page background (white): a blank page gives ~0."""
    from PIL import Image
    img = Image.open(png).convert("L")
    hist = img.histogram()
    return 1.0 - sum(hist[250:]) / float(img.width * img.height)


def dom_text(page: Path) -> str:
    """The page's DOM after scripts ran (``--dump-dom``)."""
    with tempfile.TemporaryDirectory() as profile:
        p = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                            "--no-first-run", "--disable-background-networking", "--disable-component-update",
                            "--disable-sync", f"--user-data-dir={profile}", "--virtual-time-budget=10000",
                            "--dump-dom", page.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    return p.stdout


# what a page must hold once its scripts ran, measured in the browser (layout included): the findings box right
# after the header, the rendered text (for Python reprs), the commands section, and every visible table either
# inside a scrolling container or no wider than its container (nothing cut off)
CHECK_SCRIPT = """<script>
window.addEventListener('load', function () { setTimeout(function () {
  var r = {};
  var header = document.querySelector('header.servelab-header');
  var first = header ? header.nextElementSibling : null;
  r.first_after_header = first ? (first.tagName.toLowerCase() + '.' + first.className) : null;
  r.findings_first = !!(first && first.matches('section.servelab-findings'));
  var box = document.querySelector('section.servelab-findings');
  r.findings_items = box ? box.querySelectorAll('li, table.servelab-headline tr').length : 0;
  r.findings_sentences = box ? box.querySelectorAll('li').length : 0;
  r.findings_text = box ? box.innerText : '';
  r.text = document.body.innerText;
  r.commands = document.querySelectorAll('#commands .servelab-cmd-executed, #commands .servelab-cmd-reproduce').length;
  var view = document.documentElement.clientWidth;
  function ov(el) { return getComputedStyle(el).overflowX; }
  r.tables = 0; r.cut = [];
  document.querySelectorAll('table').forEach(function (t, i) {
    var box = t.getBoundingClientRect();
    if (!box.width || t.offsetParent === null && getComputedStyle(t).position !== 'fixed') return;   // not drawn
    r.tables += 1;
    var ok = false, el = t;
    while (el && el !== document.body) {
      var o = ov(el);
      if (o === 'auto' || o === 'scroll') { ok = el.getBoundingClientRect().right <= view + 1; break; }
      if ((o === 'hidden' || o === 'clip') && el.scrollWidth > el.clientWidth + 1) break;
      el = el.parentElement;
    }
    if (!ok) ok = t.scrollWidth <= t.parentElement.clientWidth + 1 && box.right <= view + 1;
    if (!ok) r.cut.push({index: i, head: (t.innerText || '').slice(0, 80), width: t.scrollWidth,
                         container: t.parentElement.clientWidth});
  });
  // what a reader sees of each table: its headers and cells as text, its caption, and whether it fits the page
  // without scrolling (a table wider than its container is clipped at this width, scroll bar or not)
  r.grid = [];
  document.querySelectorAll('table').forEach(function (t) {
    var box = t.getBoundingClientRect();
    if (!box.width || t.offsetParent === null) return;
    var heads = Array.from(t.querySelectorAll('thead th')).map(function (h) { return h.innerText.trim(); });
    var rows = Array.from(t.querySelectorAll('tbody tr')).map(function (tr) {
      return Array.from(tr.children).map(function (c) { return c.innerText.trim(); }); });
    var over = t.scrollWidth > t.clientWidth + 1, el = t.parentElement;
    while (el && el !== document.body) {
      if (el.scrollWidth > el.clientWidth + 1 && getComputedStyle(el).overflowX !== 'visible') over = true;
      el = el.parentElement;
    }
    if (box.right > view + 1) over = true;
    var wrap = t.closest('.servelab-table');
    var cap = wrap ? wrap.querySelector('.servelab-caption') : null;
    r.grid.push({heads: heads, rows: rows.slice(0, 400), clipped: over, width: Math.round(t.scrollWidth),
                 caption: cap ? cap.innerText : '', in_findings: !!t.closest('section.servelab-findings')});
  });
  r.cmds = Array.from(document.querySelectorAll('#commands .servelab-cmd')).map(function (c) { return c.innerText; });
  r.sources = Array.from(document.querySelectorAll('section.servelab-findings .servelab-source')).map(
    function (c) { return c.className; });
  var pre = document.createElement('pre');
  pre.id = 'servelab-page-check';
  pre.textContent = JSON.stringify(r);
  document.body.appendChild(pre);
}, 0); });
</script>"""


def page_checks(page: Path, width: int = 1400, height: int = 1600) -> dict:
    """Load ``page`` in headless Chromium (a copy with :data:`CHECK_SCRIPT` added) and return what the script
    measured: ``findings_first``, ``findings_items`` (sentences and headline rows), ``findings_sentences``,
    ``findings_text``, ``text`` (the rendered text),
    ``commands`` (executed/reproduce entries in ``#commands``), ``tables`` and ``cut`` (tables cut off)."""
    import html as htmllib
    import json
    import re
    src = page.read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / page.name
        copy.write_text(src.replace("</body>", CHECK_SCRIPT + "</body>", 1), encoding="utf-8")
        with tempfile.TemporaryDirectory() as profile:
            p = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                                "--disable-sync", f"--user-data-dir={profile}", f"--window-size={width},{height}",
                                "--virtual-time-budget=10000", "--dump-dom", copy.resolve().as_uri()],
                               capture_output=True, text=True, timeout=180)
    m = re.search(r'<pre id="servelab-page-check">(.*?)</pre>', p.stdout, re.S)
    if not m:
        raise AssertionError(f"{page}: the check script did not run (chromium rc {p.returncode}: {p.stderr[-500:]})")
    return json.loads(htmllib.unescape(m.group(1)))


REPRS = ("np.float64(", "{'", "Timestamp(")       # Python reprs that must never reach a page


def assert_page_rules(page: Path) -> dict:
    """The rules every phase page keeps, checked in the browser: the findings box is the first block after the
    header and holds sentences; no Python repr in the rendered text; the commands section has an executed or
    reproduce entry; no table is cut off. Returns the measurements."""
    r = page_checks(page)
    assert r["findings_first"], f"{page}: the first block after the header is {r['first_after_header']}"
    assert r["findings_sentences"] > 0 and r["findings_text"].strip(), f"{page}: the findings box is empty"
    for pattern in REPRS:
        at = r["text"].find(pattern)
        assert at < 0, f"{page}: {pattern!r} on the page: …{r['text'][max(0, at - 120):at + 120]}…"
    assert r["commands"] >= 1, f"{page}: no executed or reproduce command in #commands"
    assert r["cut"] == [], f"{page}: tables cut off: {r['cut']}"
    return r


# a whole-cell Python repr, a repr inside text, a placeholder inside a command
CELL_REPRS = {"True", "False", "None", "nan", "NaN", "NaT", "<NA>", "[]", "{}"}
TEXT_REPR_RE = re.compile(r"np\.(float|int)\d*\(|\{'|Timestamp\(|\bdtype[:=]|\bNone\b(?=[,)\]:])|=None\b|=True\b|=False\b")
PLACEHOLDER_RE = re.compile(r"<[A-Za-z_][^<>\s]*>")
COUNT_AS_FLOAT_RE = re.compile(r"^-?\d[\d,]*\.0+$")


def table_problems(r: dict) -> list[str]:
    """What a reader would trip on in the page's tables (from :func:`page_checks`): a table clipped at the page's
    width, a count shown as ``N.00`` (a column without a unit whose every value is whole but printed with
    decimals), a Python repr as a cell, in a header or in a caption."""
    out = []
    for i, t in enumerate(r.get("grid", [])):
        name = (t["caption"] or " | ".join(t["heads"][:4]))[:80]
        if t["clipped"]:
            out.append(f"table {i} ({name}) clipped: {t['width']} px wide")
        cols = list(zip(*t["rows"])) if t["rows"] and all(len(x) == len(t["rows"][0]) for x in t["rows"]) else []
        for j, col in enumerate(cols):
            head = t["heads"][j] if j < len(t["heads"]) else ""
            vals = [v for v in col if v not in ("", "—", "-")]
            if vals and "(" not in head and all(COUNT_AS_FLOAT_RE.match(v) for v in vals):
                out.append(f"table {i} ({name}) column {head!r}: counts as decimals ({vals[:3]})")
        for cell in [*t["heads"], *(c for row in t["rows"] for c in row)]:
            if cell in CELL_REPRS:
                out.append(f"table {i} ({name}): Python repr {cell!r} as a cell")
                break
        for text in (t["caption"], *t["heads"]):
            if TEXT_REPR_RE.search(text or ""):
                out.append(f"table {i} ({name}): Python repr in {text[:80]!r}")
    return out


def command_problems(r: dict) -> list[str]:
    """Commands on the page that cannot be pasted: a ``<placeholder>`` in a command of the commands section or in
    a table column named command."""
    out = [f"placeholder in command: {c[:160]!r}" for c in r.get("cmds", []) if PLACEHOLDER_RE.search(c)]
    for t in r.get("grid", []):
        for j, head in enumerate(t["heads"]):
            if "command" in head.lower():
                for row in t["rows"]:
                    if j < len(row) and PLACEHOLDER_RE.search(row[j]):
                        out.append(f"placeholder in a command cell: {row[j][:160]!r}")
    return out
