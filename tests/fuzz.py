"""How many examples a generated-input test (hypothesis) draws: all of them in a full run (``make test``), a fifth
(at least 20) in the quick part (``pytest -m "not slow"``, set by ``conftest.pytest_configure``) — the quick part
checks the same properties on fewer inputs; the full run keeps the whole search."""
from __future__ import annotations

QUICK = False          # set by conftest.pytest_configure when the run deselects the slow tests


def examples(n: int) -> int:
    return max(20, n // 5) if QUICK else n
