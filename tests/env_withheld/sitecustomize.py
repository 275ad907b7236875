"""A planted miss for tests/test_env_reach_live.py — loaded by the SGLang engine's processes of that test only (its
target puts this folder on PYTHONPATH): the variable named by ``SERVELAB_TEST_WITHHOLD`` is taken out of the
launcher's environment while it starts its second scheduler process (tensor-parallel rank 1) and put back right
after, so rank 1 starts without it while rank 0 and every other process keep it — the way a worker spawn that drops
an ``-e NCCL_…`` loses a setting for the ranks. Nothing else changes."""
import os

_VAR = os.environ.get("SERVELAB_TEST_WITHHOLD", "")
if _VAR:
    import multiprocessing.process as _mpp

    _start = _mpp.BaseProcess.start
    _schedulers = []

    def start(self):
        target = getattr(self, "_target", None)
        if getattr(target, "__name__", "").startswith("run_scheduler_process"):
            _schedulers.append(self)
            if len(_schedulers) == 2:             # the second scheduler: tensor-parallel rank 1
                value = os.environ.pop(_VAR, None)
                try:
                    return _start(self)
                finally:
                    if value is not None:
                        os.environ[_VAR] = value
        return _start(self)

    _mpp.BaseProcess.start = start
