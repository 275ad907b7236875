"""Parameters and targets are validated before anything runs; typos name the closest key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from servelab.core.params import ParamError, notebook_param_specs, parse_overrides

from servelab.deploy.targets import load_target, target_from_dict
from servelab.core.notebooks import NOTEBOOKS, notebook_path
from servelab.phases import definition

ROOT = Path(__file__).resolve().parents[1]


def test_every_target_file_is_valid():
    for p in (ROOT / "params" / "targets").glob("*.yaml"):
        t = load_target(str(p))
        assert t.nodes and t.head.role == "head", p


def test_example_cluster_is_documentation_with_the_reference_topology():
    t = load_target("example-2node")
    assert t.engine == "sglang" and t.launch["tp_size"] == 16 and len(t.nodes) == 2
    assert t.gate["required_hcas"] == ["mlx5_0", "mlx5_3"]
    assert t.env["NCCL_IB_HCA"] == "mlx5_0,mlx5_3"


def test_unknown_target_key_names_the_closest():
    with pytest.raises(ParamError, match="did you mean 'engine'"):
        target_from_dict({"name": "x", "engin": "llamacpp", "model": "tiny", "engine": "llamacpp"})
    with pytest.raises(ParamError, match="did you mean 'local'"):
        load_target("locl")


def test_unknown_launch_key_is_rejected_per_engine():
    with pytest.raises(ParamError, match="did you mean 'tp_size'"):
        target_from_dict({"name": "x", "engine": "sglang", "model": "/m", "launch": {"tp_sise": 8}})
    with pytest.raises(ParamError, match="must be 1"):
        target_from_dict({"name": "x", "engine": "llamacpp", "model": "tiny", "launch": {"tp_size": 2}})


def test_phase_params_typo_and_type_errors():
    nb = notebook_path("phase0")
    specs = notebook_param_specs(nb)
    assert specs["run_id"].type_name == "str" and specs["start_engine"].default is True
    phase0 = definition("phase0")
    with pytest.raises(ParamError, match="did you mean 'start_engine'"):
        phase0.resolve(overrides={"start_engin": "false"})
    with pytest.raises(ParamError, match="must be float"):
        phase0.resolve(overrides={"health_timeout_s": "soon"})
    out = phase0.resolve(overrides={"start_engine": "false", "health_timeout_s": "12"}).as_dict()
    assert out["start_engine"] is False and out["health_timeout_s"] == 12.0


def test_overrides_syntax():
    assert parse_overrides(["a=1", "b=x=y"]) == {"a": "1", "b": "x=y"}
    with pytest.raises(ParamError, match="key=value"):
        parse_overrides(["tp16"])


def test_unknown_phase_names_the_closest():
    with pytest.raises(ParamError, match="did you mean 'phase1'"):
        notebook_path("phase11")


def test_every_notebook_parameter_is_visible_to_papermill():
    import papermill as pm
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        specs = notebook_param_specs(nb)
        assert {"run_id", "target"} <= set(specs), nb.name
        assert set(pm.inspect_notebook(str(nb))) == set(specs), nb.name


@pytest.mark.parametrize("phase", sorted(NOTEBOOKS))
def test_each_notebooks_parameters_cell_is_its_definition_written_out(phase: str) -> None:
    """A phase's parameters are defined once (its module's ``Params``): the notebook's ``parameters`` cell is that
    definition written out, line for line — names, types, defaults, help and rules."""
    nb = notebook_path(phase)
    cell = next(c for c in json.loads(nb.read_text())["cells"] if "parameters" in c["metadata"].get("tags", []))
    defn = definition(phase)
    assert "".join(cell["source"]) == defn.cell_source(), \
        f"{nb.name}'s parameters cell differs from {defn.__module__}.Params: paste `servelab params {phase} --cell`"
    assert notebook_param_specs(nb) == defn.specs()
    assert defn.phase == phase and list(defn.specs())[:2] == ["target", "run_id"]


def test_a_definition_resolves_typed_and_checked_and_its_cell_changes_with_it() -> None:
    from dataclasses import FrozenInstanceError
    defn = definition("phase4")
    p = defn.resolve(overrides={"concurrency": "8", "layouts": "[TP16]"}, phase_file_values=False)
    assert (p.concurrency, p.layouts, p.model_config) == (8, ["TP16"], "deepseek-v3")
    with pytest.raises(FrozenInstanceError):
        p.concurrency = 2
    assert p.replace(concurrency=4).concurrency == 4 and p.concurrency == 8
    with pytest.raises(ParamError, match="'concurrency' must be >= 1"):
        defn.resolve(overrides={"concurrency": "0"}, phase_file_values=False)
    with pytest.raises(ParamError, match="did you mean 'concurrency'"):
        defn.resolve(overrides={"concurency": "8"}, phase_file_values=False)
    assert defn().layouts is not defn().layouts            # a fresh list per instance
    assert 'concurrency: int = 16  # requests at full context' in defn.cell_source()
