"""The script that made ``cuda_memory_trace.json.gz`` and ``memory_stats.json`` (run as ``python3
capture_cuda_memory.py OUT_DIR`` on a GPU machine with torch): a torch.profiler capture (CPU + CUDA,
``profile_memory``: the Kineto ``[memory]`` events whose ``Total Allocated`` / ``Total Reserved`` the memory layer
reads) around six decode-like steps — a growing batch, a matmul workspace, odd-sized KV pages freed out of order, so
the caching allocator keeps reserved blocks it cannot reuse — and ``torch.cuda.memory_stats()`` before and after it
(the peaks since the capture began: the ground truth)."""
import gzip
import json
import shutil
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

out = Path(sys.argv[1])
dev = torch.device("cuda:0")
w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)         # "weights", allocated before the capture
torch.cuda.synchronize()
torch.cuda.empty_cache()
torch.cuda.reset_peak_memory_stats(dev)
before = torch.cuda.memory_stats(dev)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True, record_shapes=True) as p:
    kept = []
    for step in range(6):
        x = torch.randn(64 * (step + 1), 4096, device=dev, dtype=torch.bfloat16)     # a growing batch
        y = x @ w                                                                  # the step's workspace
        kv = torch.empty(3 * 1024 * 1024 + step * 77_777, device=dev, dtype=torch.uint8)   # odd-sized KV pages
        kept.append(kv)
        if step % 2:
            kept.pop(0)                                                            # freed out of order
        del x, y
    torch.cuda.synchronize()
after = torch.cuda.memory_stats(dev)
t = out / "cuda_memory_trace.json"
p.export_chrome_trace(str(t))
with open(t, "rb") as f, gzip.open(str(t) + ".gz", "wb") as g:
    shutil.copyfileobj(f, g)
t.unlink()
k = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current", "reserved_bytes.all.peak")
(out / "memory_stats.json").write_text(json.dumps({
    "torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(dev),
    "before_capture": {x: before[x] for x in k}, "after_capture": {x: after[x] for x in k}}, indent=1) + "\n")
print("ok")
