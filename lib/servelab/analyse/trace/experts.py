"""MoE expert-token counts from SGLang's expert-distribution recorder, and the imbalance they show (Q8).

SGLang (0.5.23, ``srt/eplb/expert_distribution.py``) dumps with ``torch.save`` into
``$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR`` when ``/dump_expert_distribution_record`` is called:

- mode ``stat`` / ``stat_approx``: one file from rank 0, ``expert_distribution_recorder_<time>.pt`` =
  ``{"rank": 0, "logical_count": int tensor [buffered passes, layers, logical experts],
  "average_utilization_rate_over_window": float | None}`` — the tokens routed to each expert in each recorded
  forward pass, already summed over ranks (an all-reduce); the buffer is circular (``--expert-distribution-
  recorder-buffer-size``, default 1000), so unused rows are zero and only the last N passes are kept;
- mode ``per_pass`` / ``per_token``: one file per rank, ``expert_distribution_recorder_<time>_<rank>.pt`` =
  ``{"records": [{"forward_pass_id", "rank", "gatherer_key", "global_physical_count": int tensor [layers,
  physical experts], ...}], "last_physical_to_logical_map": int tensor [layers, physical experts]}``.

"Tokens" here are token→expert assignments: with top-k routing each token counts once for each of its k experts.

The files are read **without torch** (the project venv has none) and without running pickle code: the zip's
``data.pkl`` is unpickled with a loader that knows only the few globals such a dump uses (tensor rebuild, the typed
storages, ``OrderedDict``) and refuses any other, and each tensor is rebuilt with numpy from its raw storage.
"""
from __future__ import annotations

import io
import json
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

DUMP_FILE = re.compile(r"^expert_distribution_recorder_\d+(?:\.\d+)?(?:_(?P<rank>\d+))?\.pt$")
HOT_FACTOR = 1.5          # an expert is "hot" when it took at least this many times the layer's mean
IMBALANCED_RATIO = 1.3    # Q8: a layer is imbalanced when max/mean tokens per expert reaches this (the same
#                           threshold the kernel-time proxy uses for max/mean per-rank MoE GEMM time)

_STORAGE_DTYPES = {
    "DoubleStorage": np.float64, "FloatStorage": np.float32, "HalfStorage": np.float16, "LongStorage": np.int64,
    "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class ExpertDumpError(ValueError):
    """A file that is not an expert-distribution dump SGLang writes; the message names the file and what is wrong."""


@dataclass(frozen=True)
class _Storage:
    dtype: Any
    key: str


def _rebuild_tensor(storage: np.ndarray, offset: int, size: tuple, stride: tuple, *_: Any) -> np.ndarray:
    if not size:
        return storage[offset].copy()
    item = storage.itemsize
    return np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * item for s in stride)).copy()


class _DumpUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, root: str, path: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.archive, self.root, self.path = archive, root, path
        self.storages: dict[str, np.ndarray] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "collections" and name == "OrderedDict":
            return dict
        raise ExpertDumpError(f"{self.path}: refers to {module}.{name}, which an expert-distribution dump never holds "
                              "(refused: only tensors, lists, dicts and numbers are read)")

    def persistent_load(self, pid: Any) -> np.ndarray:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise ExpertDumpError(f"{self.path}: unexpected persistent id {pid!r}")
        dtype, key = pid[1], str(pid[2])
        if not isinstance(dtype, type) or dtype not in _STORAGE_DTYPES.values():
            raise ExpertDumpError(f"{self.path}: storage of unknown type {dtype!r}")
        if key not in self.storages:
            try:
                raw = self.archive.read(f"{self.root}/data/{key}")
            except KeyError as e:
                raise ExpertDumpError(f"{self.path}: storage {key} missing from the archive") from e
            self.storages[key] = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
        return self.storages[key]


def read_torch_dump(path: str | Path) -> Any:
    """The object a ``torch.save`` (zip format) file holds, tensors as numpy arrays; only the globals an
    expert-distribution dump uses are allowed."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl")]
            if len(pkl) != 1:
                raise ExpertDumpError(f"{path}: not a torch.save zip archive (no single */data.pkl)")
            root = pkl[0][: -len("/data.pkl")]
            order = z.read(f"{root}/byteorder").decode().strip() if f"{root}/byteorder" in z.namelist() else "little"
            if order != "little":
                raise ExpertDumpError(f"{path}: byte order {order!r} (only little-endian dumps are read)")
            return _DumpUnpickler(z.read(pkl[0]), z, root, path).load()
    except zipfile.BadZipFile as e:
        raise ExpertDumpError(f"{path}: not a torch.save zip archive ({e})") from e
    except OSError as e:
        raise ExpertDumpError(f"{path}: cannot read ({e.strerror or e})") from e


@dataclass
class ExpertCounts:
    """Tokens routed to each (logical) expert of each MoE layer, summed over the recorded forward passes."""
    counts: np.ndarray                # int64 [layers, experts]
    passes: int                       # forward passes with any routed token
    mode: str                         # stat | per_pass
    ranks: list[int]
    files: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def layers(self) -> int:
        return int(self.counts.shape[0])

    @property
    def experts(self) -> int:
        return int(self.counts.shape[1])


def _counts_from(obj: Any, path: Path) -> tuple[np.ndarray, int, str, list[int], list[str]]:
    if not isinstance(obj, dict):
        raise ExpertDumpError(f"{path}: holds a {type(obj).__name__}, not the recorder's dict")
    if "logical_count" in obj:
        lc = np.asarray(obj["logical_count"])
        if lc.ndim != 3:
            raise ExpertDumpError(f"{path}: logical_count has shape {lc.shape}, expected [passes, layers, experts]")
        used = lc.reshape(lc.shape[0], -1).sum(axis=1) > 0
        notes = []
        if used.all() and lc.shape[0] > 1:
            notes.append(f"every one of the recorder's {lc.shape[0]} buffered passes was used: earlier passes of the "
                         "window may have been overwritten (raise --expert-distribution-recorder-buffer-size)")
        return lc.astype(np.int64).sum(axis=0), int(used.sum()), "stat", [int(obj.get("rank", 0))], notes
    if "records" in obj:
        recs = obj["records"]
        p2l = np.asarray(obj.get("last_physical_to_logical_map")) if obj.get("last_physical_to_logical_map") is not None \
            else None
        if not recs:
            raise ExpertDumpError(f"{path}: per-pass dump with no records (nothing ran while recording)")
        phys = np.stack([np.asarray(r["global_physical_count"]) for r in recs]).astype(np.int64)
        if p2l is None or p2l.shape != phys.shape[1:]:
            raise ExpertDumpError(f"{path}: per-pass dump without a physical→logical map matching {phys.shape[1:]}")
        n_logical = int(p2l.max()) + 1
        logical = np.zeros((phys.shape[1], n_logical), dtype=np.int64)
        for layer in range(phys.shape[1]):
            np.add.at(logical[layer], p2l[layer].astype(np.int64), phys[:, layer, :].sum(axis=0))
        used = phys.reshape(phys.shape[0], -1).sum(axis=1) > 0
        ranks = sorted({int(r.get("rank", 0)) for r in recs})
        return logical, int(used.sum()), "per_pass", ranks, []
    raise ExpertDumpError(f"{path}: neither 'logical_count' (mode stat) nor 'records' (per_pass/per_token) in the dump; "
                          f"keys {sorted(map(str, obj))}")


def read_expert_dump(paths: str | Path | list[str | Path]) -> ExpertCounts:
    """One or more dump files of one recording (per_pass/per_token: one per rank, summed) → :class:`ExpertCounts`.
    Raises :class:`ExpertDumpError` naming the file when one is not such a dump or their shapes disagree."""
    ps = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    if not ps:
        raise ExpertDumpError("no expert-distribution dump files given")
    total, passes, modes, ranks, notes = None, 0, set(), [], []
    for p in ps:
        c, n, mode, rk, nt = _counts_from(read_torch_dump(p), p)
        if total is not None and c.shape != total.shape:
            raise ExpertDumpError(f"{p}: counts of shape {c.shape}, the other files {total.shape}")
        total = c if total is None else total + c
        passes = max(passes, n)
        modes.add(mode)
        ranks += rk
        notes += nt
    if len(modes) > 1:
        raise ExpertDumpError(f"dumps of different recorder modes mixed: {sorted(modes)}")
    return ExpertCounts(total, passes, modes.pop(), sorted(set(ranks)), [str(p) for p in ps], notes)


def find_expert_dumps(folder: str | Path) -> list[Path]:
    """The recorder's dump files anywhere under ``folder`` (a capture's ``profiles/<node>/expert-distribution/``),
    newest recording first: files of one stat dump, or every rank's file of one per-pass dump."""
    found = sorted((p for p in Path(folder).rglob("*.pt") if DUMP_FILE.match(p.name)), key=lambda p: p.name)
    if not found:
        return []
    stamp = lambda p: p.name.split("_")[3].removesuffix(".pt")    # noqa: E731 - the time SGLang put in the name
    per_rank = [p for p in found if DUMP_FILE.match(p.name)["rank"] is not None]
    if per_rank:
        last = max(float(stamp(p)) for p in per_rank)
        # one dump call writes every rank's file within moments of each other
        return [p for p in per_rank if last - float(stamp(p)) < 60]
    return [max(found, key=lambda p: float(stamp(p)))]


def expert_imbalance(ec: ExpertCounts) -> pl.DataFrame:
    """Per MoE layer: tokens (assignments), experts, max / mean / min tokens per expert, the imbalance ratio
    max/mean, idle experts (0 tokens) and the hot experts (≥ ``HOT_FACTOR`` × mean, hottest first, with counts)."""
    rows = []
    for layer in range(ec.layers):
        c = ec.counts[layer]
        total = int(c.sum())
        mean = total / len(c) if len(c) else 0.0
        order = np.argsort(-c, kind="stable")
        hot = [int(e) for e in order if mean and c[e] >= HOT_FACTOR * mean]
        rows.append({"layer": layer, "tokens": total, "experts": int(len(c)), "max_tokens": int(c.max()),
                     "mean_tokens": mean, "min_tokens": int(c.min()),
                     "imbalance": (float(c.max()) / mean) if mean else None, "idle_experts": int((c == 0).sum()),
                     "hot_experts": ", ".join(f"{e} ({int(c[e])})" for e in hot),
                     "top_share_pct": 100.0 * float(c.max()) / total if total else None})
    return pl.DataFrame(rows, schema={"layer": pl.Int64, "tokens": pl.Int64, "experts": pl.Int64,
                                      "max_tokens": pl.Int64, "mean_tokens": pl.Float64, "min_tokens": pl.Int64,
                                      "imbalance": pl.Float64, "idle_experts": pl.Int64, "hot_experts": pl.String,
                                      "top_share_pct": pl.Float64})


def capture_expert_counts(trace_dir: str | Path) -> ExpertCounts | None:
    """The expert counts recorded with a capture: the newest dump under ``trace_dir`` or under the case folder's
    ``expert-distribution/`` beside it (``measure.expert_record``); None when there is none."""
    folder = Path(trace_dir)
    for where in (folder, folder.parent / "expert-distribution"):
        if where.is_dir():
            found = find_expert_dumps(where)
            if found:
                ec = read_expert_dump(found)
                rec = where / "expert_record.json"
                if rec.exists():
                    r = json.loads(rec.read_text())
                    ec.notes.append(f"recorded from {r.get('started')} (just before /start_profile) to "
                                    f"{r.get('stopped')} (once the profiler's trace was written): the recorder counts "
                                    "every forward pass in between, a wider window than the traced steps")
                return ec
    return None
