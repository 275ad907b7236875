"""Headless Chromium screenshots of rendered pages (Debian's chromium; no browser download)."""
from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
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


# ---------------------------------------------------------------- a live page, driven over the DevTools protocol

class DevTools:
    """Headless Chromium driven over the DevTools protocol through a pipe (``--remote-debugging-pipe``: no port
    is opened, nothing is downloaded): one page, real mouse and key events, scripts evaluated in the page, and
    the page's uncaught exceptions and console errors collected in :attr:`errors`.

        with DevTools(width=1400, height=1000) as page:
            page.navigate("http://127.0.0.1:8888/lab?token=…")
            page.wait_for("document.querySelector('.jp-Notebook') !== null", 60)
            page.click_at(*page.center(".jp-MenuBar-item"))

    The browser and its profile folder are removed on exit, whatever happened.
    """

    def __init__(self, width: int = 1400, height: int = 1000):
        self.width, self.height = width, height
        self.errors: list[str] = []
        self._next = 0
        self._replies: dict[int, dict] = {}
        self._cond = None
        self.proc = None

    def __enter__(self) -> "DevTools":
        self._profile = tempfile.TemporaryDirectory(prefix="servelab-chromium-")
        self.profile = self._profile.name           # in the browser's command line: how its processes are found
        self.log = Path(self._profile.name) / "chromium.log"

        def above_9(fd: int) -> int:      # bash's `3<&N 4>&M` below must not clobber one with the other
            high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
            os.close(fd)
            return high
        r, self._to_browser = os.pipe()
        self._from_browser, w = os.pipe()
        to_browser_r, from_browser_w = above_9(r), above_9(w)
        args = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-extensions", "--disable-default-apps", "--no-default-browser-check",
                f"--user-data-dir={self._profile.name}", f"--window-size={self.width},{self.height}",
                "--remote-debugging-pipe", "about:blank"]
        # the protocol pipe is fds 3 (commands in) and 4 (replies out) of the browser
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w} '
                                          f'{to_browser_r}<&- {from_browser_w}>&-', "bash", *args],
                                         pass_fds=(to_browser_r, from_browser_w), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            for domain in ("Page", "Runtime"):
                self.call(f"{domain}.enable")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            try:
                self.call("Browser.close", _timeout=10, _session=False)
            except AssertionError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            try:                      # the group: the browser and any helper process that outlived it
                os.killpg(self.proc.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait(10)
            self._reader.join(10)
        for fd in (getattr(self, "_to_browser", None), getattr(self, "_from_browser", None)):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._profile.cleanup()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_browser, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cond:
                    tail = self.log.read_text(errors="replace")[-1500:] if self.log.is_file() else ""
                    self._replies[-1] = {"error": {"message": f"the browser closed the protocol pipe: {tail}"}}
                    self._cond.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._cond:
                        self._replies[msg["id"]] = msg
                        self._cond.notify_all()
                elif msg.get("method") == "Runtime.exceptionThrown":
                    d = msg["params"]["exceptionDetails"]
                    self.errors.append("uncaught: " + ((d.get("exception") or {}).get("description") or d.get("text", ""))
                                       .splitlines()[0])
                elif msg.get("method") == "Runtime.consoleAPICalled" and msg["params"].get("type") == "error":
                    self.errors.append("console.error: " + " ".join(
                        str(a.get("value", a.get("description", ""))) for a in msg["params"].get("args", []))[:500])

    def call(self, method: str, _timeout: float = 60, _session: bool = True, **params) -> dict:
        """One protocol command; its result, or AssertionError with the browser's error."""
        self._next += 1
        mid = self._next
        msg = {"id": mid, "method": method, "params": params}
        if _session and getattr(self, "session", None):
            msg["sessionId"] = self.session
        try:
            os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        except BrokenPipeError:
            raise AssertionError(f"{method}: the browser is gone: {self.log.read_text(errors='replace')[-1500:]}") from None
        deadline = time.monotonic() + _timeout
        with self._cond:
            while mid not in self._replies and -1 not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{method}: no reply from the browser in {_timeout:.0f} s")
                self._cond.wait(left)
            reply = self._replies.pop(mid, None) or self._replies[-1]
        if "error" in reply:
            raise AssertionError(f"{method}: {reply['error'].get('message')} {reply['error'].get('data', '')}")
        return reply.get("result", {})

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def eval(self, expression: str, timeout: float = 60):
        """``expression`` evaluated in the page (promises awaited); its value (JSON-able)."""
        r = self.call("Runtime.evaluate", _timeout=timeout, expression=expression, returnByValue=True,
                      awaitPromise=True)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise AssertionError(f"in the page: {(d.get('exception') or {}).get('description') or d.get('text')}")
        return r.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float, what: str = "") -> object:
        """Poll ``expression`` until it is truthy; its value. AssertionError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {timeout:.0f} s for {what or expression}")
            time.sleep(0.25)

    def center(self, selector: str, text: str | None = None) -> tuple[float, float]:
        """The centre of the first visible element matching ``selector`` (and whose text is ``text``), scrolled
        into view; AssertionError when there is none."""
        at = self.eval(f"""(() => {{
          const want = {json.dumps(text)};
          for (const el of document.querySelectorAll({json.dumps(selector)})) {{
            if (want !== null && el.innerText.trim() !== want) continue;
            el.scrollIntoView({{block: 'center', inline: 'center'}});
            const r = el.getBoundingClientRect();
            if (r.width && r.height) return [r.left + r.width / 2, r.top + r.height / 2];
          }}
          return null; }})()""")
        if not at:
            raise AssertionError(f"no visible {selector}" + (f" with text {text!r}" if text else ""))
        return at[0], at[1]

    def mouse(self, kind: str, x: float, y: float) -> None:
        self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left",
                  buttons=0 if kind == "mouseReleased" else 1, clickCount=1)

    def click_at(self, x: float, y: float) -> None:
        """A left click as a person makes it: move there, press, release."""
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        self.mouse("mousePressed", x, y)
        self.mouse("mouseReleased", x, y)

    def drag(self, x0: float, y0: float, x1: float, y1: float, steps: int = 8) -> None:
        """Press at (x0, y0), move in ``steps`` to (x1, y1), release."""
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x0, y=y0)
        self.mouse("mousePressed", x0, y0)
        for i in range(1, steps + 1):
            self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x0 + (x1 - x0) * i / steps,
                      y=y0 + (y1 - y0) * i / steps, button="left", buttons=1)
        self.mouse("mouseReleased", x1, y1)

    KEYS = {"ArrowDown": 40, "ArrowUp": 38, "Enter": 13, "Escape": 27, "Home": 36, "End": 35}

    def key(self, key: str) -> None:
        """One key press (keyDown, keyUp) to the focused element: ``ArrowDown``, ``Enter``, …"""
        code = self.KEYS[key]
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key, windowsVirtualKeyCode=code,
                      nativeVirtualKeyCode=code)

    def screenshot(self, name: str) -> Path:
        """The page as a PNG in test-artifacts/screenshots/."""
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        out = ARTIFACTS / f"{name}.png"
        out.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return out
