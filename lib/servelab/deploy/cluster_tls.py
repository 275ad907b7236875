"""TLS with mutual authentication for the Dask clusters servelab starts (docs/method.md#cluster-trust).

Each start makes a fresh certificate authority and one certificate signed by it (``cryptography``; EC P-256, valid
for :data:`VALID_DAYS`); the scheduler, every worker and the controller's client present that certificate and accept
only peers that present one signed by the same CA. The private key never leaves the run's own folders: on each node
(the controller included) it is written into ``<state_dir>/tls/<id>/`` (folder 0700, files 0600) over the hosts
layer (SFTP on SSH nodes), with ``owner.json`` naming the controller process; the folder is removed when the cluster
stops (a tracker exit step), and the next start on that node removes every folder whose controller is gone
(:func:`sweep`: a kernel killed before its clean-up ran).
"""
from __future__ import annotations

import datetime as dt
import ipaddress
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servelab.core.run import now_iso
from servelab.deploy.pid_records import HostError, controller_identity, owner_alive

VALID_DAYS = 7
TLS_SUBDIR = "tls"


@dataclass(frozen=True)
class TLSFiles:
    """Where the CA, the certificate and its key lie on one node."""
    folder: str
    ca: str
    cert: str
    key: str

    def cli_args(self) -> list[str]:
        """``dask scheduler`` / ``dask worker`` options that make it speak TLS and require the peer's certificate."""
        return ["--tls-ca-file", self.ca, "--tls-cert", self.cert, "--tls-key", self.key]

    def security(self) -> Any:
        """The client's ``distributed.Security``: this certificate, this CA, encryption required."""
        from distributed import Security
        return Security(tls_ca_file=self.ca, tls_client_cert=self.cert, tls_client_key=self.key,
                        require_encryption=True)


def make_certificates(names: list[str]) -> dict[str, bytes]:
    """A new CA and one certificate it signs (for the scheduler, the workers and the client alike; ``names``: the
    addresses it is valid for): ``{"ca.pem", "cert.pem", "key.pem"}`` as PEM bytes. The CA's key is not kept."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, f"servelab cluster CA {secrets.token_hex(4)}")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for n in dict.fromkeys(names):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "servelab cluster member")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(alt or [x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return {"ca.pem": ca.public_bytes(pem), "cert.pem": cert.public_bytes(pem),
            "key.pem": key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())}


def tls_root(host: Any) -> str:
    """``<state_dir>/tls`` as the node's shell sees it (``~/`` is expanded there)."""
    return f"{host.state_dir.rstrip('/')}/{TLS_SUBDIR}"


# expands a leading "~/" of $1 on the node (the default state_dir of an SSH node is ~/.cache/servelab)
_EXPAND = 'd="$1"; case "$d" in "~/"*) d="$HOME/${d#"~/"}";; esac; '


def install(host: Any, pems: dict[str, bytes], run_id: str = "") -> TLSFiles:
    """Write the certificates into a new owner-only folder on ``host`` (folder 0700, files 0600, created under a
    0077 umask and before any byte is written, so that no file is ever readable by others) and return their
    paths."""
    names = ["owner.json", *pems]
    script = (_EXPAND + 'umask 077 && mkdir -p -- "$d" && chmod 700 -- "$(dirname -- "$d")" "$d" && cd -- "$d" '
              '&& shift && for f in "$@"; do : > "$f" && chmod 600 -- "$f" || exit 1; done && pwd')
    folder = f"{tls_root(host)}/{secrets.token_hex(8)}"
    r = host.run(["sh", "-c", script, "servelab-tls", folder, *names], timeout=30)
    path = r.stdout.strip()
    if r.exit_code != 0 or not path.startswith("/"):
        raise HostError(f"{host.name}: cannot make the TLS folder {folder}: {(r.stderr or r.stdout).strip()}")
    owner = {"owner": controller_identity(), "run_id": run_id, "made": now_iso()}
    for name, data in {"owner.json": json.dumps(owner).encode(), **pems}.items():
        host.write_file(f"{path}/{name}", data)
    return TLSFiles(path, f"{path}/ca.pem", f"{path}/cert.pem", f"{path}/key.pem")


def remove(host: Any, files: TLSFiles) -> None:
    """Remove the folder :func:`install` made (only a folder directly under a ``tls`` folder)."""
    if Path(files.folder).parent.name != TLS_SUBDIR:
        return
    host.run(["rm", "-rf", "--", files.folder], timeout=60)


def sweep(host: Any) -> list[dict[str, Any]]:
    """Remove the TLS folders earlier starts left on ``host`` whose controller process is gone (killed before its
    clean-up ran); one row per folder removed. Folders of a live controller, or of a controller on another
    machine, are kept."""
    root = tls_root(host)
    script = _EXPAND + ('for x in "$d"/*/; do [ -d "$x" ] || continue; printf "%s\\t" "$x"; '
                        'cat -- "$x/owner.json" 2>/dev/null | tr -d "\\n"; echo; done')
    r = host.run(["sh", "-c", script, "servelab-tls", root], timeout=30)
    rows = []
    for line in r.stdout.splitlines():
        path, _, text = line.partition("\t")
        try:
            owner = json.loads(text).get("owner") or {}
        except ValueError:
            owner = {}
        if owner and owner_alive(owner) is not False:
            continue
        path = path.rstrip("/")
        host.run(["rm", "-rf", "--", path], timeout=60)
        rows.append({"node": host.name, "what": "dask TLS certificates", "path": path, "when": now_iso(),
                     "action": f"removed (controller {owner.get('host')} pid {owner.get('pid')} is gone)"
                     if owner else "removed (no owner record)"})
    return rows
