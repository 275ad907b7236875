"""Run directory contract: manifest with schema/tool/git, commands with three labels, secrets redacted."""
from __future__ import annotations

import json

import pytest

from servelab.core import run as runlib
from servelab.report.commands import commands_html


def test_manifest_and_commands(outputs):
    rdir = runlib.init_run("t-1", "local")
    m = runlib.read_manifest(rdir)
    assert m["schema_version"] == runlib.SCHEMA_VERSION and m["tool"]["name"] == "servelab"
    assert "commit" in m["tool"] and "dirty" in m["tool"]
    runlib.record_command(rdir, runlib.CommandRecord("executed", ["llama-server", "--api-key", "sk-abcdefghijklmnopqrstu"],
                                                     phase="phase0", title="start", env={"HF_TOKEN": "hf_x",
                                                                                          "NCCL_IB_HCA": "mlx5_0"}))
    runlib.record_command(rdir, runlib.CommandRecord("planned", ["nsys", "profile", "<b>x</b>"], phase="phase0"))
    with pytest.raises(ValueError):
        runlib.record_command(rdir, runlib.CommandRecord("maybe", ["x"]))
    raw = (rdir / "commands.jsonl").read_text()
    assert "sk-abcdefghijklmnopqrstu" not in raw and "hf_x" not in raw and "mlx5_0" in raw
    recs = runlib.read_commands(rdir, "phase0")
    assert [r.label for r in recs] == ["executed", "planned"]
    page = commands_html(rdir, "phase0")
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page
    assert "PLANNED — NOT EXECUTED" in page and "servelab-cmd-executed" in page


def test_update_manifest_redacts(outputs):
    rdir = runlib.init_run("t-2", "local")
    runlib.update_manifest(rdir, launch={"env": {"MY_API_KEY": "abc", "OTHER": "ghp_" + "a" * 30}})
    text = (rdir / "manifest.json").read_text()
    assert "abc" not in json.loads(text)["launch"]["env"]["MY_API_KEY"] and "ghp_" not in text


@pytest.mark.parametrize("argv,expected", [
    (["--token", "s3cret", "--port", "1"], ["--token", runlib.REDACTED, "--port", "1"]),
    (["--password=hunter2"], [f"--password={runlib.REDACTED}"]),
    (["AWS_SECRET_ACCESS_KEY=abc", "ls"], [f"AWS_SECRET_ACCESS_KEY={runlib.REDACTED}", "ls"]),
])
def test_redact_argv(argv, expected):
    assert runlib.redact_argv(argv) == expected


def test_run_id_validation():
    assert runlib.validate_run_id("demo-20261129-101010") == "demo-20261129-101010"
    for bad in ("../x", "a b", "", "x/y"):
        with pytest.raises(ValueError):
            runlib.validate_run_id(bad)


@pytest.mark.parametrize("name,secret", [("HF_TOKEN", True), ("api-key", True), ("OPENAI_API_KEY", True),
                                         ("db.password", True), ("AUTH", True), ("max_tokens", False),
                                         ("prefill_tokens", False), ("NCCL_IB_HCA", False), ("tokenizer", False)])
def test_secret_names(name, secret):
    assert runlib.is_secret_name(name) is secret


def _hammer(rdir: str, worker: int, n: int) -> None:
    from pathlib import Path
    for i in range(n):
        runlib.update_manifest(Path(rdir), phases={f"w{worker}_{i}": {"status": "success"}},
                               attempts=[{"worker": worker, "i": i}])
        runlib.edit_manifest(Path(rdir), lambda m: m.setdefault("counters", {}).__setitem__(
            f"w{worker}", m.get("counters", {}).get(f"w{worker}", 0) + 1))


def test_concurrent_manifest_writers_lose_no_key(outputs):
    """Processes updating one manifest at once (a phase, the CLI, a re-run): every key of every writer is there,
    every read-modify-write counted, and no temp file is left behind."""
    import multiprocessing as mp
    rdir = runlib.init_run("t-conc", "local")
    workers, n = 6, 15
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_hammer, args=(str(rdir), w, n)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    m = runlib.read_manifest(rdir)
    assert {f"w{w}_{i}" for w in range(workers) for i in range(n)} <= set(m["phases"])
    assert len(m["attempts"]) == workers * n
    assert m["counters"] == {f"w{w}": n for w in range(workers)}
    assert m["run_id"] == "t-conc" and m["tool"]["name"] == "servelab"
    assert not [p.name for p in rdir.iterdir() if p.name.endswith(".tmp")]


def test_write_json_atomic_leaves_the_old_file_when_serialising_fails(tmp_path):
    p = tmp_path / "x.json"
    runlib.write_json_atomic(p, {"a": 1})

    class Bad:
        def __str__(self):
            raise RuntimeError("no")
    with pytest.raises(RuntimeError):
        runlib.write_json_atomic(p, {"a": Bad()})
    assert json.loads(p.read_text()) == {"a": 1}
    assert [q.name for q in tmp_path.iterdir()] == ["x.json"]


def test_write_json_atomic_keeps_the_usual_permissions(tmp_path):
    import os
    p = tmp_path / "m.json"
    runlib.write_json_atomic(p, {"a": 1})
    umask = os.umask(0)
    os.umask(umask)
    assert p.stat().st_mode & 0o777 == 0o666 & ~umask
