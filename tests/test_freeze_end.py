"""The run-end freeze, real: an engine interpreter (a venv of the test's own, its packages installed as
dist-info folders the way pip leaves them) and a model folder are frozen as Phase 0 freezes them; then a package
and the engine are upgraded in that venv and one weight file is rewritten, and ``servelab freeze RUN_ID`` must
report each change per node, the run index must show them, and an A/B with the run must be marked."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from servelab.cli import main
from servelab.core import run as runlib
from servelab.deploy import hosts as hostlib
from servelab.deploy.engines import engine_for
from servelab.deploy.facts import engine_env, freeze_node, freeze_summary
from servelab.deploy.server import plan_launch
from servelab.deploy.targets import load_target
from servelab.measure.abtest import ab_compare


def _dist(site: Path, name: str, version: str) -> None:
    for old in site.glob(f"{name}-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (d / "INSTALLER").write_text("pip\n")
    (d / "RECORD").write_text("")


def test_run_end_freeze_reports_a_changed_package_and_marks_the_comparisons(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path / "out"))
    venv = tmp_path / "engine-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    _dist(site, "sglang", "0.5.23")
    _dist(site, "servelab_probe_dep", "1.0")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    doc = {"name": "freeze-probe", "description": "a venv and a model folder of the test's own", "engine": "sglang",
           "model": str(model), "api_host": "127.0.0.1", "port": 0, "scale": "local",
           "launch": {"python": str(venv / "bin" / "python"), "device": "cpu"},
           "nodes": [{"name": "local", "kind": "local", "role": "head"}]}
    tfile = tmp_path / "freeze-probe.yaml"
    tfile.write_text(yaml.safe_dump(doc))
    target = load_target(str(tfile))
    # Phase 0's freeze of the run, exactly as Phase 0 takes and records it
    rdir = runlib.init_run("frz", str(tfile))
    plans, model_path = plan_launch(target)
    host = hostlib.connect(target.nodes[0])
    try:
        before = freeze_node(host, engine_env(plans[0], engine_for("sglang")), engine_for("sglang"), model_path,
                             "before")
    finally:
        host.close()
    assert freeze_summary(before)["packages"]["servelab_probe_dep"] == "1.0"
    runlib.update_manifest(rdir, frozen={"local": freeze_summary(before)})
    other = runlib.init_run("frz-other", str(tfile))             # an A/B partner with no change
    runlib.update_manifest(other, frozen={"local": freeze_summary(before)})

    _dist(site, "servelab_probe_dep", "1.1")                    # upgraded while the run was going on
    _dist(site, "sglang", "0.5.24")
    (model / "model.safetensors").write_bytes(b"\1" * 4096)
    assert main(["freeze", "frz", "--target", str(tfile)]) == 0
    err = capsys.readouterr().err
    assert "run-end freeze: " in err and "servelab_probe_dep 1.0 → 1.1" in err
    m = runlib.read_manifest(rdir)
    changes = {(c["kind"], c["what"]): (c["before"], c["after"]) for c in m["frozen_end_changes"]}
    assert changes[("package", "package servelab_probe_dep")] == ("1.0", "1.1")
    assert changes[("engine", "package sglang")] == ("0.5.23", "0.5.24")         # the engine's own distribution
    assert ("weights", "model file model.safetensors") in changes and ("weights", "weights_sha256") in changes
    index = (rdir / "index.html").read_text()
    assert "environment at the end" in index and "servelab_probe_dep 1.0 → 1.1" in index
    assert "CHANGED engine, weights: the run&#x27;s comparisons are marked" in index or \
        "CHANGED engine, weights: the run's comparisons are marked" in index
    ab = ab_compare([other, rdir], "")
    assert any("local package sglang 0.5.23 → 0.5.24" in d for d in ab.drift)
    assert any(n.startswith("environment changed during the run") for n in ab.notes)
    # nothing to compare with: a one-line error, nothing written
    runlib.init_run("frz-none", str(tfile))
    assert main(["freeze", "frz-none"]) == 2
    assert "has no Phase 0 freeze to compare with" in capsys.readouterr().err
