"""Phase 3 over a real Dask cluster started by the tests: a scheduler and workers on loopback, and workers on two
sshd test nodes (127.0.0.2 / .3) each holding only its own rank files. The tables equal the single-process path's on
the real captures of data/samples (H200 GPU and SGLang-on-CPU); a worker killed mid-parse makes its rank retried once, then missing with the
reason; nothing is left running, and a killed controller's workers are swept by the next start."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from servelab.deploy.cluster import ClusterError, ClusterSpec, parse_cluster

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "data" / "samples"
CAPTURES = {"h200x2": SAMPLES / "h200x2" / "traces", "h200x2-tp2-graph": SAMPLES / "h200x2-tp2-graph" / "traces",
            "h200x2-pp2": SAMPLES / "h200x2-pp2" / "traces",
            "pp2_slowstage": SAMPLES / "pp2_slowstage" / "stage1_slow" / "traces",
            "sglang-cpu-tp2": SAMPLES / "sglang-cpu-tp2" / "traces", "sglang-cpu-pp2": SAMPLES / "sglang-cpu-pp2" / "traces"}

sys.path.insert(0, str(Path(__file__).parent))
from sshd import sshd_pair  # noqa: E402


# ------------------------------------------------------------------------------------------------ no processes

@pytest.mark.parametrize("text, spec", [("", None), ("local", ClusterSpec("local")), ("local:3", ClusterSpec("local", 3)),
                                        ("nodes:2", ClusterSpec("nodes", 2)),
                                        ("tcp://10.1.2.3:8786", ClusterSpec("address", address="tcp://10.1.2.3:8786"))])
def test_cluster_forms(text, spec):
    assert parse_cluster(text) == spec


@pytest.mark.parametrize("text", ["local:0", "nodes:x", "ray://head:10001", "10.1.2.3:8786", "tcp://h", "local 2"])
def test_bad_cluster_is_one_line(text):
    with pytest.raises(ClusterError) as e:
        parse_cluster(text)
    assert "\n" not in str(e.value) and ("local[:N]" in str(e.value) or "1..256" in str(e.value))


def test_the_code_fingerprint_is_the_packages_code(tmp_path):
    """An installed copy of the same files has the same fingerprint; one changed byte, or one more module, another."""
    from servelab.core.code import code_fingerprint
    here = code_fingerprint()
    assert len(here) == 12 and int(here, 16) >= 0
    copy = tmp_path / "servelab"
    shutil.copytree(ROOT / "lib" / "servelab", copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    assert code_fingerprint(copy) == here
    (copy / "core" / "code.py").write_text((copy / "core" / "code.py").read_text() + "\n")
    edited = code_fingerprint(copy)
    (copy / "core" / "code.py").write_text((ROOT / "lib" / "servelab" / "core" / "code.py").read_text())
    (copy / "core" / "extra.py").write_text("")
    assert len({here, edited, code_fingerprint(copy)}) == 3


def test_a_node_with_another_servelab_is_refused_before_anything_starts(tmp_path):
    """The node's interpreter imports a copy of servelab with one file edited (another commit, as far as the code
    goes): the start stops in one line naming the node and both fingerprints; nothing started, no TLS file made."""
    pytest.importorskip("distributed")
    from servelab.core.code import code_fingerprint
    from servelab.deploy.cluster import start_cluster
    from servelab.deploy.hosts import LocalHost, ProcessTracker
    lib = tmp_path / "lib"
    shutil.copytree(ROOT / "lib" / "servelab", lib / "servelab", ignore=shutil.ignore_patterns("__pycache__"))
    (lib / "servelab" / "analyse" / "trace" / "ranks.py").write_text(
        (lib / "servelab" / "analyse" / "trace" / "ranks.py").read_text() + "\n# another commit\n")
    python = tmp_path / "node-python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={lib} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    host = LocalHost("node1")
    tracker = ProcessTracker()
    with pytest.raises(ClusterError) as e:
        start_cluster([("node1", host, "127.0.0.1")], tracker, tmp_path / "logs", workers=1, python=str(python))
    msg = str(e.value)
    assert "\n" not in msg and "node node1: another servelab there" in msg
    assert code_fingerprint(lib / "servelab") in msg and code_fingerprint() in msg
    assert not tracker.entries and not (tmp_path / "logs" / "scheduler.json").exists()


def test_a_node_that_cannot_import_servelab_is_one_plain_line(tmp_path):
    """A node interpreter without the packages (here: the same Python without its site-packages) is named with the
    import error's own last line — no Python list around it — and nothing starts."""
    pytest.importorskip("distributed")
    from servelab.deploy.cluster import start_cluster
    from servelab.deploy.hosts import LocalHost, ProcessTracker
    python = tmp_path / "bare-python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    tracker = ProcessTracker()
    with pytest.raises(ClusterError) as e:
        start_cluster([("node1", LocalHost("node1"), "127.0.0.1")], tracker, tmp_path / "logs", workers=1,
                      python=str(python))
    msg = str(e.value)
    assert "\n" not in msg and "cannot import Dask distributed and servelab (ModuleNotFoundError: No module named" in msg
    assert "['" not in msg and not tracker.entries


# ------------------------------------------------------------------------------------------------ helpers

def tables(a, out: Path) -> dict[str, pl.DataFrame]:
    from servelab.analyse.trace.analysis import write_tables
    paths = write_tables(a, out)
    frames = {}
    for name, p in paths.items():
        if p.endswith(".csv"):
            text = Path(p).read_text()
            frames[name] = pl.read_csv(p, infer_schema_length=None) if text.strip() else pl.DataFrame()
    return frames


def assert_same_tables(got, want, tmp: Path) -> int:
    """Every table equal; floats to 1e-9 relative (the local path itself varies in the last bit between runs:
    polars sums groups in no fixed order). The ranks table differs only in its timing and cache columns."""
    a, b = tables(got, tmp / "cluster"), tables(want, tmp / "local")
    assert set(a) == set(b)
    for name in a:
        x, y = a[name], b[name]
        if name == "ranks":
            x, y = x.drop("load_s", "from_cache"), y.drop("load_s", "from_cache")
        assert_frame_equal(x, y, check_exact=False, rel_tol=1e-9, abs_tol=1e-9), name
    return len(a)


def gone(pgid: int) -> bool:
    """No running process left in the process group (a zombie, dead but not yet reaped by init, is not running)."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                return False
    return True


# ------------------------------------------------------------------------------------------------ loopback cluster

@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    pytest.importorskip("distributed")
    from servelab.deploy.cluster import open_cluster
    from servelab.deploy.hosts import ProcessTracker
    tracker = ProcessTracker()
    c = open_cluster("local:2", tracker, tmp_path_factory.mktemp("cluster-logs"))
    try:
        yield c
    finally:
        c.close()
        handles = tracker.stop_all()
        assert handles and all(gone(h.pid) for h in handles)
        assert all(not h.record_path or not Path(h.record_path).exists() for h in handles)


@pytest.mark.slow
def test_workers_use_exactly_their_share(local_cluster):
    """N workers on C cores: each worker's polars and Arrow pools hold C // N threads (set before they started),
    not C each; the loader's parse children start with one thread each; this process's environment is kept."""
    from servelab.analyse.trace import chunked
    from servelab.core.threads import usable_cpus
    share = max(1, usable_cpus() // 2)

    def pools():            # pickled by value (cloudpickle): runs in each worker
        import os as _os

        import polars as _pl
        import pyarrow as _pa
        return {"polars": _pl.thread_pool_size(), "arrow": _pa.cpu_count(), "share": _os.environ.get("SERVELAB_THREADS")}
    got = list(local_cluster.client.run(pools).values())
    assert len(got) == 2 and all(p == {"polars": share, "arrow": share, "share": str(share)} for p in got), got
    before = os.environ.get("POLARS_MAX_THREADS")
    ex = chunked.spawn_pool(2)
    assert ex is not None
    try:
        assert [ex.submit(os.getenv, "POLARS_MAX_THREADS").result() for _ in range(4)] == ["1"] * 4
    finally:
        ex.shutdown()
    assert os.environ.get("POLARS_MAX_THREADS") == before


@pytest.mark.slow
@pytest.mark.parametrize("capture", sorted(CAPTURES))
def test_tables_equal_the_local_path(local_cluster, capture, tmp_path):
    from servelab.analyse.trace.analysis import analyse
    from servelab.analyse.trace.cluster import analyse_on_cluster
    folder = tmp_path / "cap"
    shutil.copytree(CAPTURES[capture], folder)
    got = analyse_on_cluster(local_cluster, str(folder))
    assert not any(t.from_cache for t in got.capture.ranks)          # parsed by the workers, not read back here
    want = analyse(folder)
    assert assert_same_tables(got, want, tmp_path) >= 20
    pl_ = got.placement
    assert pl_["status"].to_list() == ["parsed"] * len(want.rops) and set(pl_["node"]) == {"local"}
    assert all(w.startswith("tls://127.0.0.1:") for w in pl_["worker"])      # the locked cluster
    # each rank's Parquet cache is beside its file (where the worker ran)
    assert len(list((folder / ".servelab_cache").glob("*.parquet"))) == len(want.rops)
    # each step's wall and controller CPU time, the cluster's reduce and fetch before the cross-rank steps
    steps = ["load", "prepare", "timeline", "ranks", "tables"]
    assert list(want.timings_s) == list(want.cpu_s) == steps
    assert list(got.cpu_s) == list(got.timings_s) == ["cluster_reduce", "cluster_fetch", *steps]
    assert all(v >= 0 for v in got.cpu_s.values()) and got.cpu_s["cluster_fetch"] <= got.cpu_s["cluster_reduce"]


@pytest.mark.slow
def test_joining_a_cluster_checks_every_workers_servelab(local_cluster):
    """``tls://`` join with the user's certificates (Dask's configuration): the workers run this servelab, so the join
    holds; their fingerprints are asked over the cluster (``client.run``), not assumed."""
    import dask

    from servelab.core.code import code_fingerprint
    from servelab.deploy.cluster import connect_cluster
    t = local_cluster.tls
    with dask.config.set({"distributed.comm.tls.ca-file": t.ca, "distributed.comm.tls.client.cert": t.cert,
                          "distributed.comm.tls.client.key": t.key}):
        joined = connect_cluster(local_cluster.address)
    try:
        assert not joined.started
        assert set(joined.client.run(code_fingerprint).values()) == {code_fingerprint()}
    finally:
        joined.close()


@pytest.mark.slow
def test_a_folder_no_node_has_is_one_line(local_cluster, tmp_path):
    from servelab.analyse.trace.cluster import analyse_on_cluster
    from servelab.analyse.trace.decode import TraceFormatError
    with pytest.raises(TraceFormatError) as e:
        analyse_on_cluster(local_cluster, str(tmp_path / "nowhere"))
    msg = str(e.value)
    assert "\n" not in msg and "no *.json / *.json.gz trace files on any node" in msg
    assert "Node local: " in msg and "no such folder on this node" in msg


def _kill_on_start(cluster, rank_index: int, attempts: set[int], killed: list, stop: threading.Event) -> None:
    """Watch the scheduler; SIGKILL the worker process that holds rank ``rank_index``'s task of each attempt in
    ``attempts`` as soon as it is processing it."""
    client = cluster.client
    pids: dict[str, int] = {}
    while not stop.is_set():
        for addr, keys in client.processing().items():
            for k in keys:
                k = str(k)
                for a in attempts:
                    if k.startswith(f"servelab-rank-{rank_index}-a{a}-") and a not in {x[0] for x in killed}:
                        if addr not in pids:
                            pids.update(client.run(os.getpid, workers=[addr]))
                        os.kill(pids[addr], signal.SIGKILL)
                        killed.append((a, addr))
        time.sleep(0.01)


@pytest.mark.slow
def test_worker_death_retried_once_then_missing(local_cluster, tmp_path):
    from servelab.analyse.trace.actions import evidence_actions
    from servelab.analyse.trace.cluster import analyse_on_cluster
    from servelab.analyse.trace.questions import ten_questions
    from servelab.phases.phase3_timeline import Phase3, findings, placement_table
    folder = tmp_path / "cap"
    shutil.copytree(CAPTURES["h200x2"], folder)
    for attempts, status in (({1}, "parsed"), ({1, 2}, "missing")):
        shutil.rmtree(folder / ".servelab_cache", ignore_errors=True)     # cold: the parse takes long enough
        killed, stop = [], threading.Event()
        th = threading.Thread(target=_kill_on_start, args=(local_cluster, 0, attempts, killed, stop), daemon=True)
        th.start()
        try:
            a = analyse_on_cluster(local_cluster, str(folder))
        finally:
            stop.set()
            th.join(10)
        assert [k[0] for k in killed] == sorted(attempts)
        row = a.placement.filter(pl.col("file").str.contains("TP-0")).row(0, named=True)
        assert row["status"] == status and row["attempts"] == 2
        assert "the worker died while parsing it" in row["reason"]
        if status == "parsed":
            assert len(a.rops) == 2 and row["reason"].startswith("attempt 1: ")
        else:
            assert [r.rank for r in a.rops] == [1]                 # the other rank is analysed, this one listed
            p = Phase3(a, ten_questions(a), evidence_actions(a), {})
            assert any("MISSING" in f and "TP-0" in f for f in findings(p))
            assert "MISSING" in placement_table(p).attrs["caption"]
        # the nanny brought the killed worker back: the cluster keeps its two workers
        local_cluster.client.wait_for_workers(2, timeout=60)


@pytest.mark.slow
def test_phase3_cli_on_a_local_cluster(tmp_path):
    """Must show: ``servelab run phase3 -p trace_dir=... -p cluster=...`` gives the local path's tables, and the
    page says where each rank was parsed."""
    pytest.importorskip("distributed")
    folder = tmp_path / "cap"
    shutil.copytree(CAPTURES["h200x2-pp2"], folder)
    env = {**os.environ, "SERVELAB_OUTPUTS": str(tmp_path / "out")}
    cli = [sys.executable, "-m", "servelab.cli", "run", "phase3", "-p", f"trace_dir={folder}", "-p", "capture=False"]
    runs = {}
    for rid, extra in (("local", []), ("clustered", ["-p", "cluster=local:2"])):
        p = subprocess.run([*cli, "--run-id", rid, *extra], capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        runs[rid] = tmp_path / "out" / rid / "phase3"
    for f in sorted(runs["local"].glob("trace_*.csv")):
        if f.name in ("trace_ranks.csv",):
            continue
        other = runs["clustered"] / f.name
        theirs = other.read_text().replace("--run-id clustered", "--run-id local")   # hints name their own run
        if f.read_text() != theirs:
            assert_frame_equal(pl.read_csv(theirs.encode()), pl.read_csv(f), check_exact=False, rel_tol=1e-9,
                               abs_tol=1e-9)
    placement = pl.read_csv(runs["clustered"] / "trace_placement.csv")
    assert placement["status"].to_list() == ["parsed", "parsed"]
    page = (runs["clustered"] / "report.html").read_text()
    assert "Where each rank was parsed" in page and "2 of 2 rank files parsed on 1 node(s)" in page
    assert all(w in page for w in placement["worker"])
    assert "parsed in this process" in (runs["local"] / "report.html").read_text()


# ------------------------------------------------------------------------------------------------ sshd nodes

@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    pytest.importorskip("distributed")
    yield from sshd_pair(tmp_path_factory)


def ssh_target(a, b, known: Path):
    from servelab.deploy.targets import target_from_dict
    node = dict(kind="ssh", user="root", known_hosts=str(known))
    return target_from_dict({
        "name": "two-node-cluster", "engine": "llamacpp", "model": "tiny",
        "nodes": [dict(node, name="head", role="head", host="127.0.0.2", port=a.port, key_file=str(a.client_key)),
                  dict(node, name="worker", role="worker", host="127.0.0.3", port=b.port, key_file=str(b.client_key))]})


@pytest.mark.slow
def test_ranks_parsed_on_the_ssh_nodes_that_hold_them(nodes, tmp_path):
    from servelab.analyse.trace.analysis import analyse
    from servelab.analyse.trace.cluster import analyse_on_cluster
    from servelab.deploy.cluster import open_cluster
    from servelab.deploy.hosts import ProcessTracker
    a_, b_, known = nodes
    cap = tmp_path / "cap"
    for node, rank in (("head", 0), ("worker", 1)):       # each node holds only its own rank's file
        (cap / node).mkdir(parents=True)
        src = next(CAPTURES["h200x2"].glob(f"*-TP-{rank}.trace.json.gz"))
        shutil.copy(src, cap / node / src.name)
    tls_root = Path.home() / ".cache" / "servelab" / "tls"          # the nodes' default state_dir, on this machine
    tls_before = set(tls_root.glob("*")) if tls_root.is_dir() else set()
    with ProcessTracker() as tracker:
        c = open_cluster("nodes:1", tracker, tmp_path / "logs", target=ssh_target(a_, b_, known))
        assert set(c.nodes()) == {"127.0.0.2", "127.0.0.3"}
        assert len(set(tls_root.glob("*")) - tls_before) >= 2          # each node got the certificates over SSH
        got = analyse_on_cluster(c, str(cap / "{node}"))
        c.close()
        handles = list(tracker.entries)
    assert handles and all(gone(h.pid) for _, h in handles)
    assert all(not h.record_path or not Path(h.record_path).exists() for _, h in handles)
    assert (tmp_path / "logs" / "workers-head.log").exists() and (tmp_path / "logs" / "workers-worker.log").exists()
    pl_ = got.placement.sort("rank")
    assert pl_["node"].to_list() == ["head", "worker"]
    assert pl_["worker"][0].startswith("tls://127.0.0.2:") and pl_["worker"][1].startswith("tls://127.0.0.3:")
    assert set(tls_root.glob("*")) - tls_before == set()                # no certificate left on a node after stop
    for node in ("head", "worker"):                      # the Parquet cache was written on the node holding the file
        assert len(list((cap / node / ".servelab_cache").glob("*.parquet"))) == 1
    assert [t.identity.node for t in got.capture.ranks] == ["head", "worker"]
    want = analyse(cap)                                  # the local loader names nodes by their sub-folders
    assert assert_same_tables(got, want, tmp_path) >= 20


KILLED_CONTROLLER = textwrap.dedent("""
    import json, sys, time
    from servelab.deploy.cluster import open_cluster
    from servelab.deploy.hosts import ProcessTracker
    from servelab.deploy.targets import target_from_dict
    target = target_from_dict(json.loads(sys.argv[1]))
    tracker = ProcessTracker()
    c = open_cluster("nodes:1", tracker, sys.argv[2], target=target)
    print(json.dumps([[h.host, h.pid, h.record_path] for _, h in tracker.entries]), flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
def test_killed_controller_leaves_nothing_running(nodes, tmp_path):
    """The kernel is SIGKILLed (no clean-up runs): its scheduler dies with it (parent-death signal), the nodes'
    workers stop on their own once their scheduler is gone, and the next start's sweep clears their pid records."""
    from servelab.deploy.cluster import DEATH_TIMEOUT_S, open_cluster
    from servelab.deploy.hosts import ProcessTracker
    from servelab.deploy.targets import target_from_dict
    a_, b_, known = nodes
    spec = {"name": "two-node-cluster", "engine": "llamacpp", "model": "tiny",
            "nodes": [dict(kind="ssh", user="root", known_hosts=str(known), name="head", role="head",
                           host="127.0.0.2", port=a_.port, key_file=str(a_.client_key)),
                      dict(kind="ssh", user="root", known_hosts=str(known), name="worker", role="worker",
                           host="127.0.0.3", port=b_.port, key_file=str(b_.client_key))]}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CONTROLLER, json.dumps(spec), str(tmp_path / "l1")],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        started = json.loads(proc.stdout.readline())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert {h for h, _, _ in started} == {"controller", "head", "worker"}
    assert all(Path(rec).exists() for _, _, rec in started)        # nobody removed the records
    deadline = time.monotonic() + DEATH_TIMEOUT_S + 15
    while not all(gone(pid) for _, pid, _ in started) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(gone(pid) for _, pid, _ in started)
    with ProcessTracker() as tracker:
        c = open_cluster("nodes:1", tracker, tmp_path / "l2", target=target_from_dict(spec))
        c.close()
    assert not any(Path(rec).exists() for _, _, rec in started)    # swept: the dead owner's records are cleared


SIGTERMED_CONTROLLER = textwrap.dedent("""
    import json, sys, time
    from servelab.deploy.cluster import open_cluster
    from servelab.deploy.hosts import ProcessTracker
    with ProcessTracker() as tracker:
        c = open_cluster("local:2", tracker, sys.argv[1])
        print(json.dumps([h.pid for _, h in tracker.entries]), flush=True)
        time.sleep(600)
""")


@pytest.mark.slow
def test_sigterm_stops_the_local_cluster(tmp_path):
    """SIGTERM to the controller (a run being terminated) stops the scheduler and the workers through the tracker."""
    pytest.importorskip("distributed")
    proc = subprocess.Popen([sys.executable, "-c", SIGTERMED_CONTROLLER, str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(proc.stdout.readline())
        assert len(pids) == 2 and not any(gone(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert all(gone(p) for p in pids)
