"""A Dask distributed cluster for work that must run where its data is (docs/scaling.md#beyond-one-machine).

servelab does not schedule work across machines itself: it starts (or joins) a Dask distributed cluster and pins
each task to the node that holds its input. Three forms, the value of a phase's ``cluster`` parameter:

- ``local[:N]``: a scheduler and N single-threaded workers on this machine, bound to 127.0.0.1;
- ``nodes[:N]``: the scheduler on this machine, bound to the one address that faces the target's nodes, and N
  workers on every node of the target, started over the hosts layer (:mod:`servelab.deploy.hosts`);
- ``tcp://HOST:PORT`` (or ``tls://``): an existing cluster's scheduler; servelab starts and stops nothing there.

What servelab starts is tracked like an engine: each process belongs to the caller's ``ProcessTracker`` (stopped on
success, failure, Ctrl-C and SIGTERM) and has a pid record on its node, so the next start sweeps what a killed
kernel left. The local scheduler dies with the kernel (parent-death signal); a worker whose scheduler is gone
stops itself after ``DEATH_TIMEOUT_S``. The scheduler fails a task whose worker died at once
(``allowed-failures`` 0), so that the caller decides about a retry; an existing cluster keeps its own setting.

Dask's protocol carries pickled code: whoever can talk to a scheduler or a worker runs code on every node. So what
servelab starts speaks TLS with mutual authentication (:mod:`servelab.deploy.cluster_tls`: a CA and certificate made
for this start, on each node in an owner-only folder, removed at stop, swept at the next start): a peer without that
certificate is refused by the scheduler and by every worker. The scheduler still binds loopback or the one address
facing the nodes, never ``0.0.0.0``. An existing ``tls://`` cluster is joined with the user's own certificate paths
(Dask's configuration: ``distributed.comm.tls.ca-file``, ``.client.cert``, ``.client.key``).
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab.core import threads
from servelab.core.code import code_fingerprint
from servelab.deploy import cluster_tls
from servelab.deploy.hosts import HostError, LocalHost, ProcessTracker, connect

FORMS = ("local[:N] (workers on this machine), nodes[:N] (N workers on every node of the target) or tcp://HOST:PORT "
         "(tls://HOST:PORT with your certificates in Dask's configuration)")
DEATH_TIMEOUT_S = 60           # a worker stops itself when its scheduler has been gone this long
MAX_DEFAULT_WORKERS = 8


class ClusterError(RuntimeError):
    """The cluster could not be parsed, started or reached (one line: what to do)."""


@dataclass(frozen=True)
class ClusterSpec:
    kind: str                   # local | nodes | address
    workers: int = 0            # per node; 0: the node's cores, at most MAX_DEFAULT_WORKERS
    address: str = ""

    def describe(self) -> str:
        if self.kind == "address":
            return f"existing cluster at {self.address}"
        n = f"{self.workers} worker(s)" if self.workers else "one worker per core (≤ 8)"
        return f"{n} {'on this machine' if self.kind == 'local' else 'on every node of the target'}"


_SPEC_RE = re.compile(r"^(local|nodes)(?::(\d+))?$")
_ADDR_RE = re.compile(r"^(tcp|tls)://\[?[A-Za-z0-9.:_-]+\]?:\d{1,5}$")


def parse_cluster(text: str) -> ClusterSpec | None:
    """``""`` → None (no cluster); otherwise a :class:`ClusterSpec`, or :class:`ClusterError` naming the forms."""
    text = (text or "").strip()
    if not text:
        return None
    m = _SPEC_RE.match(text)
    if m:
        n = int(m.group(2)) if m.group(2) else 0
        if m.group(2) and not 1 <= n <= 256:
            raise ClusterError(f"cluster={text!r}: the worker count must be 1..256")
        return ClusterSpec(m.group(1), n)
    if _ADDR_RE.match(text):
        return ClusterSpec("address", address=text)
    raise ClusterError(f"cluster={text!r} is not {FORMS}")


def require_dask() -> Any:
    """The ``distributed`` module, or one line saying how to install the optional extra when it is missing. Every
    use of Dask here goes through this import (about 0.5 s): only a cluster run pays it, never the start-up of a
    command or a phase without one."""
    try:
        import distributed
    except ImportError:
        raise ClusterError("Dask distributed is not installed: pip install 'servelab[cluster]' "
                           "(on this machine and on every node that runs workers)") from None
    return distributed


@dataclass
class Cluster:
    """A connected cluster: the client, which node each worker host is, and what servelab started for it."""
    address: str
    client: Any
    started: bool
    node_names: dict[str, str] = field(default_factory=dict)     # worker host → node name
    handles: list = field(default_factory=list)
    sweep: list[dict] = field(default_factory=list)
    log_dir: str = ""
    spec: ClusterSpec | None = None
    tls: cluster_tls.TLSFiles | None = None     # the controller's certificate files (a cluster servelab started)

    def nodes(self) -> dict[str, list[str]]:
        """Live workers grouped by host: {host: [worker addresses]} (a host is one node)."""
        out: dict[str, list[str]] = {}
        for addr, w in self.client.scheduler_info(n_workers=-1)["workers"].items():
            out.setdefault(w.get("host") or _host_of(addr), []).append(addr)
        return {h: sorted(v) for h, v in sorted(out.items())}

    def node_name(self, host: str) -> str:
        return self.node_names.get(host, host)

    def close(self) -> None:
        try:
            self.client.close(timeout=10)
        except Exception:  # already gone: nothing to close
            pass


def _host_of(addr: str) -> str:
    return addr.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")


def _client(address: str, timeout_s: float, security: Any = None):
    try:
        return require_dask().Client(address, timeout=timeout_s, set_as_default=False,
                                     **({"security": security} if security is not None else {}))
    except (OSError, TimeoutError) as exc:
        raise ClusterError(f"cannot reach the Dask scheduler at {address}: {exc}; check the address and that "
                           f"this machine can reach it") from None


def connect_cluster(address: str, timeout_s: float = 30.0) -> Cluster:
    """Join an existing cluster (nothing started or stopped there); its workers must run the same Dask and the same
    servelab code (:func:`~servelab.core.code.code_fingerprint`) as here."""
    distributed = require_dask()
    if address.startswith("tls://"):
        own = distributed.Security()          # what the client will present: the TLS files of the Dask config
        need = {"ca-file": own.tls_ca_file, "client cert": own.tls_client_cert}
        missing = [k for k, path in need.items() if not path]
        if missing:
            raise ClusterError(f"joining {address} needs your TLS files: set DASK_DISTRIBUTED__COMM__TLS__CA_FILE, "
                               f"DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT (and __KEY when the key is separate), or "
                               f"the same keys in ~/.config/dask/*.yaml (missing: {', '.join(missing)})")
    client = _client(address, timeout_s)
    try:
        client.get_versions(check=True)
    except Exception as exc:
        client.close()
        raise ClusterError(f"the cluster at {address} runs other package versions than this machine: "
                           f"{str(exc).splitlines()[0]}") from None
    if not client.scheduler_info()["workers"]:
        client.close()
        raise ClusterError(f"the cluster at {address} has no workers")
    try:
        codes = client.run(code_fingerprint)
    except Exception as exc:  # noqa: BLE001  (whatever a worker raised: servelab missing there, most often)
        client.close()
        raise ClusterError(f"the workers of {address} cannot run servelab ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}); install servelab[cluster] where they "
                           f"run") from None
    here = code_fingerprint()
    other = sorted((w, c) for w, c in codes.items() if c != here)
    if other:
        client.close()
        raise ClusterError(f"{len(other)} of {len(codes)} workers of {address} run another servelab (code "
                           f"{other[0][1]} at {other[0][0]}, here {here}); install this servelab where they run")
    return Cluster(address=address, client=client, started=False, spec=ClusterSpec("address", address=address))


def facing_address(hosts: list[str]) -> str:
    """This machine's address on the route to ``hosts`` (the first one decides; loopback for loopback nodes):
    the one interface the scheduler binds."""
    if not hosts or all(h in ("localhost", "::1") or h.startswith("127.") for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:      # no packet is sent
        s.connect((hosts[0], 9))
        return s.getsockname()[0]


def _node_cpus(host: Any) -> int:
    """The CPUs the node's processes may use (``nproc`` there: its affinity)."""
    r = host.run(["nproc"], timeout=30)
    try:
        return max(1, int(r.stdout.strip()))
    except ValueError:
        return 1


def _default_workers(cpus: int) -> int:
    return max(1, min(MAX_DEFAULT_WORKERS, cpus))


def worker_env(cpus: int, n: int) -> dict[str, str]:
    """A node's ``n`` workers each get ``cpus // n`` of its CPUs: their libraries' thread pools sized to that
    (set before polars / pyarrow / BLAS start in the worker, :mod:`servelab.core.threads`), and a worker with
    more than one may start parse processes of its own (not a daemon process)."""
    return {**threads.thread_env(max(1, cpus // max(1, n))), "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}


def start_cluster(nodes: list[tuple[str, Any, str]], tracker: ProcessTracker, log_dir: str | Path,
                  workers: int = 0, python: str = "", timeout_s: float = 120.0, run_id: str = "") -> Cluster:
    """Start a scheduler on this machine and ``workers`` single-threaded workers (0: one per core, ≤ 8) on every
    node. ``nodes``: (name, host object, bind address) per node. ``python``: the interpreter with
    ``servelab[cluster]`` on every node (default: this one's path — the same virtual environment path on each).

    Checks every node first (the interpreter imports Dask distributed and servelab, the same Dask version and the
    same servelab code as here), then sweeps what killed earlier runs left there, then starts. Every process joins
    ``tracker``; their logs end in ``log_dir``."""
    distributed = require_dask()
    python = python or sys.executable
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    probe = [python, "-c", "import distributed, servelab.analyse.trace.load; from servelab.core.code import "
                           "code_fingerprint; print(distributed.__version__, code_fingerprint())"]
    here = code_fingerprint()
    for name, host, _ in nodes:
        r = host.run(probe, timeout=120)
        if r.exit_code != 0:
            last = ((r.stderr or r.stdout).strip().splitlines() or [f"exit status {r.exit_code}"])[-1]
            raise ClusterError(f"node {name}: {python} cannot import Dask distributed and servelab ({last}); install "
                               f"servelab[cluster] (this servelab) at that path on the node")
        version, _, code = r.stdout.strip().rpartition(" ")
        if version != distributed.__version__:
            raise ClusterError(f"node {name}: Dask distributed {version or r.stdout.strip()} there, "
                               f"{distributed.__version__} here; install the same version on every node")
        if code != here:
            raise ClusterError(f"node {name}: another servelab there (code {code}, here {here}); install this "
                               f"checkout's servelab at {python} on every node")
    local = LocalHost("controller")
    local.run_id = run_id
    swept = [row for _, host, _ in nodes for row in host.sweep() + cluster_tls.sweep(host)] + local.sweep() \
        + cluster_tls.sweep(local)
    bind = facing_address([b for _, _, b in nodes])
    pems = cluster_tls.make_certificates([bind, *[b for _, _, b in nodes], "localhost"])
    tls = {"controller": _install_tls(local, pems, run_id, tracker, "controller")}
    for name, host, _ in nodes:
        tls[name] = _install_tls(host, pems, run_id, tracker, name)
    sched_file = log_dir / "scheduler.json"
    sched_file.unlink(missing_ok=True)
    env = {"DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0"}
    tracker.start(local, [python, "-m", "distributed.cli.dask_scheduler", "--host", bind, "--port", "0",
                          "--protocol", "tls", *tls["controller"].cli_args(),
                          "--scheduler-file", str(sched_file), "--no-dashboard", "--no-show"],
                  log_dir / "scheduler.log", env=env, what="dask scheduler")
    deadline = time.monotonic() + timeout_s
    while not sched_file.exists():
        if time.monotonic() > deadline:
            raise ClusterError(f"the Dask scheduler did not start within {timeout_s:.0f} s: "
                               f"{_tail(log_dir / 'scheduler.log')}")
        time.sleep(0.1)
    address = json.loads(sched_file.read_text())["address"]
    first = len(tracker.entries) - 1
    total, names, remote_logs = 0, {}, []
    for name, host, node_bind in nodes:
        cpus = _node_cpus(host)
        n = workers or _default_workers(cpus)
        total += n
        names[node_bind] = name
        if isinstance(host, LocalHost):
            wdir, log = log_dir / f"dask-{name}", log_dir / f"workers-{name}.log"
        else:
            priv = host.private_dir(getattr(host, "workdir", "") or "")
            tracker.on_exit(f"cluster-logs-{name}", _fetch_and_remove(host, priv, log_dir / f"workers-{name}.log"))
            wdir, log = f"{priv}/dask", f"{priv}/workers.log"
            remote_logs.append((name, host, log))
        tracker.start(host, [python, "-m", "distributed.cli.dask_worker", address, "--host", node_bind,
                             "--protocol", "tls", *tls[name].cli_args(),
                             "--nworkers", str(n), "--nthreads", "1", "--name", name, "--no-dashboard",
                             "--local-directory", str(wdir), "--death-timeout", str(DEATH_TIMEOUT_S)],
                      log, env=worker_env(cpus, n), what=f"dask workers ({n}) of {address}")
    client = _client(address, timeout_s, tls["controller"].security())
    try:
        client.wait_for_workers(total, timeout=max(1.0, deadline - time.monotonic()))
    except TimeoutError:
        have = len(client.scheduler_info()["workers"])
        client.close()
        logs = "; ".join(f"{n}: {_tail(Path(log_dir) / f'workers-{n}.log')}" for n, h, _ in nodes
                         if isinstance(h, LocalHost))
        raise ClusterError(f"{have} of {total} Dask workers joined within {timeout_s:.0f} s"
                           + (f" ({logs})" if logs else f" (the nodes' worker logs are copied to {log_dir})")) from None
    return Cluster(address=address, client=client, started=True, node_names=names, tls=tls["controller"],
                   handles=[h for _, h in tracker.entries[first:]], sweep=swept, log_dir=str(log_dir),
                   spec=ClusterSpec("nodes" if any(not isinstance(h, LocalHost) for _, h, _ in nodes) else "local",
                                    workers))


def _install_tls(host: Any, pems: dict[str, bytes], run_id: str, tracker: ProcessTracker,
                 name: str) -> cluster_tls.TLSFiles:
    """The start's certificates on ``host``, removed once the tracker has stopped the processes."""
    try:
        files = cluster_tls.install(host, pems, run_id)
    except HostError as exc:
        raise ClusterError(str(exc)) from None
    tracker.on_exit(f"cluster-tls-{name}", lambda: cluster_tls.remove(host, files))
    return files


def _fetch_and_remove(host: Any, priv: str, local_log: Path):
    def step() -> None:
        try:
            host.get(f"{priv}/workers.log", local_log)
        finally:
            host.remove_private_dir(priv)
    return step


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:]) or "empty log"


def open_cluster(spec: ClusterSpec | str, tracker: ProcessTracker, log_dir: str | Path, target: Any = None,
                 run_id: str = "") -> Cluster:
    """The cluster ``spec`` names: joined (an address) or started (``local``, ``nodes`` of ``target``)."""
    spec = parse_cluster(spec) if isinstance(spec, str) else spec
    if spec is None:
        raise ClusterError(f"no cluster given: use {FORMS}")
    if spec.kind == "address":
        return connect_cluster(spec.address)
    if spec.kind == "local":
        host = LocalHost("local")
        host.run_id = run_id
        c = start_cluster([("local", host, "127.0.0.1")], tracker, log_dir, spec.workers, run_id=run_id)
    else:
        if target is None or not getattr(target, "nodes", None):
            raise ClusterError("cluster=nodes needs a target with nodes (params/targets/<name>.yaml)")
        triples = []
        for node in target.nodes:
            try:
                host = connect(node)
            except HostError as exc:
                raise ClusterError(str(exc)) from None
            host.run_id = run_id
            host.workdir = node.workdir
            triples.append((node.name, host, node.host if node.kind == "ssh" else "127.0.0.1"))
        c = start_cluster(triples, tracker, log_dir, spec.workers, run_id=run_id)
    c.spec = spec
    return c


def worker_placement() -> dict[str, str]:
    """On a worker: where this task runs (host name, worker address, pid) — what the page reports per rank."""
    try:
        w = require_dask().get_worker()
        addr, name = w.address, str(w.name)
    except ValueError:           # not on a worker (called directly)
        addr, name = "", ""
    return {"hostname": socket.gethostname(), "worker": addr, "worker_name": name, "pid": str(os.getpid())}
