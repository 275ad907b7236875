"""No planted secret reaches outputs/ or the archive, end to end through the CLI on a real llama-server; a script
payload in a target value renders as text on a non-Phase-3 page.

Planted, each a fresh random value:

- ``HF_TOKEN=hf_<30 random>`` in the process environment (hence the notebook kernel's) and in the target's ``env``;
- ``WANDB_API_KEY=<random>`` in the target's ``env`` (no recognisable shape: only its name and value say "secret");
- ``--hf-token <random>`` in the target's ``launch.extra_args`` (llama-server accepts it and, serving a local
  ``-m`` model, never uses it), so it is in the engine's argv, the recorded commands and ``ps`` output;
- ``SERVELAB_MIRROR_URL=http://u:<random>@127.0.0.1:9/m?token=<random>`` in the target's ``env`` (a name that
  says nothing: the URL's password and query token must be caught by their place in the URL).

Phases 0, 1 (two cases, no search), 7 and 9 run with ``-p threads=2`` (a launch override: the run writes a
derived target file), then ``servelab archive --zip``; every byte of every file under the run folder and of every
zip member is searched for each planted value."""
from __future__ import annotations

import os
import secrets
import string
import zipfile
from pathlib import Path

import pytest
import yaml

from servelab.cli import main
from servelab.core.params import ParamError
from servelab.core.run import REDACTED, read_commands, read_manifest

pytestmark = pytest.mark.slow

RUN_ID = "redact-e2e"
XSS = "<img src=x onerror=alert(1)>"
PHASES = {
    "phase0": [],
    "phase1": ["-p", "cases=[P1,D1]", "-p", "search=false"],
    "phase7": ["-p", "n_injections=2", "-p", "inject_input_tokens=1024", "-p", "background_output_tokens=128",
               "-p", "window_steps=8"],
    "phase9": ["-p", "output_tokens=64"],
}


def _rand(n: int) -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(n))


@pytest.fixture(scope="module")
def planted(tmp_path_factory, llama_server_binary):
    root = tmp_path_factory.mktemp("redact")
    vals = {"hf_token": "hf_" + _rand(30), "wandb": "wb" + _rand(28), "hf_arg": "arg" + _rand(27),
            "url_pw": "pw" + _rand(20), "url_tok": "tq" + _rand(20)}
    raw = yaml.safe_load((Path(__file__).parents[1] / "params" / "targets" / "local-tiny.yaml").read_text())
    raw["name"] = "local-tiny-secret"
    raw["description"] = f"tiny with planted secrets and a payload {XSS}"
    raw["env"] = {"HF_TOKEN": vals["hf_token"], "WANDB_API_KEY": vals["wandb"],
                  "SERVELAB_MIRROR_URL": f"http://u:{vals['url_pw']}@127.0.0.1:9/m?token={vals['url_tok']}",
                  "NCCL_SOCKET_IFNAME": XSS}
    raw["launch"]["extra_args"] = ["--hf-token", vals["hf_arg"]]
    target = root / "local-tiny-secret.yaml"
    target.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = root / "outputs"
    old = {k: os.environ.get(k) for k in ("SERVELAB_OUTPUTS", "HF_TOKEN")}
    os.environ["SERVELAB_OUTPUTS"] = str(out)
    os.environ["HF_TOKEN"] = vals["hf_token"]
    try:
        rcs = {p: main(["run", p, "--target", str(target), "--run-id", RUN_ID, "-p", "threads=2", *extra])
               for p, extra in PHASES.items()}
        rcs["archive"] = main(["archive", RUN_ID, "--zip"])
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out / RUN_ID, out / f"{RUN_ID}.zip", vals, rcs


def test_phases_ran_with_the_planted_secrets(planted):
    rdir, _, _, rcs = planted
    m = read_manifest(rdir)
    assert rcs == {**{p: 0 for p in PHASES}, "archive": 0}, {p: m["phases"].get(p, {}).get("error") for p in PHASES}
    starts = [r for r in read_commands(rdir) if r.title.startswith("start llamacpp")]
    assert starts, "no engine start recorded"
    for r in starts:      # the secrets were really in the engine's argv and env — and recorded redacted
        assert r.argv[r.argv.index("--hf-token") + 1] == REDACTED
        assert r.env["HF_TOKEN"] == REDACTED and r.env["WANDB_API_KEY"] == REDACTED
        assert r.env["SERVELAB_MIRROR_URL"] == f"http://u:{REDACTED}@127.0.0.1:9/m?token={REDACTED}"


def test_no_planted_value_under_the_run_folder(planted):
    rdir, _, vals, _ = planted
    files = [f for f in rdir.rglob("*") if f.is_file()]
    assert len(files) > 50 and any(f.suffix == ".ipynb" for f in files)
    for f in files:
        data = f.read_bytes()
        for what, v in vals.items():
            assert v.encode() not in data, f"{what} found in {f.relative_to(rdir)}"


def test_no_planted_value_in_the_zip(planted):
    rdir, zpath, vals, _ = planted
    with zipfile.ZipFile(zpath) as z:
        names = z.namelist()
        assert f"{RUN_ID}/phase0/notebook.ipynb" in names and f"{RUN_ID}/phase7/report.html" in names
        for name in names:
            data = z.read(name)
            for what, v in vals.items():
                assert v.encode() not in data, f"{what} found in zip member {name}"


def test_derived_target_names_its_secrets(planted, monkeypatch):
    from servelab.deploy.targets import load_target
    rdir, _, vals, _ = planted
    derived = rdir / "targets" / "local-tiny-secret.yaml"
    raw = yaml.safe_load(derived.read_text())
    assert raw["env"]["HF_TOKEN"] == "${HF_TOKEN}" and raw["env"]["WANDB_API_KEY"] == "${WANDB_API_KEY}"
    assert raw["launch"]["threads"] == 2 and raw["launch"]["extra_args"][0] == "--hf-token"
    arg_ref = raw["launch"]["extra_args"][1]
    assert arg_ref.startswith("${SERVELAB_SECRET_ARG_")
    # still a usable target: with the names exported, it loads with the real values
    monkeypatch.setenv("HF_TOKEN", vals["hf_token"])
    monkeypatch.setenv("WANDB_API_KEY", vals["wandb"])
    monkeypatch.setenv("SERVELAB_MIRROR_URL", "http://127.0.0.1:9/m")
    monkeypatch.delenv(arg_ref[2:-1], raising=False)
    with pytest.raises(ParamError, match=arg_ref[2:-1].replace("$", r"\$")):
        load_target(str(derived))
    monkeypatch.setenv(arg_ref[2:-1], vals["hf_arg"])
    t = load_target(str(derived))
    assert t.env["HF_TOKEN"] == vals["hf_token"] and t.launch["extra_args"] == ["--hf-token", vals["hf_arg"]]


def test_script_payload_renders_as_text(planted):
    rdir, _, _, _ = planted
    page = (rdir / "phase0" / "report.html").read_text()
    assert "&lt;img src=x onerror=alert(1)&gt;" in page          # the comm env table shows it, as text
    assert XSS not in page
    for f in [*rdir.rglob("*.html")]:
        assert XSS not in f.read_text(), f
