"""Where the project, its outputs and its caches live."""
from __future__ import annotations

import os
import re
from pathlib import Path


def path_slug(text: str, max_len: int = 120) -> str:
    """A label (``batch_size=../../x``) as ONE safe folder name: letters, digits, ``=``, ``+``, ``,``, ``.``, ``_``
    and ``-`` only (``batch_size=32+ubatch_size=8`` stays readable), no ``..``, no leading dot, never empty — so it
    can never leave the folder it is joined to."""
    slug = re.sub(r"[^A-Za-z0-9=+,._]+", "-", str(text))
    slug = re.sub(r"\.{2,}", "-", slug).strip("-.")[:max_len].strip("-.")
    return slug or "x"


def project_root() -> Path:
    """The servelab checkout (holds params/, notebooks/, data/). ``SERVELAB_ROOT`` overrides."""
    env = os.environ.get("SERVELAB_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parents[3]
    if (here / "notebooks").is_dir():
        return here
    return Path.cwd().resolve()


def outputs_root() -> Path:
    """Where runs are written (``SERVELAB_OUTPUTS`` overrides ``<root>/outputs``)."""
    env = os.environ.get("SERVELAB_OUTPUTS")
    return Path(env).resolve() if env else project_root() / "outputs"


def cache_root() -> Path:
    """User cache for built binaries and assembled models (``SERVELAB_CACHE`` or XDG cache)."""
    env = os.environ.get("SERVELAB_CACHE")
    if env:
        return Path(env).resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "servelab"


def samples_root() -> Path:
    return project_root() / "data" / "samples"
