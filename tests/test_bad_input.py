"""Bad input is one clear line before any side effect: phase parameters out of range, launch settings of the
wrong shape, a model that does not exist, labels that would leave their folder. Generated inputs (hypothesis)
are either accepted or refused with a ParamError — never another exception, never a hang."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.cli import validate
from servelab.core.notebooks import available_phases, notebook_path
from servelab.core.params import ParamError, notebook_param_specs
from servelab.core.paths import path_slug
from servelab.measure.search import ladder
from servelab.deploy.targets import target_from_dict
from cli_here import run_cli
from fuzz import examples

ROOT = Path(__file__).resolve().parents[1]


def servelab(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SERVELAB_OUTPUTS": str(tmp_path / "outputs")}
    return subprocess.run([sys.executable, "-m", "servelab.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


BAD = [
    ("phase1", "search_step=-4", "'search_step' must be >= 0"),
    ("phase1", "repeats=0", "'repeats' must be >= 1"),
    ("phase1", "definition=foo", "must be one of vllm, sglang"),
    ("phase3", "timeline_bins=0", "'timeline_bins' must be >= 1"),
    ("phase3", "capture_steps=4", "'capture_steps' must be >= 5"),
    ("phase3", "capture_steps=33", "'capture_steps' must be <= 32"),
    ("phase5", "tp=0", "'tp' must be >= 1"),
    ("phase8", "rates=[0.5, 2]", "items must be <= 1"),
    ("phase9", "concurrencies=[0]", "items must be >= 1"),
    ("phase1", "slo_ttft_ms=nan", "finite"),
    ("phase1", "parallel=0", "launch.parallel must be a positive integer"),
    ("phase1", "extra_args=--foo", "launch.extra_args must be a list"),
    ("phase1", "spec={draft_model: x}", "launch.spec needs 'algorithm'"),
]


@pytest.mark.parametrize("phase,item,message", BAD)
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture, phase: str, item: str,
                                                      message: str) -> None:
    code, _, err = run_cli("run", phase, "--target", "local-tiny", "-p", item, tmp_path=tmp_path,
                           monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("servelab: error: ") and message in lines[0], err
    assert not (tmp_path / "outputs").exists()


def test_bad_input_through_the_real_command_is_one_line_and_nothing_is_written(tmp_path: Path) -> None:
    """One of the cases above through ``python -m servelab.cli``: the process prints that line alone (no traceback,
    no warning) and exits 2."""
    phase, item, message = BAD[0]
    res = servelab("run", phase, "--target", "local-tiny", "-p", item, tmp_path=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("servelab: error: ") and message in lines[0], res.stderr
    assert not (tmp_path / "outputs").exists()


def test_a_missing_model_is_found_before_the_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    raw = yaml.safe_load((ROOT / "params/targets/local-tiny.yaml").read_text())
    raw["model"] = str(tmp_path / "no-such-model.gguf")
    t = tmp_path / "nomodel.yaml"
    t.write_text(yaml.safe_dump(raw))
    code, _, err = run_cli("run", "phase1", "--target", str(t), tmp_path=tmp_path, monkeypatch=monkeypatch,
                           capsys=capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "no-such-model.gguf" in lines[0] and "neither a known key" in lines[0]
    assert not (tmp_path / "outputs").exists()


def test_a_search_step_below_one_is_refused_not_looped() -> None:
    assert ladder(4, 12) == [1, 4, 8, 12]
    with pytest.raises(ValueError):
        ladder(0, 32)
    with pytest.raises(ValueError):
        ladder(-4, 32)


@pytest.mark.parametrize("label", ["batch_size=../../x", "..", "/etc/passwd", "a/../../b", "", ".x", "k=" + "9" * 500])
def test_labels_become_one_safe_folder_name(tmp_path: Path, label: str) -> None:
    slug = path_slug(label)
    assert slug and "/" not in slug and ".." not in slug and not slug.startswith(".")
    assert (tmp_path / slug).resolve().parent == tmp_path.resolve()


def test_path_slug_keeps_ordinary_labels() -> None:
    assert path_slug("batch_size=2048") == "batch_size=2048"


# ---------------------------------------------------------------- generated inputs

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=20))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)


def _as_cli(v: object) -> str:
    return v if isinstance(v, str) else yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def _by_type(type_name: str) -> st.SearchStrategy:
    typed = {"int": st.integers(-100, 10**6), "float": st.floats(allow_nan=True, allow_infinity=True),
             "bool": st.booleans(), "str": st.text(max_size=30), "list": st.lists(SCALARS, max_size=5),
             "dict": st.dictionaries(st.text(max_size=8), SCALARS, max_size=3)}[type_name]
    return st.one_of(typed, VALUES)


PHASES = [p for p in available_phases() if p.startswith("phase")]


@pytest.mark.parametrize("phase", PHASES)
def test_generated_phase_parameters_are_accepted_or_refused_cleanly(phase: str) -> None:
    specs = {k: s for k, s in notebook_param_specs(notebook_path(phase)).items() if k not in ("target", "run_id")}

    @settings(max_examples=examples(60), deadline=2000, suppress_health_check=[HealthCheck.too_slow])
    @given(st.fixed_dictionaries({}, optional={k: _by_type(s.type_name) for k, s in specs.items()}))
    def check(values: dict) -> None:
        try:
            validate(phase, "local-tiny", {k: _as_cli(v) for k, v in values.items()})
        except ParamError as exc:
            assert "\n" not in str(exc).strip()

    check()


LAUNCH_KEYS = ["parallel", "threads", "batch_size", "extra_args", "spec", "context_length", "mem_fraction",
               "tp_size", "docker", "mode", "n_gpu_layers", "binary"]
TARGET = yaml.safe_load((ROOT / "params/targets/local-tiny.yaml").read_text())


@settings(max_examples=examples(300), deadline=2000)
@given(engine=st.sampled_from(["llamacpp", "vllm", "sglang"]),
       top=st.dictionaries(st.sampled_from(["name", "engine", "model", "port", "launch", "env", "nodes", "scale",
                                            "gate", "preflight", "description"]), VALUES, max_size=3),
       launch=st.dictionaries(st.sampled_from(LAUNCH_KEYS), VALUES, max_size=3),
       nodes=st.one_of(st.none(), st.lists(st.dictionaries(st.sampled_from(["name", "kind", "role", "host", "port",
                                                                            "gpus", "netdevs"]), VALUES,
                                                           max_size=4), max_size=2)))
def test_generated_target_files_are_accepted_or_refused_cleanly(engine: str, top: dict, launch: dict,
                                                                 nodes: list | None) -> None:
    raw = {**TARGET, "engine": engine, "launch": {**TARGET["launch"], **launch}}
    if nodes is not None:
        raw["nodes"] = nodes
    raw.update(top)
    try:
        target_from_dict(raw, "generated")
    except ParamError:
        pass
