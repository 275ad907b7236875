"""A trace file read with plain ``json`` (the oracle several tests compare the loader's frames with), decoded once per
file and test session. Read-only: a caller that changes the document decodes its own copy."""
from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any


CACHED_MAX_BYTES = 2 << 20      # our samples (≤ 0.6 MB gz); a bigger third-party trace is decoded each time


def _decode(path: str) -> Any:
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)


@functools.lru_cache(maxsize=16)
def _decoded(path: str, size: int, mtime_ns: int) -> Any:
    return _decode(path)


def plain_trace(path: str | Path) -> Any:
    """The JSON document of a trace file (``.json`` or ``.json.gz``); shared between callers: never change it."""
    st = Path(path).stat()
    if st.st_size > CACHED_MAX_BYTES:
        return _decode(str(path))
    return _decoded(str(path), st.st_size, st.st_mtime_ns)
