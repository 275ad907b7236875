"""Headless Chromium screenshots of rendered pages (Debian's chromium; no browser download)."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts" / "screenshots"


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(page: Path, name: str, width: int = 1200, height: int = 2400) -> Path:
    """Render ``page`` (file://) in headless Chromium with JS time to draw; returns the PNG path."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    out = ARTIFACTS / f"{name}.png"
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", "--hide-scrollbars", f"--window-size={width},{height}",
                        "--virtual-time-budget=10000", f"--screenshot={out}", page.resolve().as_uri()],
                       check=True, capture_output=True, timeout=120)
    return out


def content_fraction(png: Path) -> float:
    """Fraction of pixels that are not the page background (white): a blank page gives ~0."""
    from PIL import Image
    img = Image.open(png).convert("L")
    hist = img.histogram()
    return 1.0 - sum(hist[250:]) / float(img.width * img.height)


def dom_text(page: Path) -> str:
    """The page's DOM after scripts ran (``--dump-dom``)."""
    with tempfile.TemporaryDirectory() as profile:
        p = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                            "--no-first-run", "--disable-background-networking", "--disable-component-update",
                            "--disable-sync", f"--user-data-dir={profile}", "--virtual-time-budget=10000",
                            "--dump-dom", page.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    return p.stdout
