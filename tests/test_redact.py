"""The one redaction routine (servelab.core.redact): names, shapes, URL credentials, query tokens, headers,
argv forms and the known-value scrub; files, notebooks and zips through the same routine."""
from __future__ import annotations

import json
from pathlib import Path
import secrets
import string
import zipfile

import nbformat
import pytest

from servelab.core import redact as rd
from servelab.core import run as runlib

R = rd.REDACTED


def rand(n: int = 30) -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(n))


def test_names_stay_importable_from_run():
    for name in ("redact", "redact_text", "redact_env", "redact_argv", "is_secret_name", "REDACTED"):
        assert getattr(runlib, name) is getattr(rd, name)


@pytest.mark.parametrize("name,secret", [
    ("HF_TOKEN", True), ("GITHUB_TOKEN", True), ("access-token", True), ("token", True), ("api-key", True),
    ("apiKey", True), ("X-Api-Key", True), ("WANDB_API_KEY", True), ("Authorization", True), ("SSHPASS", True),
    ("DB_PASS", True), ("client_secret", True), ("AWS_SECRET_ACCESS_KEY", True), ("hf-token", True),
    ("max_tokens", False), ("bos_token", False), ("eos_token", False), ("time_to_first_token", False),
    ("total_token_throughput", False), ("itl_per_token", False), ("prompt_token_count", False),
    ("token_ids", False), ("token_check", False), ("tokenizer", False), ("first_pass", False), ("author", False), ("NCCL_IB_HCA", False),
    ("kv_bytes_per_token", False), ("next_token", False), ("api_key_env", False), ("password_file", False)])
def test_secret_names(name, secret):
    assert rd.is_secret_name(name) is secret


@pytest.mark.parametrize("text,hidden,kept", [
    ("pull http://alice:s3cretPW@127.0.0.1:8080/v1", "s3cretPW", "http://alice:"),
    ("git clone https://bob:ghs-ish-9x@example.org/r.git", "ghs-ish-9x", "example.org/r.git"),
    ("GET http://127.0.0.1/m?token=abc123XYZ&x=1", "abc123XYZ", "&x=1"),
    ("GET http://127.0.0.1/m?x=1&api_key=zzTopSecret", "zzTopSecret", "?x=1"),
    ("https://h/o?X-Amz-Signature=deadbeef99&sig=cafe42", "deadbeef99", "https://h/o?"),
    ("Authorization: Bearer eyJhbGciOi.payload.sig", "eyJhbGciOi.payload.sig", "Authorization: Bearer "),
    ('{"Authorization": "Bearer tok-abcdef-123"}', "tok-abcdef-123", '"Authorization"'),
    ("curl -H 'Authorization: Basic dXNlcjpwYXNz' x", "dXNlcjpwYXNz", "curl"),
    ("llama-server --api-key mykey123 --port 8080", "mykey123", "--port 8080"),
    ("llama-server --api-key=mykey123 --port 8080", "mykey123", "--port 8080"),
    ("WANDB_API_KEY=wb-0123456789 python x.py", "wb-0123456789", "python x.py"),
    ("HF_TOKEN: plainvalue", "plainvalue", "HF_TOKEN"),
    ("token hf_" + "a" * 30, "hf_" + "a" * 30, "token"),
    ("key sk-" + "b" * 20, "sk-" + "b" * 20, "key"),
])
def test_redact_text_hides(text, hidden, kept):
    out = rd.redact_text(text, known=())
    assert hidden not in out and R in out and kept in out
    assert rd.might_hold_secrets(text.encode())     # the file pre-check never skips what a rule would hide


@pytest.mark.parametrize("text", [
    "max_tokens=128 bos_token: <s> time_to_first_token_ms: 12.5",
    "ssh://user@127.0.0.1:22/path http://127.0.0.1:8080/v1/completions?stream=true",
    "mask-image-repeat-x-and-more-words", "first_pass=3 prefill_tokens=512",
    "--port 8080 --model /tmp/tiny.gguf -p batch_size=32",
])
def test_redact_text_leaves_ordinary_text(text):
    assert rd.redact_text(text, known=()) == text


def test_precheck_skips_plain_records():
    rec = json.dumps({"request_id": "r-1", "output_tokens": 64, "itl_ms": [1.5] * 50, "ok": True}).encode()
    assert not rd.might_hold_secrets(rec) and rd.might_hold_secrets(rec, known=("r-1",))


def test_known_value_scrub_anywhere(monkeypatch):
    env_secret, target_secret, arg_secret = rand(), rand(), rand()
    monkeypatch.setenv("MY_SERVICE_TOKEN", env_secret)
    known = rd.known_secrets({"DB_PASSWORD": target_secret, "NCCL_IB_HCA": "mlx5_0"},
                             argv=["llama-server", "--api-key", arg_secret, "--port", "1"])
    assert {env_secret, target_secret, arg_secret} <= set(known) and "mlx5_0" not in known
    text = f"x{env_secret}y, log: using key={target_secret}|{arg_secret}.end mlx5_0"
    out = rd.redact_text(text, known)
    for s in (env_secret, target_secret, arg_secret):
        assert s not in out
    assert out.startswith("x" + R + "y") and "mlx5_0" in out
    # the default known set is the process environment's
    assert env_secret not in rd.redact_text(f"[{env_secret}]")
    # short values are left to the patterns (replacing "1" everywhere would wreck every number)
    assert "1" not in rd.known_secrets({"API_KEY": "1"}, environ=False)


@pytest.mark.parametrize("argv,expected", [
    (["--token", "s3cret", "--port", "1"], ["--token", R, "--port", "1"]),
    (["--password=hunter2"], [f"--password={R}"]),
    (["AWS_SECRET_ACCESS_KEY=abc", "ls"], [f"AWS_SECRET_ACCESS_KEY={R}", "ls"]),
    (["--hf-token", "abcdef123", "-m", "x"], ["--hf-token", R, "-m", "x"]),
    (["--api-key", "--port", "1"], ["--api-key", "--port", "1"]),
    (["--url", "http://u:p4ss@127.0.0.1:9/?token=t0k3n"], ["--url", f"http://u:{R}@127.0.0.1:9/?token={R}"]),
    (["sh", "-c", "HF_TOKEN=abcdef123 run --api-key zzz999"], ["sh", "-c", f"HF_TOKEN={R} run --api-key {R}"]),
])
def test_redact_argv(argv, expected):
    assert rd.redact_argv(argv, known=()) == expected


def test_redact_env_and_objects():
    env = rd.redact_env({"HF_TOKEN": "x" * 8, "MIRROR": "http://u:pw123@127.0.0.1/", "NCCL_DEBUG": "INFO"}, known=())
    assert env == {"HF_TOKEN": R, "MIRROR": f"http://u:{R}@127.0.0.1/", "NCCL_DEBUG": "INFO"}
    obj = rd.redact({"launch": {"extra_args": ["--api-key", "k3y-value"], "parallel": 4},
                     "bos_token": "<s>", "total_token_throughput": 123.4, "headers": {"Authorization": "Bearer abc"},
                     "flag": True}, known=())
    assert obj["launch"]["extra_args"] == ["--api-key", R] and obj["launch"]["parallel"] == 4
    assert obj["bos_token"] == "<s>" and obj["total_token_throughput"] == 123.4
    assert obj["headers"]["Authorization"] == R and obj["flag"] is True


def test_html_mode_keeps_script_code():
    js = "function f(e){return {token:e,password:n.password}} var u='?x=1';"
    assert rd.redact_html(js, known=()) == js
    assert "pw9" not in rd.redact_html("<a href='http://u:pw9@127.0.0.1/'>x</a>", known=())


def test_scrub_notebook_outputs_streams_tracebacks(tmp_path):
    secret = rand()
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(x)")
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text=f"token is {secret}\n"),
        nbformat.v4.new_output("execute_result", data={"text/plain": f"'{secret}'",
                                                       "text/html": f"<td>{secret}</td>"}, execution_count=1),
        nbformat.v4.new_output("error", ename="RuntimeError", evalue=f"bad key {secret}",
                               traceback=[f"RuntimeError: bad key {secret}", "--api-key zzz999"]),
    ]
    nb.cells.append(cell)
    p = tmp_path / "notebook.ipynb"
    nbformat.write(nb, str(p))
    assert rd.scrub_file(p, known=(secret,))
    text = p.read_text()
    assert secret not in text and "zzz999" not in text
    nbformat.validate(nbformat.read(str(p), as_version=4))
    assert not rd.scrub_file(p, known=(secret,))             # already clean: unchanged


def test_scrub_tree_leaves_binary(tmp_path):
    secret = rand()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.csv").write_text(f"k,v\nkey,{secret}\n")
    (tmp_path / "a" / "t.parquet").write_bytes(b"PAR1\0" + secret.encode())
    (tmp_path / "a" / "c.jsonl").write_text(json.dumps({"argv": ["srv", "--api-key", "k3y-abc"], "n": 1}) + "\n"
                                            + json.dumps({"token_check": {"checked": 1}}) + "\n")
    changed = rd.scrub_tree(tmp_path, known=(secret,))
    assert changed == [tmp_path / "a" / "c.jsonl", tmp_path / "a" / "x.csv"]
    rows = [json.loads(line) for line in (tmp_path / "a" / "c.jsonl").read_text().splitlines()]
    assert rows == [{"argv": ["srv", "--api-key", R], "n": 1}, {"token_check": {"checked": 1}}]
    assert secret not in (tmp_path / "a" / "x.csv").read_text()
    assert secret.encode() in (tmp_path / "a" / "t.parquet").read_bytes()


def test_zip_members_redacted(outputs, monkeypatch):
    from servelab.report.archive import zip_run
    secret = "hf_" + rand()
    monkeypatch.setenv("HF_TOKEN", secret)
    rdir = runlib.init_run("z-1", "local")
    (rdir / "phase0").mkdir()
    (rdir / "phase0" / "kernel.log").write_text(f"Traceback: token={secret}\n")
    (rdir / "phase0" / "notes.txt").write_text(f"mirror http://u:pw-{secret[:8]}@127.0.0.1/\n")
    out = zip_run(rdir)
    with zipfile.ZipFile(out) as z:
        for name in z.namelist():
            data = z.read(name).decode("utf-8", "replace")
            assert secret not in data and f"pw-{secret[:8]}" not in data, name
        assert json.loads(z.read(f"{rdir.name}/manifest.json"))["run_id"] == "z-1"


def test_target_env_refs_resolve_or_fail_in_one_line(tmp_path, monkeypatch):
    from servelab.core.params import ParamError
    from servelab.deploy.targets import load_target
    t = tmp_path / "t.yaml"
    t.write_text("name: t\nengine: llamacpp\nmodel: tiny\nenv: {HF_TOKEN: '${HF_TOKEN_X}', PLAIN: 'a$b'}\n"
                 "launch: {extra_args: ['--api-key=${KEY_X}']}\n")
    monkeypatch.delenv("HF_TOKEN_X", raising=False)
    with pytest.raises(ParamError, match=r"env.HF_TOKEN refers to \$\{HF_TOKEN_X\}, which is not set: export"):
        load_target(str(t))
    monkeypatch.setenv("HF_TOKEN_X", "value-1")
    monkeypatch.setenv("KEY_X", "value-2")
    loaded = load_target(str(t))
    assert loaded.env == {"HF_TOKEN": "value-1", "PLAIN": "a$b"}
    assert loaded.launch["extra_args"] == ["--api-key=value-2"]
    assert set(loaded.secret_values()) >= {"value-1", "value-2"}


def test_derived_target_keeps_secrets_out_and_still_loads(outputs, tmp_path, monkeypatch):
    from servelab.deploy.target_secrets import derived_target
    from servelab.deploy.targets import load_target
    tok, key, pw = "hf_" + rand(), rand(), rand()
    t = tmp_path / "s.yaml"
    t.write_text(f"name: s\nengine: llamacpp\nmodel: tiny\ndescription: d\n"
                 f"env: {{HF_TOKEN: {tok}, MIRROR: 'http://u:{pw}@127.0.0.1:9/', NCCL_DEBUG: INFO}}\n"
                 f"launch: {{threads: 2, extra_args: [--api-key, {key}, --alias, x]}}\n")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    rdir = runlib.init_run("d-1", "s")
    path, refs = derived_target(rdir, str(t), {"threads": 4})
    text = Path(path).read_text()
    for v in (tok, key, pw):
        assert v not in text
    assert "${HF_TOKEN}" in text and "${MIRROR}" in text and "NCCL_DEBUG: INFO" in text
    assert refs["HF_TOKEN"] == tok and key in refs.values()
    for k, v in refs.items():
        monkeypatch.setenv(k, v)
    again = load_target(path)
    assert again.env["HF_TOKEN"] == tok and again.launch["extra_args"] == ["--api-key", key, "--alias", "x"]
    assert again.launch["threads"] == 4


def test_archive_zip_scrubs_the_recorded_targets_secrets(outputs, tmp_path, monkeypatch, capsys):
    """A target's literal secret in an unnamed context (a log line echoing it) is replaced in the zip: the archive
    knows the secrets of every target the run recorded, not only the environment's."""
    from servelab.cli import main
    secret, arg = rand(), rand()
    t = tmp_path / "sec.yaml"
    t.write_text(f"name: sec\nengine: llamacpp\nmodel: tiny\nenv: {{WANDB_API_KEY: {secret}}}\n"
                 f"launch: {{extra_args: [--hf-token, {arg}]}}\n")
    rdir = runlib.init_run("arch-1", "sec")
    runlib.update_manifest(rdir, phases={"phase0": {"status": "success", "params": {"target": str(t)}}})
    (rdir / "phase0").mkdir()
    (rdir / "phase0" / "server.log").write_text(f"loaded key {secret} and {arg}\n")
    assert main(["archive", "arch-1", "--zip"]) == 0
    with zipfile.ZipFile(outputs / "arch-1.zip") as z:
        log = z.read("arch-1/phase0/server.log").decode()
    assert secret not in log and arg not in log and log.count(R) == 2
    assert secret in (rdir / "phase0" / "server.log").read_text()      # the zip is redacted, the run untouched


def test_json_of_a_case_summary_survives_redaction():
    """Redacting a real case summary's JSON text leaves valid, identical JSON (nested objects under names like
    ``token_check`` are data, never a value to hide)."""
    text = json.dumps({"token_check": {"checked": 1, "mismatches": 0}, "bos_token": "<s>",
                       "windows": [[1, 2]], "auth": {"mode": "none"}, "itl_per_token_ms": 1.5}, indent=2)
    assert json.loads(rd.redact_text(text, known=())) == json.loads(text)


def test_figure_hover_text_from_data_is_escaped():
    """Plotly reads tags in hover text: a value from a record (a case's rejection reason) goes in escaped, so a
    payload is shown as text (plotly turns the entities back into characters), never read as markup."""
    import pandas as pd
    from servelab.analyse.prefix_cache_figures import hit_rate_figure
    payload = "<img src=x onerror=alert(1)>"
    m = pd.DataFrame([{"case_id": "H8_hit50", "target_rate": 0.5, "counter_hit_rate": 0.1, "usage_hit_rate": None,
                       "verdict": "REJECTED", "reasons": payload, "tolerance_pp": 5.0}])
    fig = hit_rate_figure(m)
    texts = [t for tr in fig.data for t in (tr.hovertext or ())]
    assert texts and all(payload not in t for t in texts)
    assert any("&lt;img src=x onerror=alert(1)&gt;" in t for t in texts)


@pytest.mark.parametrize("name", ["HF_TOKEN", "WANDB_API_KEY", "SESSION_KEY", "db.password", "SSHPASS", "apiKey",
                                  "clientSecret", "Authorization", "GH_TOKEN", "x-api-key", "signing-key"])
def test_precheck_covers_every_secret_name(name):
    assert rd.is_secret_name(name)
    for text in (f"{name}=abcdefgh", f'{{"{name}": "abcdefgh"}}', f"--{name} abcdefgh"):
        assert rd.might_hold_secrets(text.encode()), text


def test_an_engine_scheduler_line_keeps_its_token_counts():
    """SGLang's scheduler lines name counts ``#cached-token: 1536``: data, never a secret (the log parser reads them)."""
    from servelab.core.redact import redact_text
    line = ("[2026-12-02 09:34:53] Prefill batch, #new-seq: 1, #new-token: 64, #cached-token: 1536, token usage: 0.05, "
            "#running-req: 0, #queue-req: 0, #pending-token: 0, cpu graph: False, input throughput (token/s): 10.72")
    assert redact_text(line) == line
    # a target's api_key_env holds the NAME of the variable with the key: a derived target must keep it to load
    assert redact_text("api_key_env: SERVELAB_API_KEY") == "api_key_env: SERVELAB_API_KEY"
    decode = ("[2026-12-02 10:16:53] Decode batch, #running-req: 1, #token: 98, token usage: 0.00, cpu graph: False, "
              "gen throughput (token/s): 0.48, #queue-req: 0")          # SGLang 0.5.23's own line: #token is a count
    assert redact_text(decode) == decode
    assert "s3cr3t-value-1" not in redact_text("HF_TOKEN=s3cr3t-value-1 cached-token: 12")
    assert "s3cr3t-value-2" not in redact_text("token: s3cr3t-value-2")


def test_the_plotly_bundle_is_kept_and_the_text_around_it_redacted(tmp_path):
    """Every executed notebook and page embeds plotly.js (4.8 MB of library code): kept byte for byte and not
    scanned, while secrets in the same output — before, after, in the lines around it — are still found."""
    bundle = rd.library_bundle()
    if not bundle:
        pytest.skip("plotly is not installed")
    hf = "hf_" + "".join(secrets.choice(string.ascii_letters) for _ in range(30))
    known = ("plantedvalue" + "".join(secrets.choice(string.ascii_letters) for _ in range(12)),)
    html = f'<script>var t = "{known[0]}";</script>\n<script>{bundle}</script>\n<p>HF_TOKEN={hf}</p>'
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("show()")
    cell.outputs = [nbformat.v4.new_output("display_data", data={"text/html": html.splitlines(keepends=True)})]
    nb.cells.append(cell)
    path = tmp_path / "notebook.ipynb"
    nbformat.write(nb, str(path))
    page = tmp_path / "report.html"
    page.write_text(f"<html>{html}</html>")
    assert rd.scrub_file(path, known) and rd.scrub_file(page, known)
    out = "".join(json.loads(path.read_text())["cells"][0]["outputs"][0]["data"]["text/html"])
    for text in (out, page.read_text()):
        assert bundle in text and known[0] not in text and hf not in text and text.count(rd.REDACTED) == 2
