"""A real SGLang on this CPU machine: ``sglang==0.5.23`` in its own venv under the servelab cache, serving the tiny
random HF Llama (``servelab.deploy.models.make_tiny_hf_model``) — the engine the method is written for, run here so
that the SGLang adapter meets a real server: launch flags, ``/metrics``, scheduler lines, ``/flush_cache``,
``/start_profile`` traces per rank (TP=2 and PP=2 with real gloo collectives), ``sglang.bench_serving``.

Install (``ensure_sglang_cpu``; ``servelab build --sglang``; ``make test``): every package pinned in
``servelab/data/sglang_cpu/requirements.txt`` (138 packages, ``pip install --no-deps``: no resolver run; torch
``2.13.0+cpu`` from a local wheel folder named by ``PIP_FIND_LINKS`` or the PyTorch CPU index), about 2 minutes and
3.3 GB the first time, instant afterwards. Workarounds make SGLang 0.5.23 run on a CPU-only machine; all are
files written into that venv only, documented in themselves, and verified by the install's probe:

1. ``servelab_sglang_cpu_hook.py`` (+ ``.pth``): declares the ``torchvision::nms``/``::qnms`` schemas before the
   first ``import torchvision`` (PyPI's CUDA torchvision cannot load its ops beside torch+cpu, and SGLang imports
   torchvision unconditionally).
   The same hook (workaround 3) gives ``torch.cpu`` the ``is_current_stream_capturing`` and ``empty_cache`` that
   SGLang's expert-distribution recorder calls on its device module (without them the recorder kills the
   scheduler at the first MoE forward on CPU); a venv installed earlier gets changed workaround files at its next
   ``ensure_sglang_cpu``.
2. ``sgl_kernel/``: a stand-in for SGLang's compiled kernel package (no CPU build is published) implementing the one
   helper plain decoding needs (``assign_req_to_token_pool_cpu``); every other helper raises
   ``NotImplementedError`` naming itself when called — speculative decoding among them, which is why Phase 9 says
   it cannot run on this target before starting anything.

The probe imports SGLang's HTTP server module (which pulls in torchvision and the stand-in), checks the versions,
that the stand-in is the one imported and registers no ``torch.ops.sgl_kernel`` op (so SGLang's AMX backend stays
off), and runs the stand-in's helper against its reference semantics. A failure names what failed and the log.
"""
from __future__ import annotations


import shutil
from pathlib import Path
from typing import Any

from servelab.core.paths import cache_root
from servelab.deploy.engine_venv import EngineVenv, EngineVenvError
from servelab.deploy.models import TINY_HF_KEY, TINY_MOE_KEY, make_tiny_hf_model, make_tiny_moe_model

SGLANG_VERSION = "0.5.23"
TORCH_VERSION = "2.13.0+cpu"
SGLANG_CPU_PYTHON = "sglang-cpu"               # a target's launch.python value for this venv
FILES = Path(__file__).resolve().parents[1] / "data" / "sglang_cpu"
REQUIREMENTS = FILES / "requirements.txt"
WORKAROUNDS = ("servelab_sglang_cpu.pth", "servelab_sglang_cpu_hook.py", "sgl_kernel")
VENV = EngineVenv("sglang-cpu", SGLANG_VERSION)

# run with the venv's interpreter after the install: the last line is JSON
PROBE = r"""
import json, torch
import sglang
import sglang.srt.entrypoints.http_server          # what launch_server imports: torchvision, sgl_kernel helpers
import sgl_kernel, torchvision, transformers
assert getattr(sgl_kernel, "__servelab_stand_in__", False), f"sgl_kernel is not servelab's stand-in: {sgl_kernel.__file__}"
assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed"), "torch.ops.sgl_kernel has ops: SGLang's AMX path would be on"
req_to_token = torch.zeros((3, 8), dtype=torch.int32)
sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), req_to_token, torch.tensor([1, 0]),
                                        torch.tensor([3, 2]), torch.tensor([7, 8, 9, 10]), 8)
assert req_to_token[2, 1:3].tolist() == [7, 8] and req_to_token[0, 0:2].tolist() == [9, 10], req_to_token
try:
    sgl_kernel.fill_bonus_tokens_cpu()
    raise AssertionError("a missing helper did not raise")
except NotImplementedError:
    pass
import sglang.srt.eplb.expert_distribution        # the recorder: workaround (3) gives torch.cpu what it calls
assert torch.cpu.is_current_stream_capturing() is False and torch.cpu.empty_cache() is None
print(json.dumps({"sglang": sglang.__version__, "torch": torch.__version__, "torchvision": torchvision.__version__,
                  "transformers": transformers.__version__}))
"""


class SGLangCPUError(EngineVenvError):
    """Installing sglang-cpu or verifying its workarounds failed; the first line says what and names the log."""


def _torch_hint(tail: str) -> str:
    if "torch==" in tail and ("No matching distribution" in tail or "Could not find a version" in tail):
        return (f"\nsglang-cpu pins torch=={TORCH_VERSION}, which is not on PyPI: put its wheel in a folder named by "
                f"PIP_FIND_LINKS, or pass pip_args=['--extra-index-url', 'https://download.pytorch.org/whl/cpu'].")
    return ""


def cached_sglang_cpu() -> Path | None:
    """The venv's interpreter if an install finished and was verified; else None."""
    return VENV.cached()


def install_info() -> dict:
    """What the finished install recorded (versions, install_s, workarounds); empty if not installed."""
    return VENV.info()


def _site(v: EngineVenv) -> Path:
    return Path(v.probe("import json, sysconfig; print(json.dumps({'p': sysconfig.get_paths()['purelib']}))")["p"])


def _same(src: Path, dst: Path) -> bool:
    if src.is_dir():
        return dst.is_dir() and all(_same(f, dst / f.name) for f in src.iterdir() if f.name != "__pycache__")
    return dst.is_file() and dst.read_bytes() == src.read_bytes()


def _write_workarounds(site: Path, only_changed: bool = False) -> list[str]:
    """Copy the workaround files into the venv's site-packages (``only_changed``: those that differ); return the
    names written."""
    written = []
    for name in WORKAROUNDS:
        src, dst = FILES / name, site / name
        if only_changed and _same(src, dst):
            continue
        if dst.is_dir():
            shutil.rmtree(dst)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copyfile(src, dst)
        written.append(name)
    return written


def _install(v: EngineVenv, pip_args: list[str], timeout_s: float) -> dict:
    pip = [str(v.python), "-m", "pip"]
    v.run([*pip, "install", "--no-input", "--no-deps", "-r", str(REQUIREMENTS), *pip_args], timeout_s,
          hint=_torch_hint)
    _write_workarounds(_site(v))
    versions = v.probe(PROBE)
    if versions["sglang"] != SGLANG_VERSION:
        raise SGLangCPUError(f"sglang=={SGLANG_VERSION} installed but reports {versions['sglang']} (log {v.log})")
    return {**versions, "workarounds": list(WORKAROUND_NOTES)}


WORKAROUND_NOTES = (
    "servelab_sglang_cpu_hook.py: torchvision::nms/qnms schemas declared before torchvision's first import",
    "sgl_kernel stand-in: assign_req_to_token_pool_cpu in torch; every other helper raises NotImplementedError",
    "servelab_sglang_cpu_hook.py: torch.cpu.is_current_stream_capturing (False) and empty_cache (no-op) for "
    "SGLang's expert-distribution recorder")


def _refresh_workarounds() -> None:
    """A venv installed by an older servelab gets this version's workaround files (they only add, never remove);
    when any changed (or the marker lists others), the verification probe runs again and the marker records the
    workarounds now in place."""
    if not _write_workarounds(_site(VENV), only_changed=True) and \
            VENV.info().get("workarounds") == list(WORKAROUND_NOTES):
        return
    VENV.record(**VENV.probe(PROBE), workarounds=list(WORKAROUND_NOTES))


def ensure_sglang_cpu(pip_args: list[str] | None = None, timeout_s: float = 3600.0) -> Path:
    """The sglang-cpu venv's verified interpreter, installing it first if needed (locked against concurrent
    installs; a failed install leaves no marker)."""
    try:
        py = VENV.ensure(lambda v: _install(v, list(pip_args or []), timeout_s))
        _refresh_workarounds()
        return py
    except SGLangCPUError:
        raise
    except EngineVenvError as e:
        raise SGLangCPUError(str(e)) from None


def needs_sglang_cpu(model: str, launch: dict[str, Any]) -> bool:
    """Whether an SGLang target names this local CPU build: ``launch.python: sglang-cpu`` or ``model: tiny-hf`` /
    ``tiny-moe``."""
    return launch.get("python") == SGLANG_CPU_PYTHON or model in (TINY_HF_KEY, TINY_MOE_KEY)


def resolve_sglang_cpu(model: str, launch: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """For a local SGLang target: (model path, launch with ``python`` resolved), installing/generating as needed."""
    la = dict(launch)
    if la.get("python") == SGLANG_CPU_PYTHON:
        la["python"] = str(ensure_sglang_cpu())
    if model == TINY_HF_KEY:
        py = la["python"] if la.get("python") == str(VENV.python) else str(ensure_sglang_cpu())
        model = str(make_tiny_hf_model(cache_root() / "models" / TINY_HF_KEY, python=py))
    elif model == TINY_MOE_KEY:
        py = la["python"] if la.get("python") == str(VENV.python) else str(ensure_sglang_cpu())
        model = str(make_tiny_moe_model(cache_root() / "models" / TINY_MOE_KEY, python=py))
    return model, la
