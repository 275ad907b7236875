"""A serving-shaped TP×PP toy (random weights) profiled with torch.profiler on every rank.

Run on a GPU machine (one process per GPU, e.g. ``torchrun --nproc-per-node 8 benchmarks/gpu_capture_toy.py
--tp 4 --pp 2 OUT``) to produce a real multi-rank capture with the shape of an SGLang one:

- traces named like SGLang's: ``<ts>-TP-<t>[-PP-<p>].trace.json.gz``, with ``distributedInfo``;
- ``step[EXTEND bs=1 toks=N]`` / ``step[DECODE bs=B]`` user annotations per engine step;
- tensor parallelism: NCCL all-reduce inside each stage after attention and MLP (collective args recorded);
- pipeline parallelism: activations sent stage → stage with NCCL send/recv; chunked prefill forms a
  natural micro-batch pipeline (stage 0 runs chunk i+1 while stage 1 runs chunk i);
- decode steps replayed from a CUDA graph per stage (send/recv outside the graph);
- one long prefill chunk injected between decode steps (the mixed scenario of docs/method.md#capture-scenarios);
- ``--slow-stage S --slow-factor F --slow-steps A:B``: stage S runs its compute F times (real GPU work, same
  result) in profiled steps A..B-1 (every ``step[...]`` counts, from 0).

``--device cpu`` runs the same program with gloo and no CUDA graph, to check it anywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    ap.add_argument("--prefill-chunks", type=int, default=4)
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-graph", action="store_true", help="decode eagerly (no CUDA graph)")
    ap.add_argument("--tp-new-group", action="store_true",
                    help="all-reduce on a new_group even with one stage (to reproduce the 2026-11-29 hang)")
    ap.add_argument("--slow-stage", type=int)
    ap.add_argument("--slow-factor", type=int, default=3)
    ap.add_argument("--slow-steps", default="0:99999")
    a = ap.parse_args()
    lo, hi = map(int, a.slow_steps.split(":"))

    cuda = a.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == a.tp * a.pp, f"world {world} != tp {a.tp} x pp {a.pp}"
    stage, tp_rank = rank // a.tp, rank % a.tp
    local = int(os.environ.get("LOCAL_RANK", rank))
    if cuda:
        torch.cuda.set_device(local)
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    dt = torch.bfloat16 if cuda else torch.float32
    # with one stage the TP group is the world group; --tp-new-group forces a separate group (same behaviour)
    tp_groups = [dist.new_group(list(range(s * a.tp, (s + 1) * a.tp))) for s in range(a.pp)] \
        if a.pp > 1 or a.tp_new_group else [None]
    tp_group = tp_groups[stage]
    prev_rank = rank - a.tp if stage > 0 else None
    next_rank = rank + a.tp if stage < a.pp - 1 else None

    torch.manual_seed(rank)
    H, HD = a.hidden, a.hidden // a.heads
    nh, ff = a.heads // a.tp, a.ffn // a.tp
    n_layers = a.layers // a.pp
    P = [dict(qkv=torch.randn(H, 3 * nh * HD, device=dev, dtype=dt) * 0.02,
              o=torch.randn(nh * HD, H, device=dev, dtype=dt) * 0.02,
              up=torch.randn(H, 2 * ff, device=dev, dtype=dt) * 0.02,
              down=torch.randn(ff, H, device=dev, dtype=dt) * 0.02,
              ln1=torch.ones(H, device=dev, dtype=dt), ln2=torch.ones(H, device=dev, dtype=dt))
         for _ in range(n_layers)]
    max_ctx = a.chunk * a.prefill_chunks

    def layer(x, p, kc, vc, pos, causal):
        B, T, _ = x.shape
        h = F.rms_norm(x, (H,), p["ln1"])
        q, k, v = (h @ p["qkv"]).view(B, T, 3, nh, HD).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        kc.index_copy_(2, pos, k)
        vc.index_copy_(2, pos, v)
        S = int(pos[-1]) + 1 if causal else kc.shape[2]
        o = F.scaled_dot_product_attention(q, kc[:, :, :S], vc[:, :, :S], is_causal=causal and S == T)
        o = o.transpose(1, 2).reshape(B, T, nh * HD) @ p["o"]
        if a.tp > 1:
            dist.all_reduce(o, group=tp_group)
        x = x + o
        h = F.rms_norm(x, (H,), p["ln2"])
        g, u = (h @ p["up"]).chunk(2, -1)
        m = (F.silu(g) * u) @ p["down"]
        if a.tp > 1:
            dist.all_reduce(m, group=tp_group)
        return x + m

    def stage_forward(x, caches, pos, causal):
        for i, p in enumerate(P):
            x = layer(x, p, caches[i][0], caches[i][1], pos, causal)
        return x

    pc = [(torch.zeros(1, nh, max_ctx, HD, device=dev, dtype=dt),
           torch.zeros(1, nh, max_ctx, HD, device=dev, dtype=dt)) for _ in range(n_layers)]
    B = a.decode_batch
    dc = [(torch.zeros(B, nh, 1024, HD, device=dev, dtype=dt),
           torch.zeros(B, nh, 1024, HD, device=dev, dtype=dt)) for _ in range(n_layers)]
    dpos = torch.tensor([700], device=dev)
    dx = torch.randn(B, 1, H, device=dev, dtype=dt)

    def recv_from_prev(shape):
        buf = torch.empty(shape, device=dev, dtype=dt)
        if prev_rank is not None:
            dist.recv(buf, src=prev_rank)
        return buf

    def send_to_next(x):
        if next_rank is not None:
            dist.send(x.contiguous(), dst=next_rank)

    step = [None]    # profiled step number (None: warm-up)

    def reps():
        n = step[0]
        if n is None:
            return 1
        step[0] += 1
        return a.slow_factor if stage == a.slow_stage and lo <= n < hi else 1

    def prefill_request(n_chunks, label_tokens):
        """Chunked prefill of one request through the pipeline (stage s works on chunk i while s+1 on i-1)."""
        for c in range(n_chunks):
            pos = torch.arange(c * a.chunk, (c + 1) * a.chunk, device=dev)
            with record_function(f"step[EXTEND bs=1 toks={label_tokens} chunk={c}]"):
                x = torch.randn(1, a.chunk, H, device=dev, dtype=dt) if prev_rank is None else \
                    recv_from_prev((1, a.chunk, H))
                for _ in range(reps()):
                    y = stage_forward(x, pc, pos, True)
                send_to_next(y)

    # decode: one CUDA graph per stage around its compute (send/recv stay outside the graph)
    graph = None
    static_in = dx.clone()
    if cuda and not a.no_graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                stage_forward(static_in, dc, dpos, False)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = stage_forward(static_in, dc, dpos, False)

    def decode_step(i, tag="DECODE"):
        with record_function(f"step[{tag} bs={B}]"):
            if prev_rank is not None:
                static_in.copy_(recv_from_prev((B, 1, H)))
            n = reps()
            if graph is not None:
                for _ in range(n):
                    graph.replay()
                y = static_out
            else:
                for _ in range(n):
                    y = stage_forward(static_in, dc, dpos, False)
            send_to_next(y)

    # warm-up outside the profiler
    prefill_request(1, a.chunk)
    decode_step(0)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.time()
    step[0] = 0
    with profile(activities=acts, record_shapes=True) as prof:
        prefill_request(a.prefill_chunks, a.chunk * a.prefill_chunks)
        for i in range(a.decode_steps):
            decode_step(i)
        for i in range(a.decode_steps):
            if i == a.decode_steps // 4:
                prefill_request(a.prefill_chunks, a.chunk * a.prefill_chunks)   # injected long prefill
            decode_step(i)
        if cuda:
            torch.cuda.synchronize()
    os.makedirs(a.out, exist_ok=True)
    ts = time.strftime("%Y%m%d%H%M%S", time.localtime(t0))
    name = f"{ts}-TP-{tp_rank}" + (f"-PP-{stage}" if a.pp > 1 else "") + ".trace.json.gz"
    prof.export_chrome_trace(os.path.join(a.out, name))
    if rank == 0:
        with open(os.path.join(a.out, "capture.json"), "w") as f:
            json.dump({"tp": a.tp, "pp": a.pp, "world": world, "layers": a.layers, "hidden": a.hidden,
                       "ffn": a.ffn, "chunk": a.chunk, "prefill_chunks": a.prefill_chunks,
                       "decode_batch": B, "decode_steps": a.decode_steps, "dtype": str(dt),
                       "torch": torch.__version__, "cuda_graph": graph is not None,
                       "slow": [a.slow_stage, a.slow_factor, lo, hi], "steps": step[0], "argv": sys.argv[1:]}, f, indent=1)
    if graph is not None and a.tp > 1:
        # Seen on 2 x H200 (torch 2.11, NCCL 2.28.9, 2026-11-29): with a CUDA graph that holds TP all-reduces,
        # the traces are written but process-group teardown never returns (with or without a new_group; an
        # eager run with the same groups exits in 17 s). Leave without the teardown once everything is on disk.
        torch.cuda.synchronize()
        os._exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
