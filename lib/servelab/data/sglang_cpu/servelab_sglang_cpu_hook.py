"""servelab's workarounds (1) and (3) for SGLang on a CPU-only machine, loaded by ``servelab_sglang_cpu.pth`` in the
sglang-cpu venv only (written there by ``servelab.deploy.sglang_cpu``; never in the project venv).

The problem: SGLang imports ``torchvision`` unconditionally (a multimodal config module). PyPI's torchvision is a
CUDA build; its compiled ops library cannot load beside ``torch==…+cpu``, so ``torchvision::nms`` is never defined
and ``torchvision/_meta_registrations.py`` dies at import on ``register_fake("torchvision::nms")`` with
``RuntimeError: operator torchvision::nms does not exist`` (then the same for ``qnms``).

The workaround: just before torchvision is imported for the first time, the two operator *schemas* are declared
(no kernel). Importing then succeeds; calling ``torchvision.ops.nms`` would still fail loudly ("no kernel ... for
CPU"), which no text-model path of SGLang does. Nothing else changes: the finder below only watches for the first
``import torchvision``, declares the schemas, removes itself and lets the normal import go on. torch is imported
only then, so a plain interpreter start in this venv stays cheap.

Workaround (3), for SGLang's expert-distribution recorder (``--expert-distribution-recorder-mode``): on every MoE
layer's expert selection the recorder asks the device module ``torch.get_device_module()`` — ``torch.cpu`` here —
``is_current_stream_capturing()`` whenever it is not recording (``eplb/expert_distribution.py``, ``_on_hook``), and
its ``stat`` dump calls ``empty_cache()`` once. ``torch.cpu`` has neither, so with the recorder on the scheduler dies
at its first MoE forward (``AttributeError: module 'torch.cpu' has no attribute 'is_current_stream_capturing'``, seen
with SGLang 0.5.23 and torch 2.13.0+cpu). Just before that module is first imported, the two functions are given to
``torch.cpu`` where missing, with the answers that are true on a CPU: no stream is ever being captured into a CUDA
graph (``False``), and there is no caching allocator to empty (nothing to do). The recorder's counting is SGLang's own.
"""
import sys

SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
           "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_libraries = []          # torch.library.Library objects must stay alive for their definitions to stay


def _torch():
    """torch, imported when a hook below first fires: this file runs at every interpreter start in the venv (the
    ``.pth``), and an interpreter that never imports torchvision or the expert recorder never pays for torch."""
    import torch
    return torch


def declare_torchvision_schemas():
    """Declare ``torchvision::nms`` / ``::qnms`` where nothing defined them yet; return the names declared."""
    torch = _torch()
    declared = []
    for schema in SCHEMAS:
        name = schema.split("(", 1)[0]
        try:
            torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
            continue                       # a working torchvision build defined it: leave it alone
        except RuntimeError:
            pass
        if not _libraries:
            _libraries.append(torch.library.Library("torchvision", "FRAGMENT"))
        _libraries[0].define(schema)
        declared.append(name)
    return declared


class _FirstTorchvisionImport:
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        declare_torchvision_schemas()
        return None                        # the regular finders import torchvision itself


EXPERT_RECORDER_MODULE = "sglang.srt.eplb.expert_distribution"


def give_torch_cpu_recorder_functions():
    """``torch.cpu.is_current_stream_capturing`` (False) and ``torch.cpu.empty_cache`` (no-op) where torch lacks
    them; return the names added."""
    torch = _torch()
    added = []
    if not hasattr(torch.cpu, "is_current_stream_capturing"):
        torch.cpu.is_current_stream_capturing = lambda: False
        added.append("is_current_stream_capturing")
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None
        added.append("empty_cache")
    return added


class _FirstRecorderImport:
    done = False

    def find_spec(self, fullname, path=None, target=None):
        # stays in sys.meta_path (removing itself here would make the import system skip the next finder for this
        # one import): a flag makes every later call a no-op
        if self.done or fullname != EXPERT_RECORDER_MODULE:
            return None
        self.done = True
        give_torch_cpu_recorder_functions()
        return None


if not any(isinstance(f, _FirstTorchvisionImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _FirstTorchvisionImport())
if not any(isinstance(f, _FirstRecorderImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _FirstRecorderImport())
