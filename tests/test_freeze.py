"""Phase 0's freeze: the engine's packages read with its own interpreter, its commit, its image, the model's
checksums on the node — the parsers on real probe outputs (``tests/data/freeze``), the hashing script on real files,
the A/B guard on frozen manifests, and Phase 0 itself on the real SGLang venv, locally and on two sshd nodes."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from servelab.deploy.engines import engine_for
from servelab.deploy.facts import (NodeFreeze, engine_env, parse_direct_url, parse_image_inspect, parse_software,
                                   weight_checksums, weights_fingerprint)
from servelab.deploy.hosts import LocalHost

DATA = Path(__file__).parent / "data" / "freeze"
ROOT = Path(__file__).resolve().parents[1]


def _read(name: str) -> str:
    return (DATA / name).read_text()


# ---------------------------------------------------------------- parsers on real outputs

def test_sglang_cpu_venv_packages_and_no_commit():
    sw = parse_software(_read("software_sglang_cpu.json"))
    pk = sw["packages"].set_index("package")
    assert len(pk) == 140 and pk.loc["sglang", "version"] == "0.5.23" and pk.loc["torch", "version"] == "2.13.0+cpu"
    assert set(pk["installed_from"]) == {"index or wheel"} and (pk["commit"] == "").all()
    assert sw["python"] == "3.11.7" and sw["executable"].endswith("sglang-cpu-0.5.23/venv/bin/python")
    e = sw["engine"]
    assert (e["distribution"], e["version"], e["commit"]) == ("sglang", "0.5.23", "")
    assert e["commit_source"].startswith("not recorded: sglang 0.5.23 was installed from an index or a wheel")


def test_vcs_install_records_the_commit_it_was_built_from():
    sw = parse_software(_read("software_vcs_install.json"))
    e = sw["engine"]
    assert e["commit"] == "19275d76234f7e13c265c6f9cea735e2f2d85f0c"
    assert e["commit_source"] == ("direct_url.json of miniengine (git file:///tmp/fzvcs/src/miniengine@master)")
    row = sw["packages"].set_index("package").loc["miniengine"]
    assert row["installed_from"] == "git file:///tmp/fzvcs/src/miniengine@master" and row["commit"] == e["commit"]


def test_editable_checkout_gives_head_and_says_it_is_dirty():
    sw = parse_software(_read("software_editable_dirty.json"))
    e = sw["engine"]
    assert e["location"] == "/tmp/fzvcs/src/miniengine/miniengine"
    assert e["commit"] == "19275d76234f7e13c265c6f9cea735e2f2d85f0c-dirty"
    assert e["commit_source"] == "git checkout /tmp/fzvcs/src/miniengine (refs/heads/master): tracked files modified"
    assert sw["packages"].set_index("package").loc["miniengine", "installed_from"] == \
        "editable folder file:///tmp/fzvcs/src/miniengine"


def test_direct_url_kinds():
    raw = json.loads(_read("software_vcs_install.json"))
    du = next(p["direct_url"] for p in raw["packages"] if p["name"] == "miniengine")
    assert parse_direct_url(du)["commit"] == "19275d76234f7e13c265c6f9cea735e2f2d85f0c"
    assert parse_direct_url(None) == {} and parse_direct_url("") == {}
    assert parse_direct_url("{broken")["source"] == "unreadable direct_url.json"


def test_image_inspect_gives_id_tags_and_revision_label():
    img = parse_image_inspect(_read("docker_image_inspect.json"))
    assert img["id"] == "sha256:59809cb35fdec3b91f7a9791c8ab4a1ac2c6847700dee0ed7132b41f97dc9a64"
    assert img["tags"] == ["servelab-test/llama-server:1"] and img["digests"] == []
    assert img["revision"] == "0c1e570"


def test_llamacpp_commit_from_its_version_output():
    text = _read("llamacpp_version.txt")
    assert engine_for("llamacpp").commit_from_version(text) == "0c1e570"
    assert engine_for("sglang").commit_from_version(text) == ""


def test_engine_interpreter_from_the_launch_plan():
    from servelab.deploy.targets import load_target
    t = load_target("example-2node")                    # docker mode, the image of the reference cluster
    bare = {**{k: v for k, v in t.launch.items() if k not in ("mode", "docker")}, "python": "/opt/sg/bin/python"}
    plans = engine_for("sglang").launch_plans(dataclasses.replace(t, launch=bare), 30000)
    env = engine_env(plans[0], engine_for("sglang"))
    assert (env.python, env.package, env.image) == ("/opt/sg/bin/python", "sglang", None)
    assert env.env == plans[0].env                     # bare: the probe sees the engine's environment
    docker = engine_for("sglang").launch_plans(t, 30000)
    env = engine_env(docker[0], engine_for("sglang"))
    assert (env.python, env.image, env.env) == ("python3", t.launch["docker"]["image"], None)
    argv, name = env.argv_for(["python3", "-c", "pass"], "run/1")
    assert argv[:3] == ["docker", "run", "--rm"] and argv[argv.index("--entrypoint") + 1] == "python3"
    assert argv[argv.index("--network") + 1] == "none" and name.startswith("servelab-probe-run-1-")
    assert engine_for("llamacpp").engine_python(["llama-server", "-m", "x.gguf"]) is None


@pytest.mark.slow
def test_compiled_engine_commit_and_executable_checksum(llama_server_binary, tmp_path):
    """llama.cpp (no Python packages): the commit from the head's `--version`, the binary's sha256, the GGUF's."""
    from servelab.deploy.facts import freeze_node
    from servelab.deploy.models import resolve_model
    from servelab.deploy.targets import load_target
    from servelab.deploy.server import plan_launch
    plans, model = plan_launch(load_target("local-tiny"))
    lc = engine_for("llamacpp")
    env = engine_env(plans[0], lc)
    assert env.python is None and env.argv[0] == str(llama_server_binary)
    f = freeze_node(LocalHost(), env, lc, model, "before", raw_dir=tmp_path / "raw")
    assert f.engine["commit"] == "0c1e570" and f.engine["version"] == "0.5.0-dev (build 1, commit 0c1e570)"
    assert f.engine["executable_sha256"] == hashlib.sha256(llama_server_binary.read_bytes()).hexdigest()
    assert f.packages.empty and f.notes == []
    assert f.weights["sha256"].tolist() == [hashlib.sha256(Path(resolve_model("tiny")).read_bytes()).hexdigest()]
    assert (tmp_path / "raw" / "version.txt").read_text().startswith("version: 0.5.0-dev")


# ---------------------------------------------------------------- hashing on the node

def test_weights_hashed_streamed_reused_when_unchanged_and_rehashed_when_modified(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(os.urandom(3 * 2**20 + 17))      # more than one 1 MiB read
    (model / ".cache").mkdir()
    (model / ".hidden").write_text("not a model file")
    host = LocalHost()
    first = weight_checksums(host, str(model))
    assert first["error"] == "" and first["bytes"] == 3 * 2**20 + 17 + 23
    f = first["files"].set_index("file")
    assert list(f.index) == ["config.json", "model.safetensors"] and set(f["how"]) == {"hashed"}
    assert f.loc["model.safetensors", "sha256"] == hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()
    again = weight_checksums(host, str(model), previous=first["files"])
    assert set(again["files"]["how"]) == {"unchanged since hashed"}
    assert again["files"]["sha256"].tolist() == first["files"]["sha256"].tolist()
    assert set(weight_checksums(host, str(model), previous=first["files"], rehash=True)["files"]["how"]) == {"hashed"}
    (model / "config.json").write_text('{"model_type": "mistral"}')          # same size, new content
    changed = weight_checksums(host, str(model), previous=first["files"])["files"].set_index("file")
    assert changed.loc["config.json", "how"] == "hashed"
    assert changed.loc["config.json", "sha256"] != f.loc["config.json", "sha256"]
    assert changed.loc["model.safetensors", "how"] == "unchanged since hashed"
    assert weights_fingerprint(first["files"]) != weights_fingerprint(changed.reset_index())
    one = weight_checksums(host, str(model / "model.safetensors"))
    assert weights_fingerprint(one["files"]) == f.loc["model.safetensors", "sha256"]     # a single file: its own
    missing = weight_checksums(host, str(tmp_path / "nope"))
    assert missing["error"] == f"no such file or folder on this node: {tmp_path / 'nope'}" and missing["files"].empty


# ---------------------------------------------------------------- the A/B guard compares the freeze

def _frozen(packages: pd.DataFrame, sha: str, image_id: str = "") -> dict:
    from servelab.deploy.freeze_tables import frozen_manifest
    weights = pd.DataFrame([{"file": "model.safetensors", "bytes": 10, "stat": [10, 0, 0, 0], "sha256": sha,
                             "seconds": 0.0, "how": "hashed"}])
    f = NodeFreeze(node="node5", moment="before", engine={"name": "sglang", "distribution": "sglang",
                                                          "version": "0.5.23", "commit": "", "python": "3.11.7"},
                   packages=packages, weights=weights,
                   image={"name": "lmsys/sglang:v0.5.23", "id": image_id} if image_id else None)
    return frozen_manifest({"node5": f})


def _run(outputs: Path, run_id: str, frozen: dict | None) -> Path:
    from servelab.core.run import init_run, update_manifest
    rdir = init_run(run_id, "example-2node")
    update_manifest(rdir, engine={"name": "sglang"}, **({"frozen": frozen} if frozen is not None else {}))
    return rdir


def test_ab_guard_flags_a_package_a_weight_and_an_image_that_differ(outputs):
    from servelab.measure.abtest import diff_manifests, load_run
    pk = parse_software(_read("software_sglang_cpu.json"))["packages"]
    upgraded = pk.copy()
    upgraded.loc[upgraded["package"] == "transformers", "version"] = "5.20.0"
    a = _run(outputs, "fz-a", _frozen(pk, "aa" * 32, "sha256:" + "1" * 64))
    b = _run(outputs, "fz-b", _frozen(upgraded, "bb" * 32, "sha256:" + "2" * 64))
    same = _run(outputs, "fz-c", _frozen(pk, "aa" * 32, "sha256:" + "1" * 64))
    d = diff_manifests([load_run(a), load_run(b)], "chunked_prefill_size").set_index("key")
    for key, what in (("frozen.node5.packages.transformers", "package transformers version"),
                      ("frozen.node5.weights.model.safetensors", "model file model.safetensors sha256"),
                      ("frozen.node5.image_id", "image id")):
        assert d.loc[key, "status"] == "confound" and d.loc[key, "note"].startswith(what), key
    assert d.loc["frozen.node5.packages.transformers", "category"] == "software"
    assert d.loc["frozen.node5.weights.model.safetensors", "category"] == "model"
    assert not diff_manifests([load_run(a), load_run(same)])["key"].str.startswith("frozen").any()
    # a declared model change explains the checksums, not the package
    d = diff_manifests([load_run(a), load_run(b)], "model").set_index("key")
    assert d.loc["frozen.node5.weights.model.safetensors", "status"] == "derived"
    assert d.loc["frozen.node5.packages.transformers", "status"] == "confound"
    # a declared image change explains image id and packages
    d = diff_manifests([load_run(a), load_run(b)], "docker.image").set_index("key")
    assert d.loc["frozen.node5.image_id", "status"] == "derived"
    assert d.loc["frozen.node5.packages.transformers", "status"] == "derived"


def test_ab_guard_says_once_when_only_one_run_froze_its_environment(outputs):
    from servelab.measure.abtest import diff_manifests, load_run
    pk = parse_software(_read("software_sglang_cpu.json"))["packages"]
    a = _run(outputs, "fz-d", _frozen(pk, "aa" * 32))
    b = _run(outputs, "fz-e", None)
    d = diff_manifests([load_run(a), load_run(b)], "chunked_prefill_size")
    rows = d[d["key"].str.startswith("frozen")]
    assert rows["key"].tolist() == ["frozen"] and rows.iloc[0]["status"] == "confound"
    assert "run Phase 0 in each" in rows.iloc[0]["note"]


# ---------------------------------------------------------------- Phase 0 on the real SGLang venv

def _page_tables(page: Path) -> str:
    import html as htmllib
    return htmllib.unescape(page.read_text())


@pytest.mark.slow
def test_phase0_page_lists_packages_commit_and_checksums_before_and_after(outputs, sglang_python):
    """`servelab run phase0 --target local-sglang -p start_engine=false`: the probes run with the sglang-cpu venv's
    interpreter (never servelab's) and hash the tiny HF model before and after."""
    from servelab.cli import main
    from servelab.core.run import read_commands, read_manifest
    assert main(["run", "phase0", "--target", "local-sglang", "--run-id", "fz-sg", "-p", "start_engine=false"]) == 0
    rdir = outputs / "fz-sg"
    m = read_manifest(rdir)
    fz = m["frozen"]["local"]
    assert fz["engine"] == "sglang 0.5.23" and fz["packages"]["torch"] == "2.13.0+cpu"
    assert fz["packages"]["sglang"] == "0.5.23" and "pytest" not in fz["packages"]     # not servelab's venv
    model = Path(m["model"]["path"])
    assert fz["weights"]["model.safetensors"] == hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()
    assert m["frozen_changes"] == [] and m["phases"]["phase0"]["status"] == "success"
    frozen = pd.read_csv(rdir / "phase0" / "frozen.csv").set_index("item")
    assert frozen.loc["engine", "before"] == frozen.loc["engine", "after"] == "sglang 0.5.23"
    assert (frozen["changed"] == "same").all()
    packages = pd.read_csv(rdir / "phase0" / "packages.csv").set_index("package")
    assert packages.loc["torch", "local before"] == packages.loc["torch", "local after"] == "2.13.0+cpu"
    weights = pd.read_csv(rdir / "phase0" / "weights.csv").set_index("file")
    assert weights.loc["model.safetensors", "after"] == "unchanged since hashed"
    assert str(sglang_python) in {r.argv[0] for r in read_commands(rdir, "phase0") if r.title.startswith("freeze")}
    page = _page_tables(rdir / "phase0" / "report.html")
    for text in ("Frozen environment, per node, before and after", "local before", "local after", "2.13.0+cpu",
                 fz["weights"]["model.safetensors"], "not recorded: sglang 0.5.23 was installed from an index",
                 "What changed between before and after"):
        assert text in page, text


@pytest.fixture(scope="module")
def sglang_python():
    from servelab.deploy.sglang_cpu import cached_sglang_cpu, ensure_sglang_cpu
    return cached_sglang_cpu() or ensure_sglang_cpu()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).parent))
    from sshd import sshd_pair
    yield from sshd_pair(tmp_path_factory)


@pytest.mark.slow
def test_phase0_freezes_every_node_over_ssh(nodes, outputs, sglang_python, tmp_path):
    """Two SSH nodes: the engine's interpreter and the hashing run on each node (``host`` of every recorded probe);
    a model file changed afterwards is hashed again on the node, the others keep their hash."""
    from servelab.cli import main
    from servelab.core.run import read_commands, read_manifest
    from servelab.deploy.models import TINY_HF_KEY
    from servelab.deploy.sglang_cpu import resolve_sglang_cpu
    a, b, known = nodes
    src, _ = resolve_sglang_cpu(TINY_HF_KEY, {})
    model = tmp_path / "tiny-hf"
    model.mkdir()
    for f in Path(src).iterdir():
        if f.is_file():
            (model / f.name).write_bytes(f.read_bytes())
    node = dict(kind="ssh", user="root", known_hosts=str(known))
    raw = {"name": "two-node-sglang", "engine": "sglang", "model": str(model), "api_host": "127.0.0.2",
           "launch": {"python": str(sglang_python), "device": "cpu"},
           "nodes": [dict(node, name="head", role="head", host="127.0.0.2", port=a.port, key_file=str(a.client_key),
                          workdir=str(tmp_path / "head")),
                     dict(node, name="worker", role="worker", host="127.0.0.3", port=b.port,
                          key_file=str(b.client_key), workdir=str(tmp_path / "worker"))]}
    target = tmp_path / "two-node-sglang.yaml"
    target.write_text(yaml.safe_dump(raw))
    assert main(["run", "phase0", "--target", str(target), "--run-id", "fz-ssh", "-p", "start_engine=false"]) == 0
    rdir = outputs / "fz-ssh"
    m = read_manifest(rdir)
    assert set(m["frozen"]) == {"head", "worker"}
    for n in ("head", "worker"):
        assert m["frozen"][n]["packages"]["sglang"] == "0.5.23" and m["frozen"][n]["python"] == "3.11.7"
        assert m["frozen"][n]["weights"] == m["frozen"]["head"]["weights"]
    probes = [r for r in read_commands(rdir, "phase0") if r.title.startswith("freeze")]
    assert {r.title for r in probes} >= {f"freeze {t}: {w} on {n}" for t in ("before", "after") for n in ("head", "worker")
                                         for w in ("packages", "model files (sha256)")}
    assert all(r.host == r.title.rsplit(" on ", 1)[1] and r.exit_code == 0 for r in probes)
    packages = pd.read_csv(rdir / "phase0" / "packages.csv")
    assert {"head before", "head after", "worker before", "worker after"} <= set(packages.columns)
    page = _page_tables(rdir / "phase0" / "report.html")
    assert "worker after" in page and m["frozen"]["worker"]["weights"]["model.safetensors"] in page

    # a model file changed on the worker: hashed again there (its stat changed), the others keep their hash
    from servelab.deploy.hosts import connect
    from servelab.deploy.targets import load_target
    (model / "generation_config.json").write_text((model / "generation_config.json").read_text() + " ")
    worker = connect(load_target(str(target)).nodes[1])
    try:
        before = pd.read_json(rdir / "phase0" / "raw" / "worker" / "freeze-after" / "weights.jsonl", lines=True)
        again = weight_checksums(worker, str(model), previous=before)["files"].set_index("file")
    finally:
        worker.close()
    assert again.loc["generation_config.json", "how"] == "hashed"
    assert again.loc["generation_config.json", "sha256"] != m["frozen"]["worker"]["weights"]["generation_config.json"]
    assert set(again.drop(index="generation_config.json")["how"]) == {"unchanged since hashed"}
