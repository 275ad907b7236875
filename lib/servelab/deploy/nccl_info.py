"""``NCCL_DEBUG=INFO`` logs → version, ranks, transports per channel, HCAs, GPU Direct RDMA, algorithm
and protocol choices, ``NCCL_*`` settings.

Line prefix: ``<host>:<pid>:<tid> [<cudaDev>] NCCL INFO <message>`` (NVIDIA/nccl ``src/debug.cc``).
Messages used (format strings in NVIDIA/nccl):

- ``NCCL version 2.28.9+cuda13.0``
- ``ncclCommInitRank[Config] comm <p> rank <r> nranks <n> cudaDev <d> [nvmlDev <d>] busId <b> [commId <c>]
  - Init START|COMPLETE`` → which (host, pid, device) is which rank;
- ``Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA`` (``src/transport/net.cc``),
  ``… via P2P/CUMEM/read``, ``P2P/IPC``, ``P2P/direct pointer``, ``SHM/direct/direct``, ``NET/Socket/0``
  (older: ``Ring 00 : 15 -> 0 [send] via NET/Socket/0``);
- ``NET/IB : Using [0]mlx5_0:1/RoCE [1]mlx5_3:1/RoCE [RO]; OOB eth0:…`` → NET/IB device index → HCA;
  ``NET/IB : No device found.``; ``NET/Socket : Using [0]eth0:…``; ``Using network IB|Socket``;
- ``NET/IB : GPU Direct RDMA Enabled for HCA 0 'mlx5_0'`` (or ``Disabled``);
- TUNING: ``AllReduce: 8192 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..0}`` (``src/enqueue.cc``);
- ``NCCL_IB_HCA set by environment to mlx5_0,mlx5_3``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

# Any hostname (``10-90-43-152``, ``gpu-node.cluster.local``, a redacted ``<node>``); the line may sit behind a
# launcher's tag (``[1,0]<stdout>:``, ``[0] ``, ``0: ``), so the prefix is searched for, not anchored.
HOST = r"[^\s:\[\]]+"
PREFIX_RE = re.compile(rf"(?P<host>{HOST}):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] NCCL "
                       r"(?P<level>INFO|WARN|TRACE|ABORT) (?P<msg>.*)$")
VERSION_RE = re.compile(r"NCCL version (?P<v>\S+)")
BARE_VERSION_RE = re.compile(r"(?:^|[\s:>\]])NCCL version (?P<v>\d\S*)")     # older NCCL prints it unprefixed
INIT_RE = re.compile(r"comm (?P<comm>0x[0-9a-fA-F]+) rank (?P<rank>\d+) nranks (?P<nranks>\d+) cudaDev (?P<cdev>\d+)"
                     r"(?: nvmlDev (?P<nvml>\d+))? busId (?P<bus>\w+)(?: commId (?P<commid>0x[0-9a-fA-F]+))?"
                     r"(?: localSize \d+)? - Init (?P<phase>START|COMPLETE)")
NNODES_RE = re.compile(r"comm 0x[0-9a-fA-F]+ rank (?P<rank>\d+) nRanks (?P<nranks>\d+) nNodes (?P<nnodes>\d+)")
CHANNEL_RE = re.compile(r"^(?:Channel|Ring) (?P<ch>\d+)(?:/(?P<sub>\d+))? : (?P<src>\d+)(?:\[(?P<sdev>[\w]+)\])? -> "
                        r"(?P<dst>\d+)(?:\[(?P<ddev>[\w]+)\])?(?: \[(?P<dir>send|receive)\])? via (?P<via>.+?)\s*$")
IB_USING_RE = re.compile(r"^NET/IB : Using (?P<list>.*?)(?:; OOB (?P<oob>\S+))?$")
IB_DEV_RE = re.compile(r"\[(?P<idx>\d+)\](?P<name>[\w.\-]+):(?P<port>\d+)/(?P<link>\w+)")
SOCK_USING_RE = re.compile(r"^NET/Socket : Using (?P<list>.*)$")
SOCK_DEV_RE = re.compile(r"\[(?P<idx>\d+)\](?P<name>[\w.\-]+):")
GDR_RE = re.compile(r"GPU Direct RDMA (?P<state>Enabled|Disabled) for HCA (?P<idx>\d+) '(?P<name>[^']+)'")
NETWORK_RE = re.compile(r"^Using network (?P<net>\S+)")
TUNING_RE = re.compile(r"^(?P<coll>[A-Za-z]+): (?P<bytes>\d+) Bytes -> Algo (?P<algo>\w+) proto (?P<proto>\w+)"
                       r"(?: channel\{Lo\.\.Hi\}=\{(?P<lo>\d+)\.\.(?P<hi>\d+)\}| nchannels (?P<nch>\d+))?")
ENV_RE = re.compile(r"^(?P<key>NCCL_\w+) set (?:by environment )?to (?P<val>.*)$")


def classify_transport(via: str) -> tuple[str, bool, int | None]:
    """``'NET/IB/0/GDRDMA'`` → (``'NET/IB'``, gdrdma=True, net device 0); ``'P2P/CUMEM/read'`` → (``'P2P/CUMEM'``…)."""
    parts = via.split("/")
    head = parts[0]
    gdr = "GDRDMA" in parts
    if head == "NET":
        kind = f"NET/{parts[1]}" if len(parts) > 1 else "NET"
        if kind.startswith("NET/IBext"):          # the IB plugin (nccl-rdma-sharp-plugins: ``NET/IBext_v8/7``)
            kind = "NET/IB"
        dev = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
        return kind, gdr, dev
    if head == "P2P":
        sub = parts[1] if len(parts) > 1 else ""
        sub = "direct" if sub.startswith("direct") else sub.split()[0] if sub else ""
        return (f"P2P/{sub}" if sub else "P2P"), False, None
    return head.split()[0], gdr, None


@dataclass
class NcclInfo:
    """What an NCCL INFO log says. Frames are empty when the log lacks those lines."""
    version: str
    ranks: pd.DataFrame          # host, pid, cuda_dev, rank, nranks, bus_id, comm, complete
    channels: pd.DataFrame       # host, pid, cuda_dev, rank, channel, src, dst, direction, via, transport, gdrdma, net_dev, hca
    net_devices: pd.DataFrame    # host, pid, kind (IB|Socket), index, name, port, link
    gdr: pd.DataFrame            # host, pid, hca, enabled
    tuning: pd.DataFrame         # coll, bytes, algo, proto, ch_lo, ch_hi, calls
    network: dict[str, str]      # "host:pid" → network module used (IB, Socket, plugin)
    env: dict[str, str]
    nnodes: int | None
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    lines: int = 0
    source: str = ""
    scanned: int = 0

    @property
    def reason(self) -> str:
        """Empty when the log told something; else one line saying why it yielded nothing."""
        if not self.ranks.empty or not self.channels.empty:
            return ""
        if self.scanned == 0:
            return "NCCL INFO log: the input is empty"
        if self.lines == 0:
            return (f"NCCL INFO log: none of {self.scanned} line(s) has the '<host>:<pid>:<tid> [<dev>] NCCL INFO' "
                    "prefix (was NCCL_DEBUG=INFO set?)")
        return (f"NCCL INFO log: {self.lines} NCCL line(s) but no ncclCommInitRank and no 'Channel … via …' line "
                "(set NCCL_DEBUG_SUBSYS to include INIT, or keep the log from communicator set-up)")


def parse_info(text: str, source: str = "") -> NcclInfo:
    """Parse one or many ranks' INFO output (one file per rank, or one process with several GPUs)."""
    version = ""
    ranks, channels, netdevs, gdr, tuning = [], [], [], [], []
    network, env, notes, warns = {}, {}, [], []
    nnodes = None
    n = 0
    for raw in text.splitlines():
        m = PREFIX_RE.search(raw)
        if not m:
            if not version and (bv := BARE_VERSION_RE.search(raw)):
                version = bv["v"]
            continue
        n += 1
        host, pid, dev, msg = m["host"], int(m["pid"]), int(m["dev"]), m["msg"].strip()
        if m["level"] == "WARN":
            warns.append(f"{host}:{pid} [{dev}] {msg}")
            continue
        if (v := VERSION_RE.match(msg)) and not version:
            version = v["v"]
        elif im := INIT_RE.search(msg):
            ranks.append({"host": host, "pid": pid, "cuda_dev": int(im["cdev"]), "rank": int(im["rank"]),
                          "nranks": int(im["nranks"]), "bus_id": im["bus"], "comm": im["commid"] or im["comm"],
                          "complete": im["phase"] == "COMPLETE"})
        elif nm := NNODES_RE.match(msg):
            nnodes = max(nnodes or 0, int(nm["nnodes"]))
        elif cm := CHANNEL_RE.match(msg):
            kind, is_gdr, ndev = classify_transport(cm["via"])
            channels.append({"host": host, "pid": pid, "cuda_dev": dev, "channel": int(cm["ch"]),
                             "src": int(cm["src"]), "dst": int(cm["dst"]), "direction": cm["dir"] or "",
                             "via": cm["via"], "transport": kind, "gdrdma": is_gdr, "net_dev": ndev})
        elif um := IB_USING_RE.match(msg):
            for d in IB_DEV_RE.finditer(um["list"]):
                netdevs.append({"host": host, "pid": pid, "kind": "IB", "index": int(d["idx"]), "name": d["name"],
                                "port": int(d["port"]), "link": d["link"]})
        elif sm := SOCK_USING_RE.match(msg):
            for d in SOCK_DEV_RE.finditer(sm["list"]):
                netdevs.append({"host": host, "pid": pid, "kind": "Socket", "index": int(d["idx"]), "name": d["name"],
                                "port": 0, "link": "Socket"})
        elif gm := GDR_RE.search(msg):
            gdr.append({"host": host, "pid": pid, "hca": gm["name"], "enabled": gm["state"] == "Enabled",
                        "transport": "NET/IB" if msg.startswith("NET/IB") else msg.split(" :")[0]})
        elif wm := NETWORK_RE.match(msg):
            network[f"{host}:{pid}"] = wm["net"]
        elif tm := TUNING_RE.match(msg):
            tuning.append({"coll": tm["coll"], "bytes": int(tm["bytes"]), "algo": tm["algo"], "proto": tm["proto"],
                           "ch_lo": int(tm["lo"]) if tm["lo"] else None,
                           "ch_hi": int(tm["hi"]) if tm["hi"] else (int(tm["nch"]) - 1 if tm["nch"] else None)})
        elif em := ENV_RE.match(msg):
            env[em["key"]] = em["val"].strip()
        elif msg.startswith("NET/IB : No device found") or msg.startswith("Failed to initialize NET plugin") or \
                msg.startswith("NET/Plugin") and "Could not find" in msg:
            notes.append(msg)
    rk = pd.DataFrame(ranks, columns=["host", "pid", "cuda_dev", "rank", "nranks", "bus_id", "comm", "complete"])
    if not rk.empty:
        rk = rk.sort_values("complete").drop_duplicates(["host", "pid", "cuda_dev", "comm"], keep="last")
        rk = rk.sort_values("rank").reset_index(drop=True)
    ch = pd.DataFrame(channels, columns=["host", "pid", "cuda_dev", "channel", "src", "dst", "direction", "via",
                                         "transport", "gdrdma", "net_dev"])
    nd = pd.DataFrame(netdevs, columns=["host", "pid", "kind", "index", "name", "port", "link"]).drop_duplicates()
    ch = _attribute(ch, rk, nd)
    if rk.empty and not ch.empty:
        notes.append("no ncclCommInitRank lines: each channel is attributed to the rank at its own end "
                     "(sender of [send] lines, receiver of [receive] lines) and each process to the rank it printed most")
    tu = pd.DataFrame(tuning, columns=["coll", "bytes", "algo", "proto", "ch_lo", "ch_hi"])
    if not tu.empty:
        tu = tu.groupby(["coll", "bytes", "algo", "proto", "ch_lo", "ch_hi"], dropna=False).size() \
            .rename("calls").reset_index().sort_values(["coll", "bytes"]).reset_index(drop=True)
    return NcclInfo(version, rk, ch, nd.reset_index(drop=True),
                    pd.DataFrame(gdr, columns=["host", "pid", "hca", "enabled", "transport"]).drop_duplicates(),
                    tu, network, env, nnodes, list(dict.fromkeys(notes)), warns, n, source,
                    sum(1 for line in text.splitlines() if line.strip()))


def _attribute(ch: pd.DataFrame, ranks: pd.DataFrame, netdevs: pd.DataFrame) -> pd.DataFrame:
    """Add the printing rank (from the Init lines, else the channel's own endpoint) and the HCA name."""
    if ch.empty:
        return ch.assign(rank=pd.Series(dtype="int64"), hca=pd.Series(dtype=object))
    key = {}
    for r in ranks.itertuples():
        key.setdefault((r.host, r.pid, r.cuda_dev), r.rank)
    own = [key.get((h, p, d)) for h, p, d in zip(ch.host, ch.pid, ch.cuda_dev)]
    fallback = ch["dst"].where(ch["direction"] == "receive", ch["src"])
    if not key:     # no Init lines: a process+device is the rank its channel lines name most often at their own end
        votes = pd.DataFrame({"h": ch.host, "p": ch.pid, "d": ch.cuda_dev, "r": fallback})
        best = votes.groupby(["h", "p", "d"])["r"].agg(lambda r: r.value_counts().index[0])
        own = [best.get((h, p, d)) for h, p, d in zip(ch.host, ch.pid, ch.cuda_dev)]
    ch = ch.assign(rank=[int(o) if o is not None else int(f) for o, f in zip(own, fallback)])
    ib = {(r.host, r.pid, r.index): r.name for r in netdevs[netdevs.kind == "IB"].itertuples()} if not netdevs.empty else {}
    sock = {(r.host, r.pid, r.index): r.name for r in netdevs[netdevs.kind == "Socket"].itertuples()} \
        if not netdevs.empty else {}
    hca = []
    for t, h, p, d in zip(ch.transport, ch.host, ch.pid, ch.net_dev):
        if d is None or d != d:
            hca.append(None)
        else:
            table = ib if t == "NET/IB" else sock
            hca.append(table.get((h, p, int(d))))
    return ch.assign(hca=hca)


def parse_info_files(paths: list[Path]) -> NcclInfo:
    """Parse several per-rank INFO files as one log (their lines are only concatenated)."""
    texts = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise FileNotFoundError(f"NCCL INFO log not found: {p}")
        texts.append(p.read_text(errors="replace"))
    return parse_info("\n".join(texts), source=", ".join(str(p) for p in paths))


def transport_table(info: NcclInfo) -> pd.DataFrame:
    """One row per rank: host, device, the transports its channels use (with connection counts),
    HCAs, GDRDMA share of its NET connections, and the network module it loaded."""
    cols = ["rank", "host", "cuda_dev", "transports", "net_connections", "gdrdma_connections", "hcas", "network"]
    if info.channels.empty and info.ranks.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    ranks = info.ranks if not info.ranks.empty else info.channels[["host", "pid", "cuda_dev", "rank"]].drop_duplicates()
    for r in ranks.itertuples():
        c = info.channels[info.channels["rank"] == r.rank] if not info.channels.empty else info.channels
        counts = c.groupby("transport").size().sort_values(ascending=False) if not c.empty else pd.Series(dtype=int)
        net = c[c.transport.str.startswith("NET")] if not c.empty else c
        rows.append({"rank": r.rank, "host": r.host, "cuda_dev": r.cuda_dev,
                     "transports": ", ".join(f"{k} ×{v}" for k, v in counts.items()) or "none",
                     "net_connections": len(net), "gdrdma_connections": int(net.gdrdma.sum()) if len(net) else 0,
                     "hcas": ", ".join(sorted({h for h in net.hca if h})) if len(net) else "",
                     "network": info.network.get(f"{r.host}:{r.pid}", "")})
    return pd.DataFrame(rows, columns=cols)
