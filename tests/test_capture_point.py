"""Phase 3's ``capture_at`` (``measure.capture_point``): a Phase 1 case of a run, checked before anything is made.
The Phase 1 results are the real ``phase1/matrix.csv`` of ``tests/data/run_tables`` (tiny llama-server, see its
README); the live capture at such a point is ``tests/test_phase3_sglang.py``."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from servelab.cli import main
from servelab.core.params import ParamError
from servelab.measure.capture import capture_scenarios
from servelab.measure.capture_point import at_point, resolve_capture_point

MATRIX = Path(__file__).parent / "data" / "run_tables" / "matrix.csv"


@pytest.fixture
def outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path))
    (tmp_path / "r1" / "phase1").mkdir(parents=True)
    shutil.copy(MATRIX, tmp_path / "r1" / "phase1" / "matrix.csv")
    return tmp_path


def test_a_case_id_of_the_run_gives_its_lengths_and_concurrency(outputs):
    at = resolve_capture_point("D2_c8", "r1")
    assert (at.run_id, at.case_id, at.kind, at.input_len, at.output_len, at.concurrency) == ("r1", "D2_c8", "decode",
                                                                                            64, 64, 8)
    assert resolve_capture_point("r1:P1", "other").case_id == "P1"          # an earlier run, named
    dec, mixed, pre, hit = at_point(capture_scenarios("local"), at)
    assert (dec.isl_tokens, dec.osl_tokens, dec.concurrency, dec.case_id) == (64, 64, 8, "D2_c8-profile")
    assert (mixed.isl_tokens, mixed.concurrency, mixed.inject_isl_tokens) == (64, 8, capture_scenarios("local")[1]
                                                                              .inject_isl_tokens)
    assert pre.isl_tokens == capture_scenarios("local")[2].isl_tokens         # not a prefill case: its own prompt
    assert hit.concurrency == 8 and dec.profiled_case_id == "D2_c8-profile--profile-decode_control"
    assert dec.description.startswith("at Phase 1 case D2_c8: 64->64, C=8: once decode is active")
    assert mixed.description.startswith("at Phase 1 case D2_c8: 64->64, C=8 background:")
    assert ", C=8 sharing" in hit.description and "128->256" not in dec.description + mixed.description


@pytest.mark.parametrize("spec, run_id, says", [
    ("D9", "r1", "run r1 has no Phase 1 case 'D9'; its cases: D1, D2_c16, D2_c4, D2_c8, P1"),
    ("max_tps", "r1", "run r1 has no concurrency search"),
    ("C=4", "r1", "run r1 has no concurrency search"),
    ("D2_c8", "", "a new run has no Phase 1 results"),
    ("nope:D2_c8", "r1", "run nope has no Phase 1 results"),
])
def test_a_point_that_does_not_exist_is_one_line(outputs, spec, run_id, says):
    with pytest.raises(ParamError) as e:
        resolve_capture_point(spec, run_id)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("run_id", ["r1", "fresh"])
def test_the_cli_refuses_an_unknown_point_before_making_anything(outputs, capsys, run_id):
    before = sorted(p.relative_to(outputs) for p in outputs.rglob("*"))
    code = main(["run", "phase3", "--target", "local-sglang", "--run-id", run_id, "-p", "capture_at=D9"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "capture_at=D9" in err
    assert sorted(p.relative_to(outputs) for p in outputs.rglob("*")) == before       # no run folder, no phase3/
