"""The explorer as a person uses it: `jupyter lab` on 127.0.0.1, `notebooks/explore_run.ipynb` opened in headless
Chromium, Run All, then a case, a capture, a rank and a window picked with real mouse and key events — and what
JupyterLab draws read back from the page.

The run it explores is made here: Phase 1's P1 and D1 on the tiny engine (a real llama-server) and Phase 3 over a
read-only copy of the recorded 2 × H200 pipeline-parallel sample (``data/samples/h200x2-pp2``); the bundled
TP=2 sample is the explorer's second capture. Caches go to a temporary ``SERVELAB_CACHE``, and the checkout is
listed before and after: nothing under it may change.
"""
from __future__ import annotations

import json
import os
import secrets
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from servelab.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from browser import DevTools, chromium  # noqa: E402
from conftest import SAMPLES, read_only_copy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "notebooks/explore_run.ipynb"


def checkout_listing() -> dict[str, tuple[int, int]]:
    """Every file under the checkout (size, mtime), less the environment and what the test tools keep there."""
    skip = {".git", ".venv", ".pytest_cache", ".ruff_cache", ".import_linter_cache", "test-artifacts"}
    out = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        if Path(dirpath) == ROOT:
            dirnames[:] = [d for d in dirnames if d not in skip]
        for f in filenames:
            p = Path(dirpath) / f
            st = p.lstat()
            out[str(p.relative_to(ROOT))] = (st.st_size, st.st_mtime_ns)
    return out


def still_running(markers: list[str], wait_s: float) -> list[str]:
    """Processes whose command line or environment holds one of ``markers``, after waiting up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                seen = (proc / "cmdline").read_bytes() + b"\0" + (proc / "environ").read_bytes()
            except OSError:
                continue
            if any(m.encode() in seen for m in markers):
                found.append(f"{proc.name}: {(proc / 'cmdline').read_bytes()[:200]!r}")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def start_jupyter_lab(tracker, tmp: Path, env: dict[str, str]) -> str:
    """``jupyter lab`` on 127.0.0.1 serving the checkout, its token in the environment (never in argv), every
    file it keeps (settings, workspaces, runtime, checkpoints) under ``tmp``; autosave off, so the notebook
    file stays as committed. Returns its base URL once it answers."""
    from servelab.deploy.hosts import LocalHost, free_port
    for plugin, values in (("docmanager-extension/plugin", {"autosave": False}),
                           ("apputils-extension/notification", {"fetchNews": "false"})):
        f = tmp / "lab-settings" / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(values))
    port = free_port()
    argv = [str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
            "--ServerApp.port_retries=0", f"--ServerApp.root_dir={ROOT}",
            f"--FileCheckpoints.checkpoint_dir={tmp / 'checkpoints'}", "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.extension_manager=readonly",
            "--ServerApp.terminals_enabled=False", *(["--allow-root"] if os.geteuid() == 0 else [])]
    handle = tracker.start(LocalHost(state_dir=str(tmp / "pids")), argv, tmp / "jupyter.log", env=env,
                           what="jupyter lab (test_explore_live)")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/status?token={env['JUPYTER_TOKEN']}", timeout=2) as r:
                if r.status == 200:
                    return url
        except OSError:
            pass
        assert handle.popen.poll() is None, f"jupyter lab exited: {(tmp / 'jupyter.log').read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"jupyter lab did not answer in 60 s: {(tmp / 'jupyter.log').read_text()[-2000:]}"
        time.sleep(0.3)


# what the page shows, read in one go: the explorer's controls, notes and figures, and any error output
STATE = r"""(() => {
  const q = (s) => document.querySelector(s);
  const nb = (t) => t.replace(/\u00a0/g, ' ');     // ipywidgets writes option labels with no-break spaces
  const sel = (c) => { const s = q('.servelab-' + c + ' select'); const o = s && s.options[s.selectedIndex];
                       return o ? nb(o.text) : null; };
  const opts = (c) => { const s = q('.servelab-' + c + ' select'); return s ? [...s.options].map(o => nb(o.text)) : []; };
  const plot = (c) => { const gd = q('.servelab-' + c + '-out .js-plotly-plot');
    if (!gd || !gd.data) return null;
    return {traces: gd.data.length, names: gd.data.map(t => t.name),
            points: gd.querySelectorAll('.scatterlayer .point').length,
            lines: gd.querySelectorAll('.scatterlayer .js-line').length,
            range: gd.layout.xaxis && gd.layout.xaxis.range ? gd.layout.xaxis.range.map(Number) : null,
            rows: [...gd.querySelectorAll('.yaxislayer-above .ytick text')].map(t => t.textContent),
            title: gd.layout.title && gd.layout.title.text || ''}; };
  const text = (c) => { const e = q('.servelab-' + c); return e ? e.innerText.trim() : null; };
  const readout = q('.servelab-readout');
  return {run: sel('run'), case: sel('case'), cases: opts('case'), capture: sel('capture'), captures: opts('capture'),
          rank: sel('rank'), ranks: opts('rank'), run_note: text('run-note'), case_note: text('case-note'),
          trace_note: text('trace-note'), readout: text('readout'),
          readout_cut: readout ? readout.scrollWidth > readout.clientWidth + 1 : null,
          case_table: !!q('.servelab-case-out table.dataframe'), case_plot: plot('case'), trace_plot: plot('trace'),
          error_notes: [...document.querySelectorAll('.servelab-note-error')].map(e => e.innerText),
          error_outputs: [...document.querySelectorAll(
              '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"], .jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]')]
              .map(e => e.innerText.slice(0, 300)),
          busy: [...document.querySelectorAll('.jp-InputPrompt')].some(p => p.innerText.includes('*')),
          // JupyterLab's log console (where a widget callback's traceback lands): "N log entries for …"
          log_entries: Number(((q('.jp-LogConsoleStatusItem [title]') || {}).title || '').match(/(\d+) log entr/)?.[1] || 0)};
})()"""


def kernel_ready(page: DevTools, timeout: float = 90) -> None:
    """Wait for the notebook to open with its kernel idle. JupyterLab sometimes asks which kernel to start (a
    "Select Kernel" dialog, preselected on the notebook's own Python 3): a person clicks Select, so does this."""
    deadline = time.monotonic() + timeout
    page.wait_for("document.querySelectorAll('.jp-Notebook .jp-Cell').length >= 10", timeout, "the notebook open")
    quiet_since = None
    while True:
        state = page.eval("""(() => ({
          dialog: !!document.querySelector('.jp-Dialog .jp-Dialog-button.jp-mod-accept'),
          idle: [...document.querySelectorAll('.jp-Notebook-ExecutionIndicator')]
                  .some(e => e.getAttribute('data-status') === 'idle')}))()""")
        if state["dialog"]:
            page.click_at(*page.center(".jp-Dialog .jp-Dialog-button.jp-mod-accept"))
            quiet_since = None
        elif state["idle"]:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 1.5:        # idle, and no dialog came up meanwhile
                return
        else:
            quiet_since = None
        assert time.monotonic() < deadline, f"the notebook's kernel was not ready in {timeout:.0f} s: {state}"
        time.sleep(0.25)


def settle(page: DevTools, until: str, what: str, timeout: float = 60) -> dict:
    """Wait until the explorer's state satisfies ``until`` (a JS expression over ``s``, the STATE object) and the
    kernel is idle; the state. On a timeout the error shows the state the page was left in."""
    try:
        page.wait_for(f"(() => {{ const s = {STATE}; return !s.busy && ({until}); }})()", timeout, what)
    except AssertionError as exc:
        state = page.eval(STATE)
        raise AssertionError(f"{exc}; the explorer shows {json.dumps(state, ensure_ascii=False)[:3000]}") from None
    return page.eval(STATE)


def pick(page: DevTools, control: str, label_start: str) -> None:
    """Choose the option of a dropdown that starts with ``label_start`` as a person does: click the dropdown
    (its list opens), arrow keys to the option, Enter. (Arrow keys on a closed dropdown do not work in
    JupyterLab: its notebook shortcuts take them.)"""
    sel = f"document.querySelector('.servelab-{control} select')"
    options = page.eval(f"[...{sel}.options].map(o => o.text.replace(/\\u00a0/g, ' '))")
    target = next((i for i, o in enumerate(options) if o.startswith(label_start)), None)
    assert target is not None, f"no option {label_start!r} in the {control} dropdown: {options}"
    current = page.eval(f"{sel}.selectedIndex")
    page.click_at(*page.center(f".servelab-{control} select"))
    time.sleep(0.3)
    for _ in range(abs(target - current)):
        page.key("ArrowDown" if target > current else "ArrowUp")
    page.key("Enter")
    page.wait_for(f"{sel}.selectedIndex === {target}", 10, f"{label_start!r} selected in the {control} dropdown")


def drag_window(page: DevTools, lower_pct: float | None, upper_pct: float | None) -> None:
    """Drag the window slider's handles with the mouse to these fractions of its track."""
    track = page.eval("""(() => { const r = document.querySelector('.servelab-window .noUi-base').getBoundingClientRect();
                                  return [r.left, r.width, r.top + r.height / 2]; })()""")
    left, width, y = track
    for handle, pct in (("lower", lower_pct), ("upper", upper_pct)):
        if pct is None:
            continue
        x0, y0 = page.center(f".servelab-window .noUi-handle-{handle}")
        page.drag(x0, y0, left + width * pct / 100, y)
        time.sleep(0.2)


@pytest.mark.slow
def test_explorer_in_a_live_jupyterlab(outputs, llama_server_binary, tmp_path):
    if not chromium():
        pytest.skip("chromium not installed (Debian package chromium; `make system` installs it)")
    from servelab.deploy.hosts import ProcessTracker
    began, took = time.monotonic(), {}

    def lap(step: str) -> None:      # where the test's time goes (printed; `pytest -s` shows it)
        took[step] = round(time.monotonic() - began - sum(took.values()), 1)
        print(f"{step}: {took[step]} s", flush=True)
    pp2 = read_only_copy(SAMPLES / "h200x2-pp2") / "traces"
    assert main(["run", "phase1", "--target", "local-tiny", "--run-id", "live", "-p", 'cases=["P1","D1"]',
                 "-p", "search=false", "--no-render"]) == 0
    assert main(["run", "phase3", "--target", "local-tiny", "--run-id", "live", "-p", f"trace_dir={pp2}",
                 "--no-render"]) == 0
    summaries = {c: json.loads((outputs / "live" / "cases" / c / "summary.json").read_text()) for c in ("P1", "D1")}
    lap("the run made (Phase 1 P1 + D1, Phase 3 over the PP=2 sample)")
    verdict = {c: summaries[c]["verdict"]["status"] for c in summaries}
    # the explorer opens on the first VALID case in run order, else on the first case, saying it is not a result
    # (on a loaded machine the client's own stalls can make both cases INVALID: the run is shown as it is)
    opens_on = next((c for c in ("P1", "D1") if verdict[c] == "VALID"), "P1")
    other = "D1" if opens_on == "P1" else "P1"

    cache = tmp_path / "cache"
    env = {"JUPYTER_TOKEN": secrets.token_hex(24), "SERVELAB_OUTPUTS": str(outputs), "SERVELAB_CACHE": str(cache),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "jconfig"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "jruntime"),
           "JUPYTER_DATA_DIR": str(tmp_path / "jdata"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-workspaces"), "IPYTHONDIR": str(tmp_path / "ipython"),
           "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache")}
    before = checkout_listing()
    with ProcessTracker() as tracker, DevTools(width=1500, height=1100) as page:
        profile = page.profile
        url = start_jupyter_lab(tracker, tmp_path, env)
        lap("jupyter lab up")
        page.navigate(f"{url}/lab/tree/{NOTEBOOK}?token={env['JUPYTER_TOKEN']}")
        kernel_ready(page)
        lap("the notebook open, its kernel idle")
        # Run All, from the menu
        page.click_at(*page.center(".lm-MenuBar-item", "Run"))
        page.click_at(*page.center(".lm-Menu-item .lm-Menu-itemLabel", "Run All Cells"))

        # it opens drawn: the first VALID case, the first capture (Phase 3's), both figures
        s = settle(page, "s.case_plot && s.trace_plot && s.trace_plot.lines > 0", "the explorer drawn after Run All", 120)
        lap("Run All: the explorer drawn")
        page.center(".servelab-case-out")             # scrolled into view for the screenshot
        page.screenshot("explore_live_open")
        assert s["run"] == "live" and s["case"] == f"{opens_on} · phase1 · {verdict[opens_on]}", s
        assert s["cases"] == [f"P1 · phase1 · {verdict['P1']}", f"D1 · phase1 · {verdict['D1']}"], s["cases"]
        assert s["case_table"] and s["case_plot"]["traces"] == 2 and s["case_plot"]["points"] >= 2, s["case_plot"]
        if "VALID" in verdict.values():
            assert s["case_note"].startswith(f"{opens_on} · phase1 · VALID · "), s["case_note"]
        else:
            assert s["case_note"].startswith(f"no VALID case in this run; {opens_on} · phase1 · {verdict[opens_on]} ("
                                             ) and "): not a result" in s["case_note"], s["case_note"]
        assert s["captures"] == [f"Phase 3's capture — {pp2}", "sample: h200x2/traces"], s["captures"]
        assert s["capture"] == s["captures"][0] and s["ranks"] == ["all ranks", "rank 0", "rank 1"], s
        assert s["readout"].startswith("0.0 – 100.0 % of ") and not s["readout_cut"], s["readout"]
        assert s["trace_plot"]["traces"] >= 2 and "GPU timeline by kernel class — 2 ranks" in s["trace_plot"]["title"]

        # the other case, with its own requests
        pick(page, "case", f"{other} ·")
        s = settle(page, f"s.case_note.includes('{other} · phase1 · ') && s.case_plot", f"the {other} case drawn")
        assert s["case_plot"]["traces"] == 2 and s["case_plot"]["points"] >= 2 and s["case_table"], s
        assert f"{summaries[other]['counts']['measured']} measured requests" in s["case_note"], s["case_note"]

        # a capture: the bundled TP=2 sample
        pick(page, "capture", "sample: h200x2/traces")
        s = settle(page, "s.trace_note.startsWith('sample: h200x2/traces') && s.trace_plot", "the sample drawn")
        full_span = float(s["readout"].split(" of ")[1].split(" ms")[0])
        assert s["ranks"] == ["all ranks", "rank 0", "rank 1"] and s["trace_plot"]["lines"] > 0, s

        # a rank
        pick(page, "rank", "rank 1")
        s = settle(page, "s.trace_note.includes('rank 1 of 2') && s.trace_plot", "rank 1 drawn")
        assert s["trace_plot"]["rows"] and all(r.startswith("rank 1 ·") for r in s["trace_plot"]["rows"]), s["trace_plot"]
        rank_span = float(s["readout"].split(" of ")[1].split(" ms")[0])
        assert 0 < rank_span <= full_span

        # a window: the handles dragged to about 25 % and 50 %; the timeline redrawn over that range only
        drag_window(page, 25, 50)
        s = settle(page, "!s.readout.startsWith('0.0 – 100.0') && !s.readout.includes(' – 100.0 %') && s.trace_plot "
                         "&& s.trace_plot.range", "the window redrawn")
        page.center(".servelab-window")
        page.screenshot("explore_live_window")
        lo, hi = (float(v) for v in s["readout"].split(" %")[0].split(" – "))
        t0, t1 = (float(v) for v in s["readout"].split(": ")[1].rstrip(" ms").split(" – "))
        assert 20 <= lo <= 30 and 45 <= hi <= 55, s["readout"]
        assert abs(t0 - rank_span * lo / 100) < 0.01 and abs(t1 - rank_span * hi / 100) < 0.01, s["readout"]
        assert s["trace_plot"]["range"] == pytest.approx([t0, t1], abs=0.006), s["trace_plot"]
        assert s["trace_plot"]["lines"] > 0 and not s["readout_cut"], s

        # a window that cannot be drawn says why, in the cell, one line; widening it draws again
        drag_window(page, None, lo - 10)
        s = settle(page, "s.error_notes.length > 0", "the empty window explained")
        assert len(s["error_notes"]) == 1 and "is empty: widen it" in s["error_notes"][0], s["error_notes"]
        assert "\n" not in s["error_notes"][0] and s["trace_plot"] is None
        drag_window(page, None, 90)
        s = settle(page, "s.error_notes.length === 0 && s.trace_plot", "the widened window drawn")
        assert s["trace_plot"]["lines"] > 0

        assert s["error_outputs"] == [] and s["log_entries"] == 0 and page.errors == [], (s, page.errors)
        lap("case, capture, rank, window, empty window picked and checked")
        log = (tmp_path / "jupyter.log").read_text()
        assert "Traceback" not in log, log[-3000:]
    # everything the test started is gone: jupyter lab, its kernel (own session), the browser and its helpers
    assert not still_running([str(tmp_path), profile], 15), "processes left running"
    assert checkout_listing() == before, "files written or changed under the checkout"
    assert list((cache / "traces").glob("*.parquet")), "the trace caches went elsewhere than SERVELAB_CACHE"
