"""No planted secret reaches outputs/, the archive or the process list, end to end through the CLI on a real
llama-server, in every phase 0-9 and in `servelab case`; a script payload in a target value renders as text.

Planted, each a fresh random value:

- ``HF_TOKEN=hf_<30 random>`` in the process environment (hence the notebook kernel's) and in the target's ``env``;
- ``WANDB_API_KEY=<random>`` in the target's ``env`` (no recognisable shape: only its name and value say "secret");
- the head's API key through ``api_key_env: SERVELAB_E2E_API_KEY`` (a random value in the process environment;
  llama-server reads it from ``LLAMA_API_KEY``, every request sends it);
- ``--hf-token <random>`` in the target's ``launch.extra_args`` (llama-server accepts it and, serving a local
  ``-m`` model, never uses it), so it is in the engine's argv, the recorded commands and ``ps`` output;
- ``SERVELAB_MIRROR_URL=http://u:<random>@127.0.0.1:9/m?token=<random>`` in the target's ``env`` (a name that
  says nothing: the URL's password and query token must be caught by their place in the URL).

Phases 0-3 and 5-9 run through ``servelab run`` with ``-p threads=2`` (a launch override: the run writes a derived
target file), the cheapest parameters each phase takes; Phase 1's case P1 is re-run with ``servelab case``; Phase 4
is executed with plain papermill and Phase 5 again the way JupyterLab runs it (its kernel started with
``JPY_SESSION_NAME``), each with a cell a user might add that prints the target's environment and API key, then
taken in by ``servelab render RUN_ID PHASE``; finally ``servelab archive --zip``. Every byte of every file under the run folder
and of every zip member is searched for each planted value, and ``ps`` is sampled all along: no planted value but
the one the user put in argv (``--hf-token``) ever shows in a process's command line."""
from __future__ import annotations

import json
import os
import secrets
import string
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest
import yaml

from servelab.cli import main
from servelab.core.params import ParamError
from servelab.core.run import REDACTED, read_commands, read_manifest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "redact-e2e"
XSS = "<img src=x onerror=alert(1)>"
API_KEY_ENV = "SERVELAB_E2E_API_KEY"
PHASES = {
    "phase0": [],
    "phase1": ["-p", "cases=[P1,D1]", "-p", "search=false"],
    "phase2": ["-p", "cases=[P1]", "-p", "interval_s=1"],
    "phase3": [],
    "phase6": [],
    "phase7": ["-p", "n_injections=2", "-p", "inject_input_tokens=1024", "-p", "background_output_tokens=128",
               "-p", "window_steps=8"],
    "phase8": ["-p", "rates=[0.0,0.5]", "-p", "bad_point=false"],
    "phase9": ["-p", "output_tokens=64"],
}
# a cell a user might add in JupyterLab (or to a notebook run with plain papermill): the target's secrets in an output
LEAKY_CELL = "print(ctx.target.env, ctx.target.api_key(), ctx.target.launch.get('extra_args'))"


def _rand(n: int) -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(n))


# the process list sampled by a process of its own (a thread of this one would starve while the phases run here):
# `ps -ww -eo args` every 0.2 s; the planted values come in its environment (never its argv), hits go to a JSON file
_PS_SAMPLER = r"""
import json, os, signal, subprocess, sys, time
values = json.loads(os.environ.pop("SERVELAB_E2E_WATCH"))
hits, samples, stop = {}, 0, []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
while not stop:
    out = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    samples += 1
    for line in out.splitlines():
        for what, v in values.items():
            if v in line:
                hits.setdefault(what, line[:300])
    time.sleep(0.2)
with open(sys.argv[1], "w") as f:
    json.dump({"samples": samples, "hits": hits}, f)
"""


class PsWatch:
    """``ps`` sampled by its own process while the phases run: the command lines holding a planted value."""

    def __init__(self, values: dict[str, str], out: Path):
        self.values, self.out, self.hits, self.samples = values, out, {}, 0

    def __enter__(self) -> "PsWatch":
        import json
        self.proc = subprocess.Popen([sys.executable, "-c", _PS_SAMPLER, str(self.out)],
                                     env={**os.environ, "SERVELAB_E2E_WATCH": json.dumps(self.values)})
        return self

    def __exit__(self, *exc: object) -> None:
        import json
        self.proc.terminate()
        self.proc.wait(30)
        got = json.loads(self.out.read_text())
        self.hits, self.samples = got["hits"], got["samples"]


def _with_leaky_cell(phase_nb: str, dest: Path) -> Path:
    nb = nbformat.read(str(ROOT / "notebooks" / phase_nb), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(LEAKY_CELL))
    nbformat.write(nb, str(dest))
    return dest


@pytest.fixture(scope="module")
def planted(tmp_path_factory, llama_server_binary):
    import papermill as pm
    root = tmp_path_factory.mktemp("redact")
    vals = {"hf_token": "hf_" + _rand(30), "wandb": "wb" + _rand(28), "hf_arg": "arg" + _rand(27),
            "url_pw": "pw" + _rand(20), "url_tok": "tq" + _rand(20), "api_key": "ak" + _rand(28)}
    raw = yaml.safe_load((ROOT / "params" / "targets" / "local-tiny.yaml").read_text())
    raw["name"] = "local-tiny-secret"
    raw["description"] = f"tiny with planted secrets and a payload {XSS}"
    raw["env"] = {"HF_TOKEN": vals["hf_token"], "WANDB_API_KEY": vals["wandb"],
                  "SERVELAB_MIRROR_URL": f"http://u:{vals['url_pw']}@127.0.0.1:9/m?token={vals['url_tok']}",
                  "NCCL_SOCKET_IFNAME": XSS}
    raw["api_key_env"] = API_KEY_ENV
    raw["launch"]["extra_args"] = ["--hf-token", vals["hf_arg"]]
    target = root / "local-tiny-secret.yaml"
    target.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = root / "outputs"
    work = root / "user"                   # the user's own folder: executed notebooks outside the run
    work.mkdir()
    old = {k: os.environ.get(k) for k in ("SERVELAB_OUTPUTS", "HF_TOKEN", API_KEY_ENV, "JPY_SESSION_NAME")}
    os.environ.update({"SERVELAB_OUTPUTS": str(out), "HF_TOKEN": vals["hf_token"], API_KEY_ENV: vals["api_key"]})
    rcs: dict[str, int] = {}
    try:
        with PsWatch(vals, root / "ps.json") as ps:
            for p, extra in PHASES.items():
                rcs[p] = main(["run", p, "--target", str(target), "--run-id", RUN_ID, "-p", "threads=2", *extra])
                if p == "phase1":
                    rcs["case"] = main(["case", RUN_ID, "P1", "--target", str(target)])
            # Phase 4 with plain papermill, a leaky cell added; `servelab render` takes the notebook in
            pm_out = work / "phase4-out.ipynb"
            r = subprocess.run([str(Path(sys.executable).parent / "papermill"),
                                str(_with_leaky_cell("phase4_topology.ipynb", work / "phase4.ipynb")), str(pm_out),
                                "-p", "run_id", RUN_ID, "-p", "target", str(target), "--no-progress-bar"],
                               cwd=ROOT, capture_output=True, text=True, timeout=600)
            rcs["phase4 papermill"] = r.returncode
            # Phase 5 as JupyterLab runs it: the kernel's JPY_SESSION_NAME names the notebook file it saves to
            lab_nb = work / "phase5-lab.ipynb"
            os.environ["JPY_SESSION_NAME"] = str(lab_nb)
            try:
                pm.execute_notebook(str(_with_leaky_cell("phase5_comm.ipynb", work / "phase5.ipynb")), str(lab_nb),
                                    parameters={"run_id": RUN_ID, "target": str(target)}, cwd=str(ROOT),
                                    kernel_name="python3", progress_bar=False)
                rcs["phase5 lab"] = 0
            finally:
                os.environ.pop("JPY_SESSION_NAME", None)
            rcs["render"] = max(main(["render", RUN_ID, "phase4"]), main(["render", RUN_ID, "phase5"]))
            rcs["archive"] = main(["archive", RUN_ID, "--zip"])
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    leaked = {k: pm_out.read_text().count(v) for k, v in vals.items()}      # the user's own copies do hold them
    return out / RUN_ID, out / f"{RUN_ID}.zip", vals, rcs, ps, {"papermill": pm_out, "lab": lab_nb, "leaked": leaked}


def test_phases_ran_with_the_planted_secrets(planted):
    rdir, _, vals, rcs, ps, user = planted
    m = read_manifest(rdir)
    every = ["phase0", "phase1", "phase2", "phase3", "phase6", "phase7", "phase8", "phase9",
             "phase4 papermill", "phase5 lab", "render", "archive"]
    assert {k: rcs[k] for k in every} == {k: 0 for k in every}, \
        {p: m["phases"].get(p, {}).get("error") for p in m.get("phases", {})}
    # `servelab case` exits 1 for an INVALID attempt (a loaded machine can stall the client): it ran all the same
    meta = json.loads((rdir / "cases" / "P1@a2" / "meta.json").read_text())
    assert rcs["case"] in (0, 1) and meta["status"] == "success", meta.get("error")
    assert {f"phase{i}" for i in range(10)} <= set(m["phases"])
    assert all(m["phases"][f"phase{i}"]["status"] in ("success", "unsupported") for i in range(10)), \
        {p: (e.get("status"), e.get("error")) for p, e in m["phases"].items()}
    starts = [r for r in read_commands(rdir) if r.title.startswith("start llamacpp")]
    assert {r.phase for r in starts} >= {"phase0", "phase1", "phase2", "phase7", "phase8", "phase9"}
    for r in starts:      # the secrets were really in the engine's argv and env — and recorded redacted
        assert r.argv[r.argv.index("--hf-token") + 1] == REDACTED
        assert r.env["HF_TOKEN"] == REDACTED and r.env["WANDB_API_KEY"] == REDACTED
        assert r.env["LLAMA_API_KEY"] == REDACTED                      # the API key, the engine's own way
        assert r.env["SERVELAB_MIRROR_URL"] == f"http://u:{REDACTED}@127.0.0.1:9/m?token={REDACTED}"
    # the re-run of P1 ran as attempt 2, with its engine log and excerpt beside the first
    assert (rdir / "cases" / "P1@a2" / "server" / "engine_log_excerpt.txt").is_file()
    assert list((rdir / "phase1" / "server" / "P1@a2").glob("*.log"))
    # the leaky cells really printed the secrets: the user's own executed notebooks hold them
    assert user["leaked"]["hf_token"] and user["leaked"]["api_key"] and user["leaked"]["wandb"]
    assert vals["api_key"] in user["lab"].read_text()
    # both notebooks were taken into the run by `servelab render`
    assert m["phases"]["phase4"]["executed_notebook"] == str(user["papermill"])
    assert m["phases"]["phase5"]["executed_notebook"] == str(user["lab"])
    for p in ("phase4", "phase5"):
        assert "ctx.target.api_key()" in (rdir / p / "notebook.ipynb").read_text()
        assert (rdir / p / "report.html").is_file()


def test_no_planted_value_in_the_process_list_while_running(planted):
    *_, vals, _, ps, _ = planted
    assert ps.samples > 100
    # the one the user put in argv (--hf-token in extra_args) is in the engine's command line: ps shows it
    assert "hf_arg" in ps.hits
    assert {k: v for k, v in ps.hits.items() if k != "hf_arg"} == {}


def test_no_planted_value_under_the_run_folder(planted):
    rdir, _, vals, *_ = planted
    files = [f for f in rdir.rglob("*") if f.is_file()]
    assert len(files) > 50 and any(f.suffix == ".ipynb" for f in files)
    for f in files:
        data = f.read_bytes()
        for what, v in vals.items():
            assert v.encode() not in data, f"{what} found in {f.relative_to(rdir)}"


def test_no_planted_value_in_the_zip(planted):
    rdir, zpath, vals, *_ = planted
    with zipfile.ZipFile(zpath) as z:
        names = z.namelist()
        for p in ("phase0", "phase4", "phase5"):
            assert f"{RUN_ID}/{p}/notebook.ipynb" in names
        assert f"{RUN_ID}/phase7/report.html" in names and f"{RUN_ID}/cases/P1@a2/summary.json" in names
        for name in names:
            data = z.read(name)
            for what, v in vals.items():
                assert v.encode() not in data, f"{what} found in zip member {name}"


def test_derived_target_names_its_secrets(planted, monkeypatch):
    from servelab.deploy.targets import load_target
    rdir, _, vals, *_ = planted
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
    rdir, *_ = planted
    page = (rdir / "phase0" / "report.html").read_text()
    assert "&lt;img src=x onerror=alert(1)&gt;" in page          # the comm env table shows it, as text
    assert XSS not in page
    for f in [*rdir.rglob("*.html")]:
        assert XSS not in f.read_text(), f


def test_memory_tables_of_phase_1_and_8(planted):
    """The memory layer on the same run's pages (llama.cpp): Phase 1 at the default log level exposes none of it,
    Phase 8 runs llama-server at ``-lv 4`` and reads its buffers from the start-up lines."""
    import pandas as pd
    rdir, *_ = planted
    p1 = pd.read_csv(rdir / "phase1" / "memory_per_case.csv").set_index("case")
    assert {"P1", "D1"} <= set(p1.index) and (p1["output TPS (tok/s)"] > 0).all()
    assert (p1["weights (GiB)"] == "not exposed").all() and (p1["KV pool (tokens)"] == "not exposed").all()
    p8 = pd.read_csv(rdir / "phase8" / "memory_per_point.csv")
    src = pd.read_csv(rdir / "phase8" / "memory_sources.csv").set_index("quantity")["source"]
    assert (p8["weights (GiB)"].astype(float) > 0).all() and (p8["KV pool (tokens)"].astype(float) > 0).all()
    assert src["workspace peak (GiB)"].startswith('engine log: "')         # llama.cpp's compute buffers
    page = (rdir / "phase1" / "report.html").read_text()
    assert "Memory per case, beside the throughput it limits" in page

