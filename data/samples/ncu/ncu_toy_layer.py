# Small reproduction for Phase 6: one transformer layer of the H200 toy (data/samples/h200x2/tp_toy.py,
# rank-local shapes of its TP=2 run: hidden 4096, 16 heads x 128, FFN 7168) in bf16 on one GPU, random weights.
# Warm-up first; only the profiled layer runs between cudaProfilerStart/Stop, so `ncu --profile-from-start off`
# captures exactly one prefill layer (4096 tokens) and one decode layer (batch 32, 1024 cached tokens).
import sys

import torch
import torch.nn.functional as F

H, NH, HD, FF = 4096, 16, 128, 7168
dev, dt = torch.device("cuda"), torch.bfloat16
torch.manual_seed(0)
P = dict(qkv=torch.randn(H, 3 * NH * HD, device=dev, dtype=dt) * 0.02, o=torch.randn(NH * HD, H, device=dev, dtype=dt) * 0.02,
         up=torch.randn(H, 2 * FF, device=dev, dtype=dt) * 0.02, down=torch.randn(FF, H, device=dev, dtype=dt) * 0.02,
         ln1=torch.ones(H, device=dev, dtype=dt), ln2=torch.ones(H, device=dev, dtype=dt))


def layer(x, kc, vc, pos, causal):
    B, T, _ = x.shape
    h = F.rms_norm(x, (H,), P["ln1"])
    q, k, v = (h @ P["qkv"]).view(B, T, 3, NH, HD).unbind(2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    S = kc.shape[2] if not causal else T
    o = F.scaled_dot_product_attention(q, kc[:, :, :S], vc[:, :, :S], is_causal=causal)
    x = x + o.transpose(1, 2).reshape(B, T, NH * HD) @ P["o"]
    h = F.rms_norm(x, (H,), P["ln2"])
    g, u = (h @ P["up"]).chunk(2, -1)
    return x + (F.silu(g) * u) @ P["down"]


pk = torch.zeros(1, NH, 4096, HD, device=dev, dtype=dt)
pv = torch.zeros_like(pk)
dk = torch.zeros(32, NH, 1024, HD, device=dev, dtype=dt)
dv = torch.zeros_like(dk)
xp = torch.randn(1, 4096, H, device=dev, dtype=dt)
xd = torch.randn(32, 1, H, device=dev, dtype=dt)
ppos, dpos = torch.arange(4096, device=dev), torch.tensor([700], device=dev)
for _ in range(3):
    layer(xp, pk, pv, ppos, True)
    layer(xd, dk, dv, dpos, False)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
with torch.no_grad():
    layer(xp, pk, pv, ppos, True)
    layer(xd, dk, dv, dpos, False)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("toy layer done", torch.cuda.get_device_name(), file=sys.stderr)
