"""servelab's workaround (1) of 2 for SGLang on a CPU-only machine, loaded by ``servelab_sglang_cpu.pth`` in the
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
"""
import sys

SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
           "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_libraries = []          # torch.library.Library objects must stay alive for their definitions to stay


def declare_torchvision_schemas():
    """Declare ``torchvision::nms`` / ``::qnms`` where nothing defined them yet; return the names declared."""
    import torch
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


if not any(isinstance(f, _FirstTorchvisionImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _FirstTorchvisionImport())
