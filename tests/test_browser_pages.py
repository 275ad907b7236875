"""Every phase page of a run renders in headless Chromium: content drawn, plotly figures drawn, links resolve.
A screenshot per page lands in test-artifacts/screenshots/."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from servelab.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from browser import assert_page_rules, chromium, content_fraction, dom_text, screenshot  # noqa: E402

PHASES = [("phase0", []), ("phase1", ["-p", 'cases=["P1","D1","M1"]', "-p", "search=false"]),
          ("phase2", ["-p", "workload=cpu", "-p", "case_seconds=1.5"]), ("phase3", []), ("phase4", []),
          ("phase5", []), ("phase6", [])]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, llama_server_binary):
    import os
    out = tmp_path_factory.mktemp("pages")
    os.environ["SERVELAB_OUTPUTS"] = str(out)
    try:
        for phase, extra in PHASES:
            assert main(["run", phase, "--target", "local-tiny", "--run-id", "pages", *extra]) == 0, phase
        assert main(["archive", "pages"]) == 0
    finally:
        os.environ.pop("SERVELAB_OUTPUTS", None)
    return out / "pages"


@pytest.mark.slow
def test_every_page_renders_with_figures_and_live_links(run_dir):
    if not chromium():
        pytest.skip("chromium not installed (Debian package chromium; `make system` installs it)")
    pages = [run_dir / "index.html", run_dir.parent / "index.html"] + sorted(run_dir.glob("phase*/report.html"))
    assert len(pages) == 2 + len(PHASES)
    for page in pages:
        name = page.parent.name if page.name == "report.html" else page.stem + ("_root" if page.parent != run_dir else "")
        png = screenshot(page, f"page_{name}", height=1600)
        assert content_fraction(png) > 0.02, page
        html = page.read_text()
        for href in re.findall(r'href="([^"#:]+)(?:#[^"]*)?"', html):
            assert (page.parent / href).exists(), (page, href)           # every relative link resolves
        if page.name == "report.html" and "application/vnd.plotly.v1+json" in html:
            dom = dom_text(page)
            assert "main-svg" in dom, f"{page}: plotly figures did not draw"
        # offline: nothing is loaded from the network (plotly.js is inlined; strings inside it don't count)
        assert not re.search(r'<script[^>]+src="https?:', html) and not re.search(r'<link[^>]+href="https?:', html)


@pytest.mark.slow
def test_every_page_opens_with_findings_and_holds_no_reprs(run_dir):
    """In the browser, every phase page: the findings box first (non-empty), no ``np.float64(`` / ``{'`` /
    ``Timestamp(`` in its text, an executed or reproduce command in ``#commands``, no table cut off."""
    if not chromium():
        pytest.skip("chromium not installed (Debian package chromium; `make system` installs it)")
    pages = sorted(run_dir.glob("phase*/report.html"))
    assert [p.parent.name for p in pages] == [phase for phase, _ in PHASES]
    for page in pages:
        r = assert_page_rules(page)
        assert r["tables"] > 0, page
