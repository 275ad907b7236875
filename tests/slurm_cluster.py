"""A real single-host Slurm for tests: munged, slurmctld and slurmd from the Debian packages, configured in a
temporary folder (its own munge key and socket, state and spool folders, free ports, bound to loopback), started
and stopped here. ``SLURM_CONF`` in :attr:`TestSlurm.env` points the Slurm commands at it."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TestSlurm:
    dir: Path
    conf: Path
    node: str
    partition: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=60,
                              env={**os.environ, **self.env})

    def jobs(self) -> list[str]:
        """Every job Slurm still lists (any state)."""
        r = self.run("squeue", "-h", "-o", "%i %T %j")
        assert r.returncode == 0, r.stderr
        return [ln for ln in r.stdout.splitlines() if ln.strip()]

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)


def missing() -> list[str]:
    return [d for d in (*DAEMONS, "sbatch", "srun", "squeue", "scancel", "scontrol") if shutil.which(d) is None]


def start_slurm(d: Path) -> TestSlurm:
    """munged (key and socket in ``d``), then slurmctld and slurmd in the foreground as children of the test."""
    node = socket.gethostname().split(".")[0]
    mdir = d / "munge"
    for sub in ("munge", "state", "spool", "log"):
        (d / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
    key = mdir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = mdir / "munge.socket"
    conf = d / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=servelabtest", f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", f"AuthInfo=socket={sock}", "CredType=cred/munge",
        f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
        f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "MpiDefault=none", "ReturnToService=2", "SwitchType=switch/none",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} RealMemory=1000 State=UNKNOWN",
        f"PartitionName=servelab Nodes={node} Default=YES MaxTime=INFINITE State=UP", ""]))
    s = TestSlurm(d, conf, node, "servelab")
    env = {**os.environ, **s.env}

    def spawn(argv: list[str], name: str) -> None:
        log = open(d / "log" / f"{name}.out", "wb")
        s.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env))
        log.close()
    try:
        spawn(["munged", "-F", "-f", "-S", str(sock), f"--key-file={key}", f"--pid-file={mdir / 'munged.pid'}",
               f"--seed-file={mdir / 'seed'}", f"--log-file={mdir / 'munged.log'}"], "munged")
        _until(lambda: sock.exists(), 20, "munged socket", d)
        spawn(["slurmctld", "-D", "-i"], "slurmctld")
        _until(lambda: s.run("scontrol", "ping").returncode == 0 and "UP" in s.run("scontrol", "ping").stdout,
               60, "slurmctld", d)
        spawn(["slurmd", "-D", "-N", node], "slurmd")
        _until(lambda: "idle" in s.run("sinfo", "-h", "-o", "%t").stdout, 60, "slurmd (node idle)", d)
    except BaseException:
        s.stop()
        raise
    return s


def _until(cond, timeout_s: float, what: str, d: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted((d / "log").iterdir()))
    raise AssertionError(f"{what} not up after {timeout_s:.0f} s{logs}")
