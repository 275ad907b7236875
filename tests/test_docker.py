"""Docker mode as users run it, against a real dockerd (started here on its own socket, data root and exec root).

The engine is the real llama-server in an image assembled from the cached build (``docker import`` of a root
filesystem: the binary, its libraries from ``ldd``, ``sh``, ``cat``, ``sleep``), serving the tiny model mounted
read-only, on the host network (loopback only). Checked for real: it serves; no secret is in any argv on the
host; the env file is mode 0600 and gone afterwards; the rank-environment read shows the container's NCCL
values; no container of the run is left after success, an exception, Ctrl-C, SIGTERM to the process that runs
the phase, or a SIGKILLed docker CLI; two starts never collide on the container name.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from servelab.core.params import ParamError
from servelab.deploy.container import DOCKER_NAME, env_file_text, remove_private_dir, write_env_file, make_private_dir
from servelab.deploy.engines import engine_for
from servelab.deploy.hosts import LocalHost, ProcessTracker
from servelab.deploy.server import http_json, rank_environments, start_server, stop_server, version_argv
from servelab.deploy.targets import load_target, target_from_dict

ROOT = Path(__file__).resolve().parents[1]
DOCKERD = shutil.which("dockerd") or "/usr/sbin/dockerd"
DOCKER = shutil.which("docker") or "/usr/local/bin/docker"
IMAGE = "servelab-test/llama-server:1"
SECRET = "hf_" + secrets.token_hex(16)          # planted in the target's env: must never show in an argv


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)


def containers_of(run_id: str) -> list[str]:
    """Every container (running or not) labelled with this run."""
    r = docker("ps", "-a", "--filter", f"label=servelab.run={run_id}", "--format", "{{.Names}}")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def _ours(d: Path) -> list[str]:
    r = subprocess.run(["pgrep", "-af", str(d)], capture_output=True, text=True)
    return [line for line in r.stdout.splitlines() if line.strip()]


def _stop_dockerd(proc: subprocess.Popen, d: Path) -> list[str]:
    """Remove every container, stop dockerd (TERM, then KILL), unmount what it left mounted; returns the
    processes of ours still alive afterwards (dockerd, containerd, shims: their command lines name ``d``)."""
    ids = docker("ps", "-aq", timeout=60).stdout.split() if proc.poll() is None else []
    if ids:
        docker("rm", "-f", *ids, timeout=120)
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 20
    while _ours(d) and time.monotonic() < deadline:     # containerd exits after dockerd
        time.sleep(0.2)
    left = _ours(d)
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines() if str(d) in line]
    for m in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)
    shutil.rmtree(d, ignore_errors=True)
    return left


@pytest.fixture(scope="module")
def dockerd():
    """A real dockerd of our own: no bridge, no iptables, data and exec roots in a temporary folder; the docker
    client reaches it through DOCKER_HOST. Skipped with one reason where it cannot run."""
    if not Path(DOCKERD).exists():
        pytest.skip("dockerd not installed (Debian package docker.io; `make system` installs it)")
    if not Path(DOCKER).exists():
        pytest.skip("the docker client is not installed")
    if os.geteuid() != 0:
        pytest.skip("dockerd needs root")
    d = Path(tempfile.mkdtemp(prefix="sl-dockerd-"))
    sock = d / "docker.sock"
    log = open(d / "dockerd.log", "wb")
    proc = subprocess.Popen([DOCKERD, "--bridge=none", "--iptables=false", "--ip6tables=false",
                             "--data-root", str(d / "data"), "--exec-root", str(d / "exec"),
                             "--pidfile", str(d / "docker.pid"), "--host", f"unix://{sock}"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    before = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = f"unix://{sock}"
    try:
        deadline, up = time.monotonic() + 60, False
        while time.monotonic() < deadline and proc.poll() is None:
            if sock.exists() and docker("version", timeout=10).returncode == 0:
                up = True
                break
            time.sleep(0.3)
        if not up:
            tail = (d / "dockerd.log").read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            _stop_dockerd(proc, d)
            pytest.skip(f"dockerd could not start here: {tail[0][:300]}")
        yield d
        left = _stop_dockerd(proc, d)
        assert not left, f"dockerd/containerd processes left behind: {left}"
    finally:
        if proc.poll() is None:
            _stop_dockerd(proc, d)
        if before is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = before


def _libraries(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    return [tok for line in out.splitlines() for tok in line.split() if tok.startswith("/")]


@pytest.fixture(scope="module")
def image(dockerd: Path, llama_server_binary: Path) -> str:
    """The engine image: the real cached llama-server, its libraries, sh, cat and sleep, imported as one layer."""
    root = dockerd / "rootfs"
    for sub in ("usr/local/bin", "bin", "proc", "sys", "dev", "tmp", "etc"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(llama_server_binary, root / "usr/local/bin/llama-server")
    tools = [shutil.which(t) for t in ("sh", "cat", "sleep")]
    for tool in tools:
        shutil.copy2(os.path.realpath(tool), root / "bin" / Path(tool).name)
    for lib in sorted({lib for b in [str(llama_server_binary), *tools] for lib in _libraries(b)}):
        dest = root / lib.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(lib), dest)
    subprocess.run(["tar", "-C", str(root), "-cf", str(dockerd / "rootfs.tar"), "."], check=True)
    r = docker("import", str(dockerd / "rootfs.tar"), IMAGE)
    assert r.returncode == 0, r.stderr
    return IMAGE


@pytest.fixture(scope="module")
def image_without_shell(image: str, dockerd: Path) -> str:
    """The same engine image without ``sh``: nothing to ``docker exec`` the environment read with."""
    (dockerd / "rootfs" / "bin" / "sh").unlink()
    subprocess.run(["tar", "-C", str(dockerd / "rootfs"), "-cf", str(dockerd / "rootfs-nosh.tar"), "."], check=True)
    r = docker("import", str(dockerd / "rootfs-nosh.tar"), IMAGE + "-nosh")
    assert r.returncode == 0, r.stderr
    return IMAGE + "-nosh"


def _write_target(dockerd: Path, image: str, name: str) -> Path:
    """``local-tiny`` in docker mode: the image, the model mounted read-only at its own path, a secret and two
    NCCL variables in the environment. The node has no GPUs, so no ``--gpus``."""
    from servelab.deploy.models import resolve_model
    model = str(resolve_model("tiny"))
    raw = yaml.safe_load((ROOT / "params/targets/local-tiny.yaml").read_text())
    raw["name"] = name
    raw["launch"] = {**raw["launch"], "mode": "docker",
                     "docker": {"image": image, "name": "tiny", "shm_size": "64m", "stop_grace_s": 5,
                                "extra_args": ["-v", f"{model}:{model}:ro"]}}
    raw["env"] = {"HF_TOKEN": SECRET, "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "lo"}
    path = dockerd / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def target_file(image: str, dockerd: Path) -> Path:
    return _write_target(dockerd, image, "local-tiny-docker")


@pytest.mark.slow
def test_serves_in_the_container_with_no_secret_in_argv_and_the_ranks_env_read_inside(target_file, tmp_path):
    target = load_target(str(target_file))
    run_dir = tmp_path / "run-a"
    with ProcessTracker() as tracker:
        srv = start_server(target, tmp_path / "logs", tracker, run_dir=run_dir, health_timeout_s=60)
        c = srv.containers["local"]
        assert DOCKER_NAME.match(c.name) and c.name.startswith("tiny-run-a-")
        assert "--gpus" not in c.argv and c.argv[c.argv.index("--label") + 1] == "servelab.run=run-a"
        top = docker("top", c.name, "-eo", "pid,comm")
        assert top.returncode == 0 and "llama-server" in top.stdout        # the engine runs in the container
        status, body = http_json(srv.base_url + "/v1/completions",
                                 {"prompt": "hello", "max_tokens": 8, "ignore_eos": True}, timeout=60)
        assert status == 200 and body["usage"]["completion_tokens"] == 8
        v = version_argv(srv)                        # Phase 0 asks the engine inside its container
        assert v[1:] == ["exec", c.name, "llama-server", "--version"]
        out = subprocess.run(v, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and "version:" in out.stdout + out.stderr

        # (b) no value in any argv on the host; the CLI process has no copy either; the file holds it, mode 0600
        args = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
        assert c.name in args and "--env-file" in args
        assert SECRET not in args and "HF_TOKEN=" not in args and "NCCL_SOCKET_IFNAME=" not in args
        assert SECRET.encode() not in Path(f"/proc/{srv.handles['local'].pid}/environ").read_bytes()
        assert stat.S_IMODE(os.stat(c.env_file).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(c.private_dir).st_mode) == 0o700
        assert f"HF_TOKEN={SECRET}\n" in Path(c.env_file).read_text()

        # (c) the environment the container's processes saw, not the docker CLI's
        env = rank_environments(srv)
        eng = env[env["process"] == "llama-server"].set_index("variable")
        assert eng.loc["NCCL_DEBUG", "seen"] == "INFO" and eng.loc["NCCL_DEBUG", "verdict"] == "ok"
        assert eng.loc["NCCL_SOCKET_IFNAME", "seen"] == "lo" and eng.loc["NCCL_SOCKET_IFNAME", "verdict"] == "ok"
        assert 1 in set(eng["pid"])                  # pid 1 of the container's namespace: the engine itself
        assert "MISSING" not in set(env["verdict"]) and SECRET not in env.to_string()
        info = stop_server(srv, tracker, run_dir=run_dir)

    assert containers_of("run-a") == [] and info["containers"]["local"] == {"name": c.name, "removed": True}
    assert not Path(c.env_file).exists() and not Path(c.private_dir).exists()
    assert info["port_released"]
    commands = (run_dir / "commands.jsonl").read_text()
    assert SECRET not in commands and "--env-file" in commands
    assert '"stop", "-t", "5", "' + c.name in commands and '"rm", "-f", "' + c.name in commands


@pytest.mark.slow
def test_rank_environments_without_a_shell_in_the_image_come_from_the_hosts_proc(image_without_shell, dockerd,
                                                                                 tmp_path):
    target = load_target(str(_write_target(dockerd, image_without_shell, "local-tiny-docker-nosh")))
    with ProcessTracker() as tracker:
        srv = start_server(target, tmp_path / "logs", tracker, run_dir=tmp_path / "run-nosh", health_timeout_s=60)
        assert docker("exec", srv.containers["local"].name, "sh", "-c", "true").returncode != 0
        env = rank_environments(srv)
        eng = env[env["process"] == "llama-server"].set_index("variable")
        assert eng.loc["NCCL_DEBUG", "seen"] == "INFO" and eng.loc["NCCL_SOCKET_IFNAME", "verdict"] == "ok"
        assert 1 not in set(eng["pid"])              # host pids (docker top), not the container's namespace
        stop_server(srv, tracker)
    assert containers_of("run-nosh") == []


@pytest.mark.slow
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_an_exception_or_ctrl_c_removes_the_container_and_its_env_file(target_file, tmp_path, exc):
    target = load_target(str(target_file))
    run = f"run-{exc.__name__.lower()}"
    with pytest.raises(exc):
        with ProcessTracker() as tracker:
            srv = start_server(target, tmp_path / "logs", tracker, run_dir=tmp_path / run, health_timeout_s=60)
            c = srv.containers["local"]
            assert containers_of(run) == [c.name] and Path(c.env_file).exists()
            raise exc("the phase failed here")
    assert containers_of(run) == []
    assert not Path(c.private_dir).exists()


@pytest.mark.slow
def test_an_engine_that_cannot_start_in_the_container_fails_in_one_message_and_leaves_nothing(target_file, tmp_path):
    from servelab.deploy.server import ServerError
    target = load_target(str(target_file))
    target.launch = {**target.launch, "binary": "/no/such/llama-server"}
    with ProcessTracker() as tracker:
        with pytest.raises(ServerError, match="exited before becoming healthy"):
            start_server(target, tmp_path / "logs", tracker, run_dir=tmp_path / "run-fail", health_timeout_s=60)
    assert containers_of("run-fail") == []
    assert list(Path(tempfile.gettempdir()).glob("servelab-run-fail-*")) == []


@pytest.mark.slow
def test_a_sigkilled_docker_cli_does_not_leave_the_container_running(target_file, tmp_path):
    """SIGKILL cannot be passed on: the killed CLI leaves its container serving; stop removes it by name."""
    target = load_target(str(target_file))
    with ProcessTracker() as tracker:
        srv = start_server(target, tmp_path / "logs", tracker, run_dir=tmp_path / "run-k", health_timeout_s=60)
        c, h = srv.containers["local"], srv.handles["local"]
        os.kill(h.pid, signal.SIGKILL)
        h.popen.wait(10)
        time.sleep(0.5)
        state = docker("inspect", "-f", "{{.State.Running}}", c.name)
        assert state.stdout.strip() == "true"        # the container outlived its CLI: what stop must handle
        assert http_json(srv.base_url + "/health", timeout=5)[0] == 200
        info = stop_server(srv, tracker)
        assert info["containers"]["local"]["removed"], c.stop_results
    assert containers_of("run-k") == [] and info["port_released"]
    assert not Path(c.private_dir).exists()


@pytest.mark.slow
def test_two_starts_do_not_collide_on_the_container_name(target_file, tmp_path):
    target = load_target(str(target_file))
    run_dir = tmp_path / "run-two"
    with ProcessTracker() as tracker:
        a = start_server(target, tmp_path / "la", tracker, run_dir=run_dir, health_timeout_s=60)
        b = start_server(target, tmp_path / "lb", tracker, run_dir=run_dir, health_timeout_s=60)  # same run, same base
        names = {a.containers["local"].name, b.containers["local"].name}
        assert len(names) == 2 and sorted(containers_of("run-two")) == sorted(names)
        for srv in (a, b):
            assert http_json(srv.base_url + "/health", timeout=5)[0] == 200
        stop_server(a, tracker)
        stop_server(b, tracker)
        c = start_server(target, tmp_path / "lc", tracker, run_dir=run_dir, health_timeout_s=60)   # and again
        assert c.containers["local"].name not in names
        stop_server(c, tracker)
        stop_server(c, tracker)                      # idempotent
    assert containers_of("run-two") == []


_PHASE = """
import sys, time
from pathlib import Path
from servelab.deploy.hosts import ProcessTracker
from servelab.deploy.server import start_server
from servelab.deploy.targets import load_target
target = load_target(sys.argv[1])
with ProcessTracker() as tracker:
    srv = start_server(target, Path(sys.argv[2]), tracker, run_dir=Path(sys.argv[3]), health_timeout_s=60)
    c = srv.containers["local"]
    print(c.name, c.private_dir, flush=True)
    time.sleep(300)
"""


@pytest.mark.slow
def test_sigterm_to_the_process_running_the_phase_removes_the_container(target_file, tmp_path):
    """A kernel or ``servelab run`` being terminated: SIGTERM takes the Ctrl-C path while a tracker is open."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "lib")}
    p = subprocess.Popen([sys.executable, "-c", _PHASE, str(target_file), str(tmp_path / "logs"),
                          str(tmp_path / "run-term")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True)
    try:
        name, private = p.stdout.readline().split()
        assert containers_of("run-term") == [name] and Path(private).is_dir()
        p.send_signal(signal.SIGTERM)
        p.wait(60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert "KeyboardInterrupt" in p.stderr.read()
    assert containers_of("run-term") == [] and not Path(private).exists()


@pytest.mark.slow
def test_a_sigkilled_kernel_still_takes_its_container_down(target_file, tmp_path):
    """Nothing of ours runs after SIGKILL: the docker CLI gets SIGTERM from the kernel (parent-death signal) and
    passes it on to the container, which stops and is removed (``--rm``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "lib")}
    p = subprocess.Popen([sys.executable, "-c", _PHASE, str(target_file), str(tmp_path / "logs"),
                          str(tmp_path / "run-kill9")], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=env, start_new_session=True)
    private = ""
    try:
        name, private = p.stdout.readline().split()
        assert containers_of("run-kill9") == [name]
        p.kill()
        p.wait(30)
        deadline = time.monotonic() + 30
        while containers_of("run-kill9") and time.monotonic() < deadline:
            time.sleep(0.3)
        assert containers_of("run-kill9") == []
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        remove_private_dir(LocalHost("local"), private)   # the one thing a killed process cannot remove


@pytest.mark.slow
def test_a_container_whose_cli_and_kernel_were_sigkilled_is_removed_by_the_next_sweep(target_file, tmp_path):
    """As on an SSH node, where no parent-death signal reaches the docker CLI: the CLI is SIGKILLed (the container
    serves on), then the kernel; the next start's sweep finds the stale record, removes the container by name and
    the private folder of its env file, and says so in its row."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "lib")}
    p = subprocess.Popen([sys.executable, "-c", _PHASE, str(target_file), str(tmp_path / "logs"),
                          str(tmp_path / "run-orphan")], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=env, start_new_session=True)
    private = ""
    try:
        name, private = p.stdout.readline().split()
        cli = subprocess.run(["pgrep", "-f", f"run --rm --name {name} "], capture_output=True, text=True).stdout.split()
        assert len(cli) == 1, cli
        os.kill(int(cli[0]), signal.SIGKILL)
        time.sleep(1.0)
        assert containers_of("run-orphan") == [name]               # SIGKILL is not passed on: it still runs
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
        assert containers_of("run-orphan") == [name] and Path(private).is_dir()
        rows = [r for r in LocalHost("local").sweep() if r.get("run_id") == "run-orphan"]
        assert any(f"container {name} removed" in r["action"] for r in rows), rows
        assert containers_of("run-orphan") == [] and not Path(private).exists()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        docker("rm", "-f", *containers_of("run-orphan")) if containers_of("run-orphan") else None
        remove_private_dir(LocalHost("local"), private)


# ---------------------------------------------------------------- no daemon needed

def test_docker_plans_pass_names_only_and_gpus_only_where_the_node_has_gpus():
    base = {"name": "x", "engine": "vllm", "model": "/m", "env": {"HF_TOKEN": SECRET, "NCCL_DEBUG": "INFO"},
            "launch": {"mode": "docker", "docker": {"image": "vllm/vllm-openai:v0.11.0"}}}
    (p,) = engine_for("vllm").launch_plans(target_from_dict({**base, "nodes": [{"name": "n", "gpus": 0}]}), 8000)
    assert "--gpus" not in p.argv and SECRET not in " ".join(p.argv) and p.env == {}
    assert {"HF_TOKEN": SECRET, "NCCL_DEBUG": "INFO"}.items() <= p.container.env.items()   # + the adapter's own
    assert p.argv[p.argv.index("--name") + 1] == "servelab-vllm-n"
    (p,) = engine_for("vllm").launch_plans(target_from_dict({**base, "nodes": [{"name": "n", "gpus": 2}]}), 8000)
    assert p.argv[p.argv.index("--gpus") + 1] == "all"
    t = load_target("local-tiny")
    t.launch = {**t.launch, "mode": "docker", "docker": {"image": "img", "gpus": "device=0"}}
    (p,) = engine_for("llamacpp").launch_plans(t, 9000, binary="llama-server", model_path="/m.gguf")
    assert p.argv[:2] == ["docker", "run"] and p.argv[p.argv.index("--gpus") + 1] == "device=0"
    assert p.container.engine_argv[0] == "llama-server"


def test_bad_docker_settings_fail_in_one_line_before_anything_starts():
    base = {"name": "x", "engine": "sglang", "model": "/m", "nodes": [{"name": "n"}]}
    with pytest.raises(ParamError, match="not a valid docker name"):
        target_from_dict({**base, "launch": {"mode": "docker", "docker": {"image": "i", "name": "my container"}}})
    with pytest.raises(ParamError, match="imgae.*launch.docker"):
        target_from_dict({**base, "launch": {"mode": "docker", "docker": {"imgae": "i"}}})
    with pytest.raises(ParamError, match="line break"):
        engine_for("sglang").launch_plans(target_from_dict(
            {**base, "env": {"NCCL_DEBUG": "INFO\nX=1"}, "launch": {"mode": "docker", "docker": {"image": "i"}}}), 1)
    assert env_file_text({"A": "x y = z", "B": ""}) == "A=x y = z\nB=\n"


@pytest.mark.slow
def test_docker_mode_on_an_ssh_node(target_file, dockerd, tmp_path):
    """The same over SSH (a real sshd on 127.0.0.4 whose sessions reach our dockerd): env file over SFTP, docker
    run in the node's own session, the ranks' environment and the teardown through SSH."""
    sys.path.insert(0, str(Path(__file__).parent))
    from sshd import start_sshd
    try:
        sshd = start_sshd(tmp_path / "sshd", host="127.0.0.4",
                          extra_config=(f"SetEnv DOCKER_HOST={os.environ['DOCKER_HOST']}",))
    except (FileNotFoundError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no sshd to test against: {exc}")
    raw = yaml.safe_load(target_file.read_text())
    raw.update(name="ssh-tiny-docker", api_host="127.0.0.4",
               nodes=[{"name": "n4", "kind": "ssh", "role": "head", "host": "127.0.0.4", "port": sshd.port,
                       "user": "root", "key_file": str(sshd.client_key), "known_hosts": str(sshd.known_hosts),
                       "workdir": str(tmp_path / "work")}])
    target = target_from_dict(raw, "ssh-tiny-docker")
    try:
        with ProcessTracker() as tracker:
            srv = start_server(target, tmp_path / "logs", tracker, run_dir=tmp_path / "run-ssh", health_timeout_s=60)
            c = srv.containers["n4"]
            assert c.host.kind == "ssh" and containers_of("run-ssh") == [c.name]
            assert srv.base_url.startswith("http://127.0.0.4:")
            status, body = http_json(srv.base_url + "/v1/completions",
                                     {"prompt": "hi", "max_tokens": 4, "ignore_eos": True}, timeout=60)
            assert status == 200 and body["usage"]["completion_tokens"] == 4
            assert stat.S_IMODE(os.stat(c.env_file).st_mode) == 0o600
            args = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
            assert SECRET not in args and c.name in args
            env = rank_environments(srv)
            eng = env[env["process"] == "llama-server"].set_index("variable")
            assert eng.loc["NCCL_SOCKET_IFNAME", "seen"] == "lo" and eng.loc["NCCL_DEBUG", "verdict"] == "ok"
            info = stop_server(srv, tracker, run_dir=tmp_path / "run-ssh")
        assert info["containers"]["n4"]["removed"] and containers_of("run-ssh") == []
        assert not Path(c.private_dir).exists()
    finally:
        sshd.stop()


@pytest.mark.slow
def test_env_file_on_an_ssh_node_is_written_over_sftp_with_mode_0600(tmp_path):
    """On an SSH node the env file is written through the hosts layer (SFTP: no value in any command line)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from sshd import start_sshd
    from servelab.deploy.hosts import SSHHost
    try:
        sshd = start_sshd(tmp_path / "sshd", host="127.0.0.4")
    except (FileNotFoundError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no sshd to test against: {exc}")
    try:
        host = SSHHost("node", sshd.host, sshd.port, "root", str(sshd.client_key), str(sshd.known_hosts))
        d = make_private_dir(host, "run-ssh")
        path = write_env_file(host, d, {"HF_TOKEN": SECRET, "NCCL_DEBUG": "INFO"})
        modes = host.run(["stat", "-c", "%a", d, path]).stdout.split()
        assert modes == ["700", "600"]
        assert host.read_file(path).decode() == f"HF_TOKEN={SECRET}\nNCCL_DEBUG=INFO\n"
        assert remove_private_dir(host, d) and not host.run(["test", "-e", d]).ok
        host.close()
    finally:
        sshd.stop()


def test_env_file_is_private_on_the_node_and_removed(tmp_path):
    host = LocalHost("local")
    d = make_private_dir(host, "run/../x")
    path = write_env_file(host, d, {"HF_TOKEN": SECRET})
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert Path(path).read_text() == f"HF_TOKEN={SECRET}\n"
    assert not remove_private_dir(host, str(tmp_path)) and tmp_path.exists()     # only a folder it made
    assert remove_private_dir(host, d) and not Path(d).exists()


@pytest.mark.slow
def test_phase0_in_docker_mode_shows_the_containers_rank_environment_and_writes_no_secret(target_file, tmp_path,
                                                                                          monkeypatch):
    """Phase 0 as a user runs it (`servelab run phase0`, notebook and page) on the docker-mode target."""
    from servelab.cli import main
    from servelab.core.run import read_manifest
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path / "outputs"))
    rc = main(["run", "phase0", "--target", str(target_file), "--run-id", "p0-docker"])
    rdir = tmp_path / "outputs" / "p0-docker"
    m = read_manifest(rdir)
    assert rc == 0 and m["phases"]["phase0"]["status"] == "success"
    seen = {(r["process"], r["variable"]): (r["seen"], r["verdict"]) for r in m["rank_env"]}
    assert seen[("llama-server", "NCCL_DEBUG")] == ("INFO", "ok")
    assert seen[("llama-server", "NCCL_SOCKET_IFNAME")] == ("lo", "ok")
    assert "0c1e570" in m["engine"]["version"]                 # asked of the engine inside its container
    assert containers_of("p0-docker") == []
    # the freeze: the image and its id, the commit from `llama-server --version` in a throw-away container of it
    fz = m["frozen"]["local"]
    assert fz["image"] == IMAGE and fz["image_id"] == docker("image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip()
    assert fz["engine_commit"] == "0c1e570" and m["frozen_changes"] == []
    assert docker("ps", "-aq", "--filter", "name=servelab-probe").stdout.split() == []     # probes removed
    leaked = [p for p in rdir.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == []
