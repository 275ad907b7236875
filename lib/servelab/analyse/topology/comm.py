"""Communication per step of each layout: the collectives (all-reduce, DP-attention gather/scatter, EP
all-to-all, PP send/recv), bytes one GPU sends, bytes leaving a node, and a cross-node time lower bound."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import pandas as pd

from servelab.analyse.topology.layout import Cluster, Layout, pp_partition
from servelab.analyse.topology.model import ModelConfig


@dataclass(frozen=True)
class CommInputs:
    tokens: int = 64                    # tokens in one step (decode: running requests; prefill: chunk size)
    act_bytes: float = 2.0              # bf16 activations
    dispatch_bytes: float = 1.0 + 4.0 / 128   # EP dispatch in fp8 with an fp32 scale per 128 (DeepEP)
    node_dedup: bool = False            # EP: a token crosses to a node once (DeepEP normal mode) vs once per expert
    internode_gbps_per_node: float = 800.0    # rails × line rate (reference cluster: 2 × 400G RoCE)


def _nodes_spanned(first_rank: int, size: int, gpn: int) -> int:
    return len({r // gpn for r in range(first_rank, first_rank + size)})


def comm_table(cfg: ModelConfig, lay: Layout, cluster: Cluster, comm: CommInputs) -> pd.DataFrame:
    """Collectives of one step (``comm.tokens`` tokens through every layer) for one layout.

    Columns: ``collective, group, group_size, spans_nodes, calls_per_step, message_bytes_per_token,
    message_bytes`` (one call), ``gpu_send_bytes_per_step`` (what one GPU sends), ``node_egress_bytes_per_step``
    (bytes leaving one node, the cross-node traffic).
    """
    H, T, gpn = cfg.hidden_size, comm.tokens, cluster.gpus_per_node
    rows: list[dict[str, Any]] = []
    tokens_group = T / max(lay.groups, 1)
    att_span = _nodes_spanned(0, lay.attn_tp, gpn)
    tp_span = _nodes_spanned(0, lay.tp, gpn)
    # a GPU runs the layers of its own pipeline stage: per-GPU counts come from the busiest stage
    stages = pp_partition(cfg.num_hidden_layers, lay.pp)
    attn_layers = max(len(s) for s in stages)
    dense_layers = max(sum(not cfg.layer_is_moe(i) for i in s) for s in stages)
    moe_layers = max(sum(cfg.layer_is_moe(i) for i in s) for s in stages)

    def ring(name: str, group: str, n: int, span: int, calls: int, per_token: float, tokens: float) -> None:
        if n <= 1 or calls == 0:
            return
        msg = per_token * tokens
        send = 2 * (n - 1) / n * msg
        rows.append({"collective": name, "group": group, "group_size": n, "spans_nodes": span,
                     "calls_per_step": calls, "message_bytes_per_token": per_token, "message_bytes": msg,
                     "gpu_send_bytes_per_step": send * calls,
                     "node_egress_bytes_per_step": (send if span > 1 else 0.0) * calls})

    ring("all-reduce (attention out)", f"attention TP{lay.attn_tp}", lay.attn_tp, att_span,
         attn_layers, H * comm.act_bytes, tokens_group)
    ffn_dp_gather = lay.dp_attention and lay.groups > 1
    ffn_name = "all-gather + reduce-scatter (DP attention ↔ TP FFN)" if ffn_dp_gather else "all-reduce (FFN out)"
    ring(ffn_name + " dense", f"TP{lay.tp}", lay.tp, tp_span, dense_layers, H * comm.act_bytes,
         T if ffn_dp_gather else tokens_group)
    if moe_layers:
        if lay.ep > 1:
            ep_span = _nodes_spanned(0, lay.ep, gpn)
            k = cfg.num_experts_per_tok
            remote = (lay.ep - 1) / lay.ep
            tokens_per_gpu = T / lay.ep
            if comm.node_dedup and ep_span > 1:
                cross_copies = (ep_span - 1) * (1 - (1 - 1 / ep_span) ** k)   # distinct remote nodes per token
            else:
                cross_copies = k * (ep_span - 1) / ep_span
            for name, per_copy in (("all-to-all dispatch (EP)", comm.dispatch_bytes), ("all-to-all combine (EP)",
                                                                                       comm.act_bytes)):
                send = tokens_per_gpu * k * remote * H * per_copy
                egress = (T / ep_span) * cross_copies * H * per_copy if ep_span > 1 else 0.0
                rows.append({"collective": name, "group": f"EP{lay.ep}", "group_size": lay.ep, "spans_nodes": ep_span,
                             "calls_per_step": moe_layers, "message_bytes_per_token": k * H * per_copy,
                             "message_bytes": tokens_per_gpu * k * H * per_copy,
                             "gpu_send_bytes_per_step": send * moe_layers,
                             "node_egress_bytes_per_step": egress * moe_layers})
        else:
            ring(ffn_name + " MoE", f"TP{lay.tp}", lay.tp, tp_span, moe_layers, H * comm.act_bytes,
                 T if ffn_dp_gather else tokens_group)
    if lay.pp > 1:
        per_token = 2 * H * comm.act_bytes           # hidden + residual
        msg = per_token * T
        stage_gpus = lay.tp
        boundary_cross = sum(1 for s in range(lay.pp - 1)
                             if ((s + 1) * stage_gpus - 1) // gpn != ((s + 1) * stage_gpus) // gpn)
        rows.append({"collective": "send/recv (PP stage boundary)", "group": f"PP{lay.pp}", "group_size": lay.pp,
                     "spans_nodes": _nodes_spanned(0, lay.gpus, gpn), "calls_per_step": lay.pp - 1,
                     "message_bytes_per_token": per_token, "message_bytes": msg,
                     "gpu_send_bytes_per_step": msg / stage_gpus * (lay.pp - 1),
                     "node_egress_bytes_per_step": msg if boundary_cross else 0.0})
    df = pd.DataFrame(rows, columns=["collective", "group", "group_size", "spans_nodes", "calls_per_step",
                                     "message_bytes_per_token", "message_bytes", "gpu_send_bytes_per_step",
                                     "node_egress_bytes_per_step"])
    df.insert(0, "layout", lay.label)
    return df


def comm_summary(tables: Sequence[pd.DataFrame], comm: CommInputs) -> pd.DataFrame:
    """Per layout: bytes one GPU sends per step, bytes leaving a node per step, and the cross-node time they
    need at the node's rail bandwidth (a lower bound from the model, never a measurement)."""
    rows = []
    for t in tables:
        if t.empty:
            continue
        egress = float(t["node_egress_bytes_per_step"].sum())
        rows.append({"layout": t["layout"].iloc[0], "tokens_per_step": comm.tokens,
                     "gpu_send_mib_per_step": t["gpu_send_bytes_per_step"].sum() / 2**20,
                     "cross_node_mib_per_step": egress / 2**20,
                     "cross_node_collectives_per_step": int(t.loc[t["node_egress_bytes_per_step"] > 0,
                                                                  "calls_per_step"].sum()),
                     "cross_node_ms_lower_bound": egress * 8 / (comm.internode_gbps_per_node * 1e9) * 1e3})
    return pd.DataFrame(rows)
