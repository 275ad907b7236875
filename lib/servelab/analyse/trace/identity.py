"""Which rank a trace file is: rank, node, role and capture from its name (each engine's naming, asked of its
adapter), completed by the ``distributedInfo`` the trace carries.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from servelab.deploy.engines import trace_identity
from servelab.deploy.engines.base import name_rank_tokens

TRACE_SUFFIXES = (".json", ".json.gz")


@dataclass
class RankIdentity:
    """Who wrote a trace file. ``rank`` is the global torch rank (``distributedInfo.rank`` when present)."""
    file: str
    role: str = "rank"                  # rank | frontend | merged
    rank: int | None = None
    world_size: int | None = None
    tp: int | None = None
    dp: int | None = None
    pp: int | None = None
    ep: int | None = None
    stage: str | None = None            # SGLang profile_by_stage suffix (prefill/decode) or forward mode
    profile_id: str | None = None
    node: str = "node0"
    engine: str | None = None           # the engine whose naming rules the file follows, or None
    source: str = ""                    # which evidence gave rank/tp/pp

    @property
    def label(self) -> str:
        parts = [f"rank{self.rank}" if self.rank is not None else Path(self.file).name]
        for k in ("tp", "dp", "pp", "ep"):
            v = getattr(self, k)
            if v is not None:
                parts.append(f"{k.upper()}{v}")
        return " ".join(parts)


def identity_from_name(path: str | Path) -> RankIdentity:
    """Rank identity from a file name.

    Names an engine writes follow its adapter's rules (``EngineAdapter.trace_identity``): SGLang
    ``[prefix-]{profile_id}-TP-{tp}[-DP-{dp}][-PP-{pp}][-EP-{ep}][-{stage}].trace.json.gz``; vLLM (torch
    ``tensorboard_trace_handler``) ``{worker_name}.{time_ns}.pt.trace.json.gz`` whose worker name holds ``rank0`` /
    ``dp0_pp0_tp0``, and the API-server process's ``async_llm`` trace (role frontend). Other names: the
    ``rank``/``tp``/``pp``/``dp``/``ep`` tokens they hold, and the timestamp of a torch ``.pt.trace`` name.
    """
    name = Path(path).name
    ident = RankIdentity(file=str(path))
    fields = trace_identity(name)
    if fields is not None:
        for key, val in fields.items():
            setattr(ident, key, val)
        return ident
    stem = name.split(".pt.trace")[0] if ".pt.trace" in name else name.split(".json")[0]
    for key, val in name_rank_tokens(stem).items():
        setattr(ident, key, val)
    if ".pt.trace" in name:
        parts = name.split(".")
        if len(parts) > 2 and parts[1].isdigit():
            ident.profile_id = parts[1]
    if ident.rank is not None or ident.tp is not None:
        ident.source = "filename"
    return ident


def _apply_distributed_info(ident: RankIdentity, info: dict | None) -> RankIdentity:
    if not info:
        return ident
    r, w = info.get("rank"), info.get("world_size")
    if isinstance(r, int):
        ident.rank = r
        ident.source = "+".join(s for s in (ident.source, "distributedInfo") if s)
    if isinstance(w, int):
        ident.world_size = w
    return ident
