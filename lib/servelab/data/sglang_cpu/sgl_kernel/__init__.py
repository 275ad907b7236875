"""servelab's workaround (2) of 2 for SGLang on a CPU-only machine: a stand-in for ``sgl_kernel`` in the sglang-cpu
venv only (written there by ``servelab.deploy.sglang_cpu``). ``sgl_kernel.__servelab_stand_in__`` marks it.

The problem: on CPU, SGLang imports a few CPU helpers of its compiled kernel package ``sgl_kernel`` at module level
even when its Intel AMX backend is off (``mem_cache/allocation.py``, ``kernels/ops/kvcache/cache_move.py``, the
speculative-decoding modules). No CPU build of sgl-kernel is published on PyPI, so the server cannot even start.

The stand-in:
- implements the one helper plain decoding calls, ``assign_req_to_token_pool_cpu`` (for each request of a batch,
  its new KV-cache locations written into its row of ``req_to_token``: the same semantics as SGLang's triton kernel
  ``assign_req_to_token_pool`` in ``mem_cache/allocation.py``), in plain torch;
- registers no ``torch.ops.sgl_kernel`` operator, so SGLang's AMX check is False and every model op takes its
  torch-native path (the numbers are those of torch on this CPU, not of SGLang's CPU kernels);
- gives every other name a function that raises ``NotImplementedError`` naming the helper when *called*, so an
  import succeeds but a feature that needs a real kernel fails loudly, never silently.
"""
import torch

__servelab_stand_in__ = True
__version__ = "0.0.0+servelab-stand-in"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len=None):
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` = the next ``end - start`` entries of
    ``out_cache_loc`` (consumed in batch order)."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    at = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[at:at + n].to(req_to_token.dtype)
        at += n


class MissingKernel(NotImplementedError):
    pass


def _missing(name):
    def call(*args, **kwargs):
        raise MissingKernel(f"sgl_kernel.{name} is not available: servelab's sglang-cpu venv has a stand-in for "
                            f"sgl_kernel (no CPU build of sgl-kernel is published) that implements only "
                            f"assign_req_to_token_pool_cpu; the feature that called {name} needs the real kernel")
    call.__name__ = name
    call.__qualname__ = name
    return call


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    fn = _missing(name)
    globals()[name] = fn
    return fn


_ = torch        # torch is imported here as the real package does (callers expect it loaded)
