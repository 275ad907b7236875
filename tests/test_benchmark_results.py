"""benchmarks/results/: every result in the folder, its index current, and every path the docs cite there real."""
from __future__ import annotations

import re
from pathlib import Path

import benchmod

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# benchmarks/results/<name>.json as the docs and scripts cite it; a * stands for several runs
CITED_RE = re.compile(r"benchmarks/results/([A-Za-z0-9_.*-]+\.json)")


def test_the_index_is_what_the_results_give():
    index = benchmod.load("results_index")
    assert (RESULTS / "README.md").read_text() == index.render(RESULTS), \
        "benchmarks/results/README.md is stale: run python benchmarks/results_index.py"


def test_the_index_names_the_latest_result_of_every_benchmark(tmp_path):
    """A newer result of a benchmark becomes its latest figure; a file of an unknown benchmark is refused."""
    index = benchmod.load("results_index")
    src = RESULTS / "trace_vs_hta_20261129.json"
    (tmp_path / src.name).write_text(src.read_text())
    newer = src.read_text().replace('"when": "2026-11-29T23:00:36+0000"', '"when": "2027-01-05T10:00:00+0000"')
    assert newer != src.read_text()
    (tmp_path / "trace_vs_hta_20270105_vm.json").write_text(newer)
    latest = [ln for ln in index.render(tmp_path).splitlines() if ln.startswith("| trace_vs_hta | `benchmarks/")]
    assert len(latest) == 1 and "trace_vs_hta_20270105_vm.json" in latest[0] and "2027-01-05 10:00" in latest[0]
    (tmp_path / "made_up_20270105.json").write_text("{}")
    try:
        index.render(tmp_path)
    except ValueError as exc:
        assert "made_up_20270105.json" in str(exc)
    else:
        raise AssertionError("an unknown benchmark's result was indexed")


def test_no_result_lies_outside_the_results_folder():
    assert sorted(p.name for p in (ROOT / "benchmarks").glob("*.json")) == []


def test_every_result_the_docs_and_scripts_cite_exists():
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.py")]
    cited = {(p.relative_to(ROOT).as_posix(), name) for p in texts for name in CITED_RE.findall(p.read_text())
             if "DATE" not in name}                       # an --out example (``trace_scale_DATE.json``), not a result
    assert cited, "no citation found: the pattern no longer matches the docs"
    missing = [f"{src}: benchmarks/results/{name}" for src, name in sorted(cited) if not list(RESULTS.glob(name))]
    assert missing == []
