"""One rank of servelab's gloo collective sweep: the CPU counterpart of nccl-tests' ``all_reduce_perf`` /
``all_gather_perf``, for an engine whose ranks talk through torch's gloo backend (SGLang on CPU).

It runs under the engine's own interpreter (the one that has torch; servelab is not installed there), so it
imports nothing from servelab. ``servelab.measure.gloo_sweep`` starts one process per rank and reads what rank 0
writes. The conventions are nccl-tests' (docs/metrics.md#gloo-sweep):

- size S: the buffer of an all-reduce; the gathered output of an all-gather (each rank contributes S / n);
  float32 elements, S / 4 of them (S / 4n per rank for all-gather);
- time: ``warmup`` calls, then ``iters`` calls timed back to back; the mean time per call on each rank, averaged
  over the ranks (nccl-tests' default ``-a 1``);
- algbw = S / time; busbw = algbw × 2(n−1)/n (all-reduce) or (n−1)/n (all-gather);
- wrong: the result checked after the timed calls (all-reduce of ones = n everywhere; all-gather of each rank's
  index = the ranks in order); a size with a wrong result is reported, never dropped.

Arguments: --rank R --world N --sizes S1,S2,... --collectives all_reduce,all_gather --iters K --warmup W --out F
(rank 0 writes one JSON object per collective × size to F). MASTER_ADDR / MASTER_PORT come from the environment
(``init_method=env://``); ``GLOO_SOCKET_IFNAME`` keeps the traffic on the interface servelab chose (loopback here).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--collectives", default="all_reduce,all_gather")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method="env://", rank=a.rank, world_size=a.world)
    n = a.world
    rows = []
    try:
        for coll in a.collectives.split(","):
            for s in (int(x) for x in a.sizes.split(",")):
                count = s // 4 if coll == "all_reduce" else s // (4 * n)
                if count < 1:
                    continue
                if coll == "all_reduce":
                    x = torch.ones(count, dtype=torch.float32)

                    def call(x=x):
                        dist.all_reduce(x)
                else:
                    x = torch.full((count,), float(a.rank), dtype=torch.float32)
                    outs = [torch.empty(count, dtype=torch.float32) for _ in range(n)]

                    def call(x=x, outs=outs):
                        dist.all_gather(outs, x)
                for _ in range(a.warmup):
                    call()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    call()
                mine = (time.perf_counter() - t0) / a.iters
                # the check: one more call on fresh inputs
                if coll == "all_reduce":
                    x.fill_(1.0)
                    call()
                    wrong = int((x != float(n)).sum())
                else:
                    x.fill_(float(a.rank))
                    call()
                    wrong = sum(int((o != float(r)).sum()) for r, o in enumerate(outs))
                t = torch.tensor([mine, float(wrong)], dtype=torch.float64)
                dist.all_reduce(t)
                if a.rank == 0:
                    time_s = float(t[0]) / n
                    nbytes = count * 4 * (n if coll == "all_gather" else 1)
                    algbw = nbytes / time_s / 1e9
                    factor = 2 * (n - 1) / n if coll == "all_reduce" else (n - 1) / n
                    rows.append({"collective": coll, "size_bytes": nbytes, "count": count, "type": "float",
                                 "nranks": n, "iters": a.iters, "warmup": a.warmup, "time_us": time_s * 1e6,
                                 "algbw_gbps": algbw, "busbw_gbps": algbw * factor, "wrong": int(t[1])})
    finally:
        dist.destroy_process_group()
    if a.rank == 0:
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
