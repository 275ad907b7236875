"""A locked cluster: the Dask scheduler and workers servelab starts speak TLS with mutual authentication. A client
without the run's certificate is refused by the scheduler and by a worker (a real handshake, refused); the cluster
works with it; no certificate file is left after stop; a folder a killed controller left is swept at the next
start."""
from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("distributed")

from servelab.deploy import cluster_tls  # noqa: E402
from servelab.deploy.cluster import ClusterError, connect_cluster, open_cluster  # noqa: E402
from servelab.deploy.hosts import LocalHost, ProcessTracker  # noqa: E402


def _refused(address: str, security) -> str:
    """Try a real connection to ``address`` with ``security``'s client side; the error when refused, "" when it
    connected."""
    from distributed.comm import connect

    async def go() -> str:
        try:
            comm = await connect(address, timeout=5, **security.get_connection_args("client"))
        except Exception as exc:  # noqa: BLE001  (any refusal: TLS handshake, closed comm, timeout)
            return f"{type(exc).__name__}: {exc}" or type(exc).__name__
        await comm.close()
        return ""
    return asyncio.run(go())


def _files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


@pytest.mark.slow
def test_a_client_without_the_certificate_is_refused_and_the_run_works_with_it(tmp_path, monkeypatch):
    from distributed import Security
    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path / "cache"))
    tracker = ProcessTracker()
    c = open_cluster("local:1", tracker, tmp_path / "logs")
    try:
        tls_root = Path(cluster_tls.tls_root(LocalHost()))
        assert c.address.startswith("tls://127.0.0.1:")
        # owner-only: the folders 0700, every file 0600
        for d in [tls_root, *[p for p in tls_root.rglob("*") if p.is_dir()]]:
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        files = _files_under(tls_root)
        assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
        worker = next(iter(c.client.scheduler_info()["workers"]))
        assert worker.startswith("tls://")
        # works with the certificate
        assert c.client.submit(sum, [1, 2, 3], pure=False).result(timeout=60) == 6
        assert _refused(c.address, c.tls.security()) == ""
        # refused without it: the CA alone (a client that checks the server but shows no certificate), by the
        # scheduler and by the worker
        no_cert = Security(tls_ca_file=c.tls.ca, require_encryption=True)
        assert _refused(c.address, no_cert)
        assert _refused(worker, no_cert)
        # a certificate of another CA (another run's) is refused too
        other = cluster_tls.install(LocalHost("x", state_dir=str(tmp_path / "other")),
                                    cluster_tls.make_certificates(["127.0.0.1"]))
        assert _refused(c.address, other.security()) and _refused(worker, other.security())
    finally:
        c.close()
        tracker.stop_all()
    assert _files_under(tls_root) == []                     # no certificate or key left after stop


def test_a_folder_left_by_a_killed_controller_is_swept_and_a_live_ones_kept(tmp_path):
    """The certificates of a controller that no longer runs are removed at the next start; those of a running
    controller (this process) are not."""
    host = LocalHost("n", state_dir=str(tmp_path / "state"))
    pems = cluster_tls.make_certificates(["127.0.0.1"])
    mine = cluster_tls.install(host, pems)
    dead = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]);"
                           "from servelab.deploy import cluster_tls as t; from servelab.deploy.hosts import LocalHost;"
                           "print(t.install(LocalHost('n', state_dir=sys.argv[2]), "
                           "t.make_certificates(['127.0.0.1'])).folder)",
                           str(Path(__file__).parents[1] / "lib"), str(tmp_path / "state")],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert Path(dead, "key.pem").is_file()
    rows = cluster_tls.sweep(host)
    assert [r["path"] for r in rows] == [dead] and "is gone" in rows[0]["action"]
    assert not Path(dead).exists() and Path(mine.key).is_file()
    cluster_tls.remove(host, mine)
    assert not Path(mine.folder).exists()


def test_joining_a_tls_cluster_without_certificates_is_one_line(monkeypatch):
    for k in list(os.environ):
        if k.startswith("DASK_DISTRIBUTED__COMM__TLS"):
            monkeypatch.delenv(k)
    with pytest.raises(ClusterError, match="needs your TLS files: set DASK_DISTRIBUTED__COMM__TLS__CA_FILE"):
        connect_cluster("tls://127.0.0.1:1")


def test_the_certificate_is_signed_by_its_ca_and_names_the_addresses():
    from cryptography import x509
    pems = cluster_tls.make_certificates(["127.0.0.1", "node-a"])
    ca, cert = x509.load_pem_x509_certificate(pems["ca.pem"]), x509.load_pem_x509_certificate(pems["cert.pem"])
    cert.verify_directly_issued_by(ca)
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a.value) for a in alt] == ["127.0.0.1", "node-a"]
    assert json.dumps(sorted(pems)) == '["ca.pem", "cert.pem", "key.pem"]'
