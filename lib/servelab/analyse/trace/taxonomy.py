"""Kernel taxonomy: GPU op name → class (gemm, attention, moe, communication, norm_rope, quant, memory, other).

The rules are data (``servelab/data/kernel_classes.json``): an ordered list of (class, subclass, regex
[, Kineto category]); the first match wins. Users extend them by passing extra rules, which take
precedence. Communication is deliberately broader than ``nccl*`` (custom all-reduce, symmetric memory,
DeepEP, ...) because HTA / nsys recipes that match only "nccl" file inference-engine comm as compute.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Iterable, Sequence

import polars as pl

CLASSES = ("communication", "moe", "attention", "quant", "norm_rope", "gemm", "memory", "other")
COMPUTE_CLASSES = tuple(c for c in CLASSES if c not in ("communication", "memory"))
GPU_OP_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class Rule:
    """One classification rule: names matching ``pattern`` (re.search, case-insensitive) get ``cls``."""
    cls: str
    pattern: str
    subclass: str = ""
    cat: str | None = None

    def compiled(self) -> re.Pattern:
        return re.compile(self.pattern, re.IGNORECASE)


def default_rules() -> list[Rule]:
    """The shipped rules from ``servelab/data/kernel_classes.json``, in priority order."""
    text = resources.files("servelab").joinpath("data/kernel_classes.json").read_text()
    doc = json.loads(text)
    return [Rule(cls=r["class"], pattern=r["pattern"], subclass=r.get("subclass", r["class"]), cat=r.get("cat"))
            for r in doc["rules"]]


def _as_rule(r: Rule | Sequence[str] | dict) -> Rule:
    if isinstance(r, Rule):
        rule = r
    elif isinstance(r, dict):
        rule = Rule(cls=r["class"], pattern=r["pattern"], subclass=r.get("subclass", r["class"]), cat=r.get("cat"))
    elif len(r) == 2:
        rule = Rule(cls=r[0], pattern=r[1], subclass=r[0])
    elif len(r) == 3:
        rule = Rule(cls=r[0], subclass=r[1], pattern=r[2])
    else:
        raise ValueError(f"kernel rule {r!r}: expected (class, regex) or (class, subclass, regex)")
    try:
        rule.compiled()
    except re.error as e:
        raise ValueError(f"kernel rule for class '{rule.cls}': invalid regex {rule.pattern!r} ({e})") from e
    return rule


def load_rules(extra: Iterable[Rule | Sequence[str] | dict] | None = None) -> list[Rule]:
    """Extra rules (``(class, regex)``, ``(class, subclass, regex)``, dicts or :class:`Rule`) first, then the
    shipped ones. Classes outside :data:`CLASSES` are allowed (they show up as their own class)."""
    return [_as_rule(r) for r in (extra or [])] + default_rules()


def classify_names(names: Iterable[str], cats: Iterable[str] | None = None,
                   rules: list[Rule] | None = None) -> pl.DataFrame:
    """Classify distinct (name, cat) pairs. Returns columns ``name, cat, cls, subclass``; unmatched → other."""
    rules = rules if rules is not None else default_rules()
    compiled = [(r, r.compiled()) for r in rules]
    names = list(names)
    cats = list(cats) if cats is not None else ["kernel"] * len(names)
    out_cls, out_sub = [], []
    for n, c in zip(names, cats):
        cls, sub = "other", "other"
        for r, rx in compiled:
            if r.cat is not None and r.cat != c:
                continue
            if r.cat is None and c not in ("kernel", None):
                continue
            if rx.search(n or ""):
                cls, sub = r.cls, r.subclass
                break
        out_cls.append(cls)
        out_sub.append(sub)
    return pl.DataFrame({"name": names, "cat": cats, "cls": out_cls, "subclass": out_sub},
                        schema={"name": pl.String, "cat": pl.String, "cls": pl.String, "subclass": pl.String})


def classify_ops(ops: pl.DataFrame, rules: list[Rule] | None = None) -> pl.DataFrame:
    """Add ``cls`` and ``subclass`` to a frame of GPU ops (needs ``name`` and ``cat``); regexes run once per
    distinct name."""
    key_types = {c: ops.schema[c] for c in ("name", "cat")}
    distinct = ops.select("name", "cat").unique()
    table = classify_names(distinct["name"].cast(pl.String).to_list(), distinct["cat"].cast(pl.String).to_list(), rules)
    # join on the frame's own key types (categorical codes when the loader produced categoricals)
    table = table.with_columns(pl.col("name").cast(key_types["name"]), pl.col("cat").cast(key_types["cat"]))
    return (ops.join(table, on=["name", "cat"], how="left", nulls_equal=True)
            .with_columns(pl.col("cls").fill_null("other"), pl.col("subclass").fill_null("other")))


def short_name(name: str, width: int = 80) -> str:
    """A readable kernel name: C++ signature and ``void`` dropped, shortened to ``width`` characters."""
    s = name[5:] if name.startswith("void ") else name
    # a namespace in parentheses is part of the name, not its parameter list (at::native::(anonymous namespace)::f)
    s = s.replace("(anonymous namespace)", "anonymous_namespace")
    depth, cut = 0, len(s)
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0:
            cut = i
            break
    s = s[:cut]
    return s if len(s) <= width else s[: width - 1] + "…"
