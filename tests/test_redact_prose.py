"""Redaction never rewrites the library's own prose: every phase page's method texts (the notebooks' markdown
cells) rendered with secrets planted in its commands, logs, configs and environment dumps — and one known secret
value inside the prose itself — come out with every word of the prose intact and every secret gone."""
from __future__ import annotations

import html
import re
import secrets
import string
from pathlib import Path

import nbformat
import pytest

from servelab.core import redact as rd
from servelab.core.notebooks import NOTEBOOKS
from servelab.report.html import render_notebook

ROOT = Path(__file__).resolve().parents[1]


def rand(n: int = 28) -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(n))


def _plant(nb: nbformat.NotebookNode, known: str, shaped: str, flag_value: str, env_value: str) -> None:
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.outputs = [
        nbformat.v4.new_output("stream", name="stdout",
                               text=f"llama-server --model m.gguf --api-key {flag_value} --port 8080\n"),
        nbformat.v4.new_output("stream", name="stderr", text=f"HF_TOKEN={env_value}\nPATH=/usr/bin\n"),
        nbformat.v4.new_output("execute_result", data={"text/plain": f"{{'engine_args': {{'token': '{shaped}'}}, "
                                                                     f"'note': 'key {known}'}}"}),
    ]
    nb.cells.append(nbformat.v4.new_markdown_cell(f"A value a user pasted into the prose: {known} (gone)."))


def _prose_words(source: str) -> list[str]:
    """The words of a markdown cell as a reader sees them (markup, links and code marks dropped)."""
    text = re.sub(r"\]\([^)]*\)", "]", source)
    return [w for w in re.findall(r"[A-Za-z][A-Za-z\-']{3,}", text)]


@pytest.mark.parametrize("phase", sorted(NOTEBOOKS))
def test_method_texts_survive_redaction_and_planted_secrets_do_not(phase, tmp_path, monkeypatch):
    known, env_value = rand(), rand()
    shaped, flag_value = "hf_" + rand(30), rand(24)
    monkeypatch.setenv("SERVELAB_TEST_API_KEY", known)
    path = ROOT / "notebooks" / f"{NOTEBOOKS[phase]}.ipynb"
    nb = nbformat.read(str(path), as_version=4)
    prose = [c.source for c in nb.cells if c.cell_type == "markdown"]
    assert prose, f"{path.name} has method texts"
    _plant(nb, known, shaped, flag_value, env_value)
    run_dir = tmp_path / "run"
    (run_dir / phase).mkdir(parents=True)
    executed = run_dir / phase / "notebook.ipynb"
    nbformat.write(nb, str(executed))

    # the notebook scrub: every method text exactly as written, the planted known value gone from the prose
    scrubbed = rd.scrub_notebook_node(nbformat.read(str(executed), as_version=4), rd.known_secrets())
    md = [c.source for c in scrubbed.cells if c.cell_type == "markdown"]
    assert md[:-1] == prose
    assert known not in md[-1] and md[-1].startswith("A value a user pasted into the prose: ")

    # the rendered page: no secret anywhere, every word of every method text still there, REDACTED only where planted
    page = render_notebook(executed, run_dir / phase / "report.html",
                           {"run_id": "r", "phase": phase, "title": phase}).read_text(encoding="utf-8")
    text = html.unescape(re.sub(r"<[^>]+>", " ", page))
    for secret in (known, env_value, shaped, flag_value):
        assert secret not in page
    for source in prose:
        for word in _prose_words(source):
            assert word in text, f"{phase}: the method text lost {word!r}"
    assert text.count("REDACTED") == 5, f"{phase}: REDACTED stands where no secret was planted"
