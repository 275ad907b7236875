"""A real OpenSSH server for tests: key-only, its own host key, on a loopback address and a free port."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class TestSSHD:
    host: str
    port: int
    client_key: Path
    known_hosts: Path          # holds this server's real host key
    host_pub: Path
    proc: subprocess.Popen
    dir: Path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_sshd(d: Path, host: str = "127.0.0.1", extra_config: tuple[str, ...] = (), port: int = 0) -> TestSSHD:
    """``extra_config``: further sshd_config lines (e.g. ``SetEnv DOCKER_HOST=...`` for the sessions); ``port``:
    reuse a given port (e.g. the same address with a new host key, as after a reinstall)."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(sshd).exists():
        raise FileNotFoundError("sshd not installed (Debian package openssh-server; `make system` installs it)")
    d.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    for name in ("host_ed25519", "client_ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "client_ed25519.pub", d / "authorized_keys")
    os.chmod(d / "authorized_keys", 0o600)
    port = port or _free_port(host)
    cfg = d / "sshd_config"
    cfg.write_text("\n".join([f"ListenAddress {host}", f"Port {port}", f"HostKey {d / 'host_ed25519'}",
                              f"PidFile {d / 'sshd.pid'}", f"AuthorizedKeysFile {d / 'authorized_keys'}",
                              "PubkeyAuthentication yes", "PasswordAuthentication no",
                              "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password", "UsePAM no",
                              "StrictModes no", "Subsystem sftp /usr/lib/openssh/sftp-server", *extra_config, ""]))
    subprocess.run([sshd, "-t", "-f", str(cfg)], check=True)
    proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=open(d / "sshd.log", "wb"), start_new_session=True)
    key = (d / "host_ed25519.pub").read_text().split()
    known = d / "known_hosts"
    known.write_text(f"[{host}]:{port} {key[0]} {key[1]}\n")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                break
        time.sleep(0.05)
    return TestSSHD(host, port, d / "client_ed25519", known, d / "host_ed25519.pub", proc, d)


def sshd_pair(tmp_path_factory):
    """Two real sshd "nodes" on 127.0.0.2 and 127.0.0.3 and one known_hosts holding both host keys (a module
    fixture's body: ``yield from sshd_pair(tmp_path_factory)``); skips where sshd is not installed."""
    import pytest
    try:
        a = start_sshd(tmp_path_factory.mktemp("sshd-a"), host="127.0.0.2")
        b = start_sshd(tmp_path_factory.mktemp("sshd-b"), host="127.0.0.3")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    known = tmp_path_factory.mktemp("kh") / "known_hosts"
    known.write_text(a.known_hosts.read_text() + b.known_hosts.read_text())
    try:
        yield a, b, known
    finally:
        a.stop()
        b.stop()

