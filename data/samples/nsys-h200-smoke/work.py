"""Workload profiled by nsys on the GPU host: a few 'engine steps' of matmuls (prefill-like and decode-like),
a single-rank NCCL all-reduce on a side stream, and some OS-runtime calls, inside a cudaProfilerStart/Stop
window named after the case id (NVTX)."""
import os
import sys
import time

import torch
import torch.distributed as dist

case = sys.argv[sys.argv.index("--case") + 1]
steps = int(os.environ.get("STEPS", "12"))
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29555")
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
x = torch.randn(64, 8192, device=dev, dtype=torch.bfloat16)
buf = torch.randn(32 * 1024 * 1024, device=dev, dtype=torch.float32)
side = torch.cuda.Stream()
for _ in range(3):       # warm-up outside the capture: cuBLAS handles, NCCL communicator
    (a @ b).sum()
    dist.all_reduce(buf, op=dist.ReduceOp.AVG)
torch.cuda.synchronize()
torch.cuda.profiler.start()
torch.cuda.nvtx.range_push(f"case:{case}")
for i in range(steps):
    torch.cuda.nvtx.range_push(f"step {i} {'prefill' if i % 4 == 0 else 'decode'}")
    with torch.cuda.stream(side):
        dist.all_reduce(buf, op=dist.ReduceOp.AVG)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    if i % 4 == 0:
        for _ in range(4):
            c = a @ b
    else:
        for _ in range(16):
            y = torch.relu(x @ a)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    time.sleep(0.002)
    with open(os.devnull, "wb") as f:
        f.write(b"x" * 4096)
    torch.cuda.nvtx.range_pop()
torch.cuda.nvtx.range_pop()
torch.cuda.profiler.stop()
dist.destroy_process_group()
print("workload done", case, steps, torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
