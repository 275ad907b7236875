"""The documentation in docs/: every anchor that notebooks, the library, the README and the documents themselves
link to exists, and rendered pages reach the documents offline from inside a run directory."""
from __future__ import annotations

import json
import re
from pathlib import Path

from servelab.report.html import docs_html_links, publish_docs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ANCHOR_RE = re.compile(r'<a id="([A-Za-z0-9_-]+)"></a>')
# docs/method.md#rules in a docstring, ../docs/method.md#rules in a notebook, (metrics.md#ttft) between documents
REF_RE = re.compile(r"docs/([A-Za-z0-9_-]+)\.md(?:#([A-Za-z0-9_-]+))?")
SIBLING_RE = re.compile(r"\]\(([A-Za-z0-9_-]+)\.md(?:#([A-Za-z0-9_-]+))?\)")
SAME_FILE_RE = re.compile(r"\]\(#([A-Za-z0-9_-]+)\)")


def anchors() -> dict[str, list[str]]:
    return {p.stem: ANCHOR_RE.findall(p.read_text(encoding="utf-8")) for p in DOCS.glob("*.md")
            if not p.name.startswith(".")}


def sources() -> dict[str, str]:
    """Every text that may link to the documents, by a readable name."""
    out = {"README.md": (ROOT / "README.md").read_text(encoding="utf-8")}
    for p in sorted((ROOT / "lib" / "servelab").rglob("*")):
        if p.suffix in (".py", ".yaml", ".json"):
            out[str(p.relative_to(ROOT))] = p.read_text(encoding="utf-8")
    for p in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(p.read_text(encoding="utf-8"))
        out[str(p.relative_to(ROOT))] = "\n".join("".join(c["source"]) for c in nb["cells"])
    for p in sorted(DOCS.glob("*.md")) + sorted(DOCS.glob(".*.md")):
        out[str(p.relative_to(ROOT))] = p.read_text(encoding="utf-8")
    return out


def test_the_three_documents_exist_with_unique_anchors():
    found = anchors()
    assert {"architecture", "method", "metrics"} <= set(found)
    for name, ids in found.items():
        dup = sorted({i for i in ids if ids.count(i) > 1})
        assert not dup, f"docs/{name}.md repeats anchors {dup}"
    for must in ("rules", "stop-reasons", "three-concurrencies", "thresholds", "hypotheses", "milestones",
                 "transport-gate", "preflight", "timeline-questions", "interference", "knobs", "cache", "speculative"):
        assert must in found["method"], must
    for must in ("ttft", "tpot", "itl", "e2e", "throughput", "goodput", "percentiles", "sglang-vs-vllm", "busy",
                 "exposed-comm", "idle-gaps", "cuda-graph-coverage", "stragglers", "pp-busy", "nccl-tests",
                 "telemetry-summaries"):
        assert must in found["metrics"], must


def test_every_link_to_the_documents_names_an_existing_anchor():
    found = anchors()
    broken = []
    for name, text in sources().items():
        refs = REF_RE.findall(text)
        if name.startswith("docs/"):
            refs += SIBLING_RE.findall(text)
            own = Path(name).stem
            if own in found:
                refs += [(own, a) for a in SAME_FILE_RE.findall(text)]
        for doc, anchor in refs:
            if doc not in found or (anchor and anchor not in found[doc]):
                broken.append(f"{name}: docs/{doc}.md#{anchor}")
    assert not broken, "\n".join(sorted(set(broken)))


def test_rendered_pages_reach_the_documents_from_a_run_directory(tmp_path: Path):
    run = tmp_path / "run"
    pages = publish_docs(run)
    assert {p.name for p in pages} >= {"architecture.html", "method.html", "metrics.html"}
    assert (run / "docs" / "method.md").exists()            # the executed notebook's .md links resolve too
    method = (run / "docs" / "method.html").read_text()
    assert '<a id="rules"></a>' in method
    assert re.search(r'href="metrics\.html#[a-z-]+"', method)    # links between documents point at the HTML
    md = "Rules: [method § rules](../docs/method.md#rules); all metrics: [metrics](../docs/metrics.md)."
    linked = docs_html_links(md)
    assert "](../docs/method.html#rules)" in linked and "](../docs/metrics.html)" in linked
    phase_dir = run / "phase1"
    phase_dir.mkdir()
    for href in re.findall(r"\]\(([^)#]+)", linked):
        assert (phase_dir / href).exists(), href


def test_no_docs_folder_publishes_nothing(tmp_path: Path):
    assert publish_docs(tmp_path / "run", docs_dir=tmp_path / "absent") == []


# ---------------------------------------------------------------- the module map cannot drift

MAP_ROW_RE = re.compile(r"^\| `")
MAP_TOKEN_RE = re.compile(r"`([^`]+)`")


def module_map(doc: str) -> list[str]:
    """The paths the first column of docs/architecture.md's module map lists, in order, relative to lib/servelab/
    (``a/b.py``, ``c.py`` in one cell: the second is a sibling of the first)."""
    section = doc[doc.index('<a id="module-map"></a>'):doc.index('<a id="where"></a>')]
    out: list[str] = []
    for line in section.splitlines():
        if not MAP_ROW_RE.match(line):
            continue
        folder = ""
        for tok in MAP_TOKEN_RE.findall(line.split("|")[1]):
            if "/" in tok.rstrip("/"):
                folder = tok.rsplit("/", 1)[0]
                out.append(tok)
            else:
                out.append(f"{folder}/{tok}" if folder else tok)
    return out


def module_map_problems(root: Path) -> list[str]:
    """Every Python module under lib/servelab (package ``__init__.py`` files aside) listed once in the module map,
    and no listed path that is not there."""
    lib = root / "lib" / "servelab"
    listed = module_map((root / "docs" / "architecture.md").read_text(encoding="utf-8"))
    tree = sorted(p.relative_to(lib).as_posix() for p in lib.rglob("*.py")
                  if p.name != "__init__.py" and "__pycache__" not in p.parts)
    problems = [f"{m}: not in docs/architecture.md's module map" for m in tree if m not in listed]
    problems += [f"{m}: listed {listed.count(m)} times" for m in sorted(set(listed)) if listed.count(m) > 1]
    problems += [f"{m}: listed, but lib/servelab/{m} does not exist" for m in sorted(set(listed))
                 if not (lib / m).exists()]
    return problems


def test_the_module_map_lists_every_module_once_and_nothing_else():
    assert module_map_problems(ROOT) == []


def test_the_module_map_check_catches_a_module_added_without_a_line_and_a_stale_line(tmp_path: Path):
    """The same check on a copy of the tree's file names: one module more, one module fewer."""
    lib = ROOT / "lib" / "servelab"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text((DOCS / "architecture.md").read_text(encoding="utf-8"))
    for p in lib.rglob("*"):
        if p.is_file() and "__pycache__" not in p.parts:
            q = tmp_path / "lib" / "servelab" / p.relative_to(lib)
            q.parent.mkdir(parents=True, exist_ok=True)
            q.touch()
    assert module_map_problems(tmp_path) == []
    (tmp_path / "lib" / "servelab" / "measure" / "brand_new.py").touch()
    (tmp_path / "lib" / "servelab" / "report" / "tables.py").unlink()
    assert module_map_problems(tmp_path) == [
        "measure/brand_new.py: not in docs/architecture.md's module map",
        "report/tables.py: listed, but lib/servelab/report/tables.py does not exist"]
