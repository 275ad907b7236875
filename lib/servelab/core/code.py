"""servelab's own code, fingerprinted: a controller and the cluster workers it sends work to must run the same
servelab, not only the same Dask — a worker on another commit returns tables of another shape, and the controller
would fail far from the cause."""
from __future__ import annotations

import hashlib
from pathlib import Path


def code_fingerprint(root: str | Path | None = None) -> str:
    """12 hex digits of SHA-256 over every ``.py`` file of the package (its path under the package and its bytes,
    in path order): the same for an editable checkout and an installed copy of one commit; another commit, or a
    file edited on one side, gives another."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py"), key=lambda q: q.relative_to(root).as_posix()):
        if "__pycache__" in p.parts:
            continue
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]
