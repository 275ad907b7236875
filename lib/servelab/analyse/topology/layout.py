"""Parallel layouts (SGLang's notation), the cluster they run on, what makes a layout impossible for a model, and
how each engine expresses a layout in its launch settings and commands (asked of the engine adapter)."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import pandas as pd

from servelab.analyse.topology.model import ModelConfig
from servelab.core.params import ParamError
from servelab.deploy.engines import engine_for
from servelab.deploy.spec import Target
from servelab.deploy.targets import target_from_dict


@dataclass(frozen=True)
class Layout:
    """A parallel layout in SGLang's terms (see the module docstring)."""
    tp: int
    pp: int = 1
    dp: int = 1
    ep: int = 1
    dp_attention: bool = False
    name: str = ""

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        parts = [f"TP{self.tp}"] + ([f"PP{self.pp}"] if self.pp > 1 else []) + \
                ([f"DP{self.dp}"] if self.dp > 1 else []) + ([f"EP{self.ep}"] if self.ep > 1 else [])
        return "+".join(parts)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * (1 if self.dp_attention else self.dp)

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp if self.dp_attention else self.tp

    @property
    def groups(self) -> int:
        """Attention groups (DP-attention groups or DP replicas) that split the requests."""
        return self.dp


def parse_layout(text: str) -> Layout:
    """``"TP16"``, ``"TP8+PP2"``, ``"TP16+DP2+EP16"`` (DP = attention DP inside the TP group), ``"TP8xPP2"``."""
    if isinstance(text, Layout):
        return text
    s = str(text).strip()
    parts = [p for p in re.split(r"[+X×,\s]+", s.upper()) if p]
    vals: dict[str, int] = {}
    for p in parts:
        m = re.fullmatch(r"(TP|PP|DP|EP)(\d+)", p)
        if not m:
            raise ParamError(f"layout '{text}': cannot read '{p}'; write e.g. TP16, TP8+PP2, TP16+DP2+EP16")
        if m.group(1) in vals:
            raise ParamError(f"layout '{text}': {m.group(1)} given twice")
        vals[m.group(1)] = int(m.group(2))
    if "TP" not in vals:
        raise ParamError(f"layout '{text}': needs a TP degree (TP1 for none)")
    return Layout(tp=vals["TP"], pp=vals.get("PP", 1), dp=vals.get("DP", 1), ep=vals.get("EP", 1),
                  dp_attention=vals.get("DP", 1) > 1, name=s)


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    gpus_per_node: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def cluster_from_target(target: Target, gpus_per_node: int = 0) -> Cluster:
    """Nodes × GPUs per node of a target (``gpus`` of its first node unless given). Reads the YAML only."""
    g = gpus_per_node or (target.nodes[0].gpus if target.nodes else 0)
    if g <= 0:
        raise ParamError(f"target '{target.name}' does not say how many GPUs its nodes have (nodes[].gpus); "
                         f"pass gpus_per_node")
    return Cluster(target.name, len(target.nodes) or 1, g)


def reference_layouts(cluster: Cluster) -> list[Layout]:
    """The three layouts of ``docs/method.md#topology`` for this cluster: TP over all GPUs, TP per node + PP over
    nodes, attention DP per node + EP over all GPUs."""
    g, n = cluster.gpus, cluster.nodes
    out = [Layout(tp=g, name=f"TP{g}")]
    if n > 1:
        out.append(Layout(tp=g // n, pp=n, name=f"TP{g // n}+PP{n}"))
        out.append(Layout(tp=g, dp=n, ep=g, dp_attention=True, name=f"TP{g}+DP{n}+EP{g}"))
    return out


def layout_problems(cfg: ModelConfig, lay: Layout, cluster: Cluster) -> list[str]:
    """Structural reasons a layout cannot run this model on this cluster (empty = none)."""
    p = []
    if min(lay.tp, lay.pp, lay.dp, lay.ep) < 1:
        p.append("degrees must be ≥ 1")
        return p
    if lay.gpus > cluster.gpus:
        p.append(f"needs {lay.gpus} GPUs, the cluster has {cluster.gpus}")
    if lay.dp_attention and lay.tp % lay.dp:
        p.append(f"DP attention needs tp ({lay.tp}) divisible by dp ({lay.dp})")
    if cfg.num_attention_heads % lay.attn_tp:
        p.append(f"{cfg.num_attention_heads} attention heads do not split over attention TP {lay.attn_tp}")
    if lay.ep > 1:
        if not cfg.is_moe:
            p.append("expert parallelism needs a MoE model")
        elif lay.tp % lay.ep:
            p.append(f"ep ({lay.ep}) must divide tp ({lay.tp})")
        elif cfg.n_routed_experts % lay.ep:
            p.append(f"{cfg.n_routed_experts} experts do not split over EP {lay.ep}")
    if lay.pp > cfg.num_hidden_layers:
        p.append(f"pp {lay.pp} > {cfg.num_hidden_layers} layers")
    return p


def pp_partition(num_layers: int, pp: int) -> list[range]:
    """Layer ranges per stage as vLLM/SGLang ``get_pp_indices``: equal split, remainder to the stages before the last."""
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    out, start = [], 0
    for s in sizes:
        out.append(range(start, start + s))
        start += s
    return out


def engine_launch_settings(lay: Layout, engine: str) -> dict[str, Any]:
    """The target ``launch:`` keys that express ``lay`` for ``engine`` (the engine adapter knows its notation)."""
    return engine_for(engine).layout_launch_settings(lay)


# ---------------------------------------------------------------- launch commands

def layout_target(base: Target, lay: Layout) -> Target:
    """A copy of ``base`` whose launch settings express ``lay`` (validated like any target file)."""
    raw = asdict(base)
    raw.pop("source", None)
    raw["launch"] = {**base.launch, **engine_launch_settings(lay, base.engine)}
    if raw["launch"].get("docker", {}).get("name"):
        raw["launch"]["docker"] = {**raw["launch"]["docker"],
                                   "name": re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{raw['launch']['docker']['name']}-{lay.label}")}
    raw["name"] = f"{base.name}-{re.sub(r'[^A-Za-z0-9]+', '', lay.label.lower())}"
    return target_from_dict(raw, f"{base.source or base.name} with layout {lay.label}")


def launch_commands(base: Target, layouts: Sequence[Layout]) -> pd.DataFrame:
    """One row per layout and node: the engine adapter's launch argv for that layout (never executed here)."""
    rows = []
    for lay in layouts:
        t = layout_target(base, lay)
        for plan in engine_for(t.engine).launch_plans(t, t.port or 30000):
            rows.append({"layout": lay.label, "node": plan.node, "argv": plan.argv, "env": plan.env,
                         "command": plan.shell()})
    return pd.DataFrame(rows, columns=["layout", "node", "argv", "env", "command"])
