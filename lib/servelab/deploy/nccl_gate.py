"""The transport gate (``docs/method.md#transport-gate``): before a benchmark, prove from every rank's NCCL INFO log that the
required HCAs carry the inter-node channels with ``NET/IB`` + ``GDRDMA``; otherwise refuse to start
and say what was found, rank by rank.

Gate config (a target's ``gate:`` mapping; empty = no gate, as for the local target)::

    gate:
      required_hcas: [mlx5_0, mlx5_3]   # every host must use each of these on NET/IB channels
      require: [NET/IB, GDRDMA]         # every NET channel is NET/IB; every NET/IB channel has /GDRDMA
      expected_ranks: 16                # optional: INFO lines must exist for ranks 0..15

Rules, all of which must hold: every expected rank printed INFO lines; at least one NET channel
exists (a single-node run has none and cannot prove anything about the rails); no NET channel uses
another transport than NET/IB; every NET/IB channel says GDRDMA; on each host the NET/IB channels
together use every required HCA (HCA names come from the ``NET/IB : Using [i]<hca>:<port>`` line).

Enforced at every engine start of a target that declares a gate (``servelab.deploy.start_checks``): the engine
starts with :data:`GATE_ENV` added to its environment, and once it is healthy :func:`gate_from_folder` judges the
rank logs collected from every node — the same function that judges any folder of rank logs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.deploy.nccl_info import NcclInfo, parse_info, parse_info_files, transport_table
from servelab.core.params import did_you_mean

GATE_KEYS = {"required_hcas", "require", "expected_ranks"}
# what a gated engine starts with: INIT names the ranks (ncclCommInitRank), NET the transports and HCAs
GATE_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
RANK_LOG_GLOB = "*.log"
KNOWN_REQUIREMENTS = {"NET/IB", "GDRDMA"}


@dataclass
class GateVerdict:
    """``passed`` is True only when a configured gate's rules all hold (or no gate is configured)."""
    configured: bool
    passed: bool
    message: str
    reasons: list[str] = field(default_factory=list)
    per_rank: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def verdict(self) -> str:
        return "no gate configured" if not self.configured else ("PASS" if self.passed else "REFUSED")


class GateRefused(RuntimeError):
    """Raised by ``enforce_gate``: the benchmark must not start."""

    def __init__(self, verdict: GateVerdict):
        super().__init__(verdict.message)
        self.verdict = verdict


def validate_gate(gate: dict | None) -> dict:
    """Check a gate mapping's keys and values (clear error naming the key) and normalise it."""
    gate = dict(gate or {})
    unknown = set(gate) - GATE_KEYS
    if unknown:
        k = sorted(unknown)[0]
        raise ValueError(f"unknown gate key '{k}'{did_you_mean(k, GATE_KEYS)}; known: {', '.join(sorted(GATE_KEYS))}")
    for key in ("require", "required_hcas"):
        v = gate.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise ValueError(f"gate '{key}' must be a list of names, got {v!r}")
    er = gate.get("expected_ranks")
    if er is not None and (isinstance(er, bool) or not isinstance(er, int) or er < 1):
        raise ValueError(f"gate 'expected_ranks' must be a whole number of ranks ≥ 1, got {er!r}")
    req = [str(x) for x in gate.get("require") or []]
    bad = [r for r in req if r not in KNOWN_REQUIREMENTS]
    if bad:
        raise ValueError(f"gate 'require' has unknown transport '{bad[0]}'; known: {', '.join(sorted(KNOWN_REQUIREMENTS))}")
    hcas = [str(x) for x in gate.get("required_hcas") or []]
    if hcas and "NET/IB" not in req:
        req.append("NET/IB")
    out = {"require": req, "required_hcas": hcas}
    if gate.get("expected_ranks") is not None:
        out["expected_ranks"] = int(gate["expected_ranks"])
    return out


def _describe(info: NcclInfo, table: pd.DataFrame) -> list[str]:
    lines = []
    for r in table.itertuples():
        net = (f"{r.net_connections} NET ({r.gdrdma_connections} with GDRDMA) on {r.hcas or 'no named HCA'}"
               if r.net_connections else "no NET channel")
        lines.append(f"rank {r.rank} ({r.host}, cudaDev {r.cuda_dev}): {r.transports}; {net}; "
                     f"network module {r.network or 'not reported'}")
    return lines


def check_gate(gate: dict | None, info: NcclInfo) -> GateVerdict:
    """Judge the INFO log of every rank (already parsed into one ``NcclInfo``) against a gate."""
    cfg = validate_gate(gate)
    table = transport_table(info)
    if not cfg["require"] and not cfg["required_hcas"] and "expected_ranks" not in cfg:
        return GateVerdict(False, True, "no gate configured for this target: transports are reported, not enforced",
                           [], table)
    reasons: list[str] = []
    ch = info.channels
    seen = set(table["rank"]) if not table.empty else set()
    expected = cfg.get("expected_ranks") or (int(info.ranks.nranks.max()) if not info.ranks.empty else None)
    if not seen:
        reasons.append("no rank printed NCCL INFO lines (was NCCL_DEBUG=INFO set for every rank?)"
                       + (f": {info.reason}" if info.reason else ""))
    elif expected:
        missing = sorted(set(range(expected)) - seen)
        if missing:
            reasons.append(f"no INFO lines for rank(s) {', '.join(map(str, missing[:16]))} of {expected}")
    net = ch[ch.transport.str.startswith("NET")] if not ch.empty else ch
    if "NET/IB" in cfg["require"]:
        if net.empty:
            found = ", ".join(f"{k} ×{v}" for k, v in ch.groupby("transport").size().items()) if not ch.empty else "none"
            extra = f"; NCCL said: {' / '.join(info.notes)}" if info.notes else ""
            nets = sorted(set(info.network.values()))
            extra += f"; network module loaded: {', '.join(nets)}" if nets else ""
            reasons.append(f"no NET channel in any rank (only {found}): a single-node run or a disabled network "
                           f"cannot prove the inter-node rails{extra}")
        else:
            other = net[net.transport != "NET/IB"]
            if not other.empty:
                ranks = sorted(other["rank"].unique())
                reasons.append(f"{len(other)} NET channel(s) use {', '.join(sorted(other.transport.unique()))} instead of "
                               f"NET/IB (ranks {', '.join(map(str, ranks[:16]))})")
    ib = net[net.transport == "NET/IB"] if not net.empty else net
    if "GDRDMA" in cfg["require"] and not ib.empty:
        nogdr = ib[~ib.gdrdma]
        if not nogdr.empty:
            ranks = sorted(nogdr["rank"].unique())
            reasons.append(f"{len(nogdr)} of {len(ib)} NET/IB channel(s) lack GDRDMA (staged through host memory) "
                           f"on ranks {', '.join(map(str, ranks[:16]))}")
    if cfg["required_hcas"] and not ib.empty:
        unnamed = ib[ib.hca.isna()]
        if not unnamed.empty:
            reasons.append("cannot name the HCA of some NET/IB channels: no 'NET/IB : Using [i]<hca>:<port>' line "
                           f"for {', '.join(sorted(set(unnamed.host)))}")
        for host, g in ib.groupby("host"):
            used = set(g.hca.dropna())
            lacking = [h for h in cfg["required_hcas"] if h not in used]
            if lacking:
                reasons.append(f"host {host} uses {', '.join(sorted(used)) or 'no named HCA'} on NET/IB, "
                               f"missing required {', '.join(lacking)}")
    found = _describe(info, table)
    want = " + ".join(cfg["require"]) + (f" on {', '.join(cfg['required_hcas'])}" if cfg["required_hcas"] else "")
    if reasons:
        msg = (f"REFUSED — the gate requires {want}. " + " ".join(f"[{i + 1}] {r}." for i, r in enumerate(reasons))
               + " Found: " + " | ".join(found or ["nothing"]))
        return GateVerdict(True, False, msg, reasons, table)
    hosts = sorted(set(ib.host)) if not ib.empty else []
    msg = (f"PASS — {want} proven for {len(seen)} rank(s) on {len(hosts)} host(s): "
           f"{len(ib)} NET/IB channel connections, all with GDRDMA" if "GDRDMA" in cfg["require"] else
           f"PASS — {want} proven for {len(seen)} rank(s) on {len(hosts)} host(s)")
    return GateVerdict(True, True, msg, [], table)


def enforce_gate(gate: dict | None, info: NcclInfo) -> GateVerdict:
    """``check_gate`` that raises ``GateRefused`` (fail-closed) instead of returning a refusal."""
    v = check_gate(gate, info)
    if not v.passed:
        raise GateRefused(v)
    return v


def verdict_table(v: GateVerdict) -> pd.DataFrame:
    """The verdict as a small table for the page: verdict, message, then one reason per row."""
    rows = [{"item": "verdict", "value": v.verdict}, {"item": "message", "value": v.message}]
    rows += [{"item": f"reason {i + 1}", "value": r} for i, r in enumerate(v.reasons)]
    return pd.DataFrame(rows)


def gate_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with what the gate needs to read: ``NCCL_DEBUG=INFO`` (overriding a quieter level) and the ``INIT``
    and ``NET`` subsystems added to any ``NCCL_DEBUG_SUBSYS`` already set (``ALL`` is kept as it is)."""
    out = dict(env)
    out["NCCL_DEBUG"] = GATE_ENV["NCCL_DEBUG"]
    have = [s.strip() for s in out.get("NCCL_DEBUG_SUBSYS", "").split(",") if s.strip()]
    if "ALL" not in (s.upper() for s in have):
        want = GATE_ENV["NCCL_DEBUG_SUBSYS"].split(",")
        have = [s for s in have if not s.startswith("^")] + [w for w in want if w not in (h.upper() for h in have)]
        out["NCCL_DEBUG_SUBSYS"] = ",".join(have)
    return out


def with_gate_env(target: Any) -> Any:
    """The target unchanged when it declares no gate; else a copy whose engine environment carries
    :func:`gate_env`, so every rank prints the INFO lines the gate reads."""
    if not target.gate:
        return target
    return dataclasses.replace(target, env=gate_env(target.env))


def gate_from_folder(gate: dict | None, folder: str | Path) -> GateVerdict:
    """Judge every rank log in ``folder`` (``*.log``, one per node as the server keeps them, or one per rank)
    against ``gate``. An empty folder is judged as an empty log: a configured gate refuses it."""
    paths = sorted(Path(folder).glob(RANK_LOG_GLOB))
    info = parse_info_files(paths) if paths else parse_info("", source=str(folder))
    return check_gate(gate, info)
