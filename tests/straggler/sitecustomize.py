"""A planted straggler for tests/test_phase3_sglang.py — loaded by the SGLang engine's processes of that test only (its
target puts this folder on PYTHONPATH): while the file named by ``SERVELAB_TEST_STRAGGLER_FLAG`` exists, the rank
``SERVELAB_TEST_STRAGGLER_RANK`` sleeps ``SERVELAB_TEST_STRAGGLER_DELAY_S`` before each torch collective SGLang calls on
CPU (``torch.distributed.all_reduce``, ``all_gather_into_tensor``, ``all_gather``, ``broadcast``), so it arrives last
at every one of them by that much. Nothing else changes."""
import functools
import os
import time

_FLAG = os.environ.get("SERVELAB_TEST_STRAGGLER_FLAG", "")
if _FLAG:
    import torch.distributed as _dist

    _RANK = int(os.environ.get("SERVELAB_TEST_STRAGGLER_RANK", "1"))
    _DELAY = float(os.environ.get("SERVELAB_TEST_STRAGGLER_DELAY_S", "0.1"))

    def _late(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if _dist.is_initialized() and _dist.get_rank() == _RANK and os.path.exists(_FLAG):
                time.sleep(_DELAY)
            return fn(*args, **kwargs)
        return call

    for _name in ("all_reduce", "all_gather_into_tensor", "all_gather", "broadcast"):
        setattr(_dist, _name, _late(getattr(_dist, _name)))
