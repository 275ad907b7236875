"""Phase 0's freeze, before and after, as the page's tables: per node the frozen items (engine, commit, image, driver,
weights) before vs after with what changed, the engine's packages, the model files' checksums, the GPU / container /
network state, and every change in one table (:func:`changes_table`); the freeze as the manifest records it."""
from __future__ import annotations

from typing import Any, Protocol

import pandas as pd

from servelab.deploy.facts import NodeFreeze, freeze_summary, weights_fingerprint


class FrozenRun(Protocol):
    """What the tables read of a Phase 0 result: the freeze per node before and after, and the facts taken at
    both moments."""
    frozen_before: dict[str, NodeFreeze]
    frozen_after: dict[str, NodeFreeze]
    facts: pd.DataFrame
    facts_after: pd.DataFrame



STATE_FACTS = ("gpu_query", "gpu_list", "gpu_driver", "gpu_topology", "nccl_library", "containers", "docker",
               "rdma_devices", "netdevs", "addresses")


def _changed(a: Any, b: Any) -> str:
    return "same" if str(a) == str(b) else "CHANGED"


def _freeze_items(f: NodeFreeze) -> dict[str, str]:
    e, w = f.engine, f.weights
    eng = " ".join(x for x in (e.get("distribution") or e.get("name", ""), e.get("version", "")) if x)
    items = {}
    if f.image is not None:
        items["image"] = str(f.image.get("name") or "-")
        items["image id"] = str(f.image.get("id") or "not on the node")
        items["image digest"] = ", ".join(f.image.get("digests") or []) or "-"
    items.update({
        "engine": eng or "-",
        "engine commit": e.get("commit") or "-",
        "commit from": e.get("commit_source") or "-",
        "runs as": f"Python {e['python']} {e.get('executable', '')}" if e.get("python") else
                   (e.get("executable") or "-"),
        **({"executable sha256": e["executable_sha256"]} if e.get("executable_sha256") else {}),
        "packages": f"{len(f.packages)} distributions" if len(f.packages) else "-",
        "model files": f"{len(w)} files, {f.weights_bytes / 2**20:,.1f} MiB" if len(w) else "-",
        "weights sha256": weights_fingerprint(w) or "-",
    })
    return items


def freeze_table(result: FrozenRun) -> pd.DataFrame:
    """Per node: image, image id, engine, its commit (and where it comes from), interpreter, package count, model
    files and one sha256 over every model file — before the engine started and after it stopped."""
    rows = []
    for node, before in result.frozen_before.items():
        after = result.frozen_after.get(node)
        b, a = _freeze_items(before), _freeze_items(after) if after is not None else {}
        for item, v in b.items():
            rows.append({"node": node, "item": item, "before": v, "after": a.get(item, "not taken"),
                         "changed": _changed(v, a.get(item, "not taken")) if after is not None else "-"})
    return pd.DataFrame(rows, columns=["node", "item", "before", "after", "changed"])


def packages_table(result: FrozenRun) -> pd.DataFrame:
    """Every Python distribution the engine's interpreter sees, one row per package, a version column per node
    before and after, where it was installed from; changed rows first."""
    frames = []
    for node, before in result.frozen_before.items():
        for moment, f in (("before", before), ("after", result.frozen_after.get(node))):
            if f is None or f.packages.empty:
                continue
            frames.append(f.packages.assign(col=f"{node} {moment}"))
    if not frames:
        return pd.DataFrame({"note": ["no Python packages read: a compiled engine, or its interpreter could not be "
                                      "run (see the notes under the freeze table)"]})
    allp = pd.concat(frames, ignore_index=True)
    wide = allp.pivot_table(index="package", columns="col", values="version", aggfunc="first").reset_index()
    cols = [c for c in dict.fromkeys(allp["col"]) if c in wide.columns]
    src = allp.drop_duplicates("package").set_index("package")
    wide["installed from"] = wide["package"].map(src["installed_from"])
    wide["commit"] = wide["package"].map(src["commit"]).replace("", "-")
    wide["changed"] = wide[cols].astype(str).nunique(axis=1).map(lambda n: "same" if n <= 1 else "CHANGED")
    wide = wide[["package", *cols, "installed from", "commit", "changed"]].fillna("absent")
    wide.columns.name = None
    wide = wide.assign(_same=wide["changed"].eq("same"), _name=wide["package"].str.lower())
    out = wide.sort_values(["_same", "_name"]).drop(columns=["_same", "_name"]).reset_index(drop=True)
    out.attrs["max_rows"] = len(out)          # the page lists every package (the method asks for all of them)
    return out


def weights_table(result: FrozenRun) -> pd.DataFrame:
    """Every model file per node: size, sha256 before and after, how long hashing it took and how the after value
    was obtained (hashed again, or unchanged size/mtime/ctime/inode since it was hashed)."""
    rows = []
    for node, before in result.frozen_before.items():
        after = result.frozen_after.get(node)
        amap = {r.file: r for r in after.weights.itertuples()} if after is not None and len(after.weights) else {}
        for r in before.weights.itertuples():
            a = amap.get(r.file)
            rows.append({"node": node, "file": r.file, "size (MiB)": r.bytes / 2**20, "sha256 before": r.sha256,
                         "hashed in (s)": r.seconds, "sha256 after": a.sha256 if a is not None else "absent",
                         "after": a.how if a is not None else "file gone",
                         "changed": _changed(r.sha256, a.sha256) if a is not None else "CHANGED"})
        for f, a in amap.items():
            if f not in set(before.weights["file"]):
                rows.append({"node": node, "file": f, "size (MiB)": a.bytes / 2**20, "sha256 before": "absent",
                             "hashed in (s)": None, "sha256 after": a.sha256, "after": "new file",
                             "changed": "CHANGED"})
    if not rows:
        notes = [n for f in result.frozen_before.values() for n in (f.notes or []) if "checksum" in n]
        return pd.DataFrame({"note": notes or ["no model file was hashed"]})
    out = pd.DataFrame(rows)
    out.attrs["max_rows"] = len(out)          # every model file's checksum on the page
    return out


def state_table(result: FrozenRun) -> pd.DataFrame:
    """GPU, container and network state per node (the facts of :data:`STATE_FACTS`) before the engine started and
    after it stopped."""
    if result.facts_after.empty:
        return pd.DataFrame(columns=["node", "fact", "before", "after", "changed"])
    key = ["node", "fact"]
    b = result.facts[result.facts["fact"].isin(STATE_FACTS)].set_index(key)
    a = result.facts_after[result.facts_after["fact"].isin(STATE_FACTS)].set_index(key)
    rows = []
    for k in b.index:
        bv = b.loc[k, "value"] if b.loc[k, "status"] == "ok" else b.loc[k, "status"]
        av = (a.loc[k, "value"] if a.loc[k, "status"] == "ok" else a.loc[k, "status"]) if k in a.index else "not taken"
        rows.append({"node": k[0], "group": b.loc[k, "group"], "fact": k[1], "before": bv, "after": av,
                     "changed": _changed(bv, av)})
    return pd.DataFrame(rows, columns=["node", "group", "fact", "before", "after", "changed"])


def changes_table(result: FrozenRun) -> pd.DataFrame:
    """Everything that differs between before and after: frozen items, packages and model files (``frozen``: each
    is a failure of the freeze) and GPU, container and network state (``state``: shown, judged by the reader)."""
    rows = []
    ft = freeze_table(result)
    for r in ft[ft["changed"] == "CHANGED"].itertuples():
        rows.append({"kind": "frozen", "node": r.node, "what": r.item, "before": r.before, "after": r.after})
    pt = packages_table(result)
    if "changed" in pt.columns:
        for _, r in pt[pt["changed"] == "CHANGED"].iterrows():
            for node in result.frozen_before:
                if f"{node} before" in r and str(r[f"{node} before"]) != str(r.get(f"{node} after")):
                    rows.append({"kind": "frozen", "node": node, "what": f"package {r['package']}",
                                 "before": r[f"{node} before"], "after": r.get(f"{node} after", "absent")})
    wt = weights_table(result)
    if "changed" in wt.columns:
        for _, r in wt[wt["changed"] == "CHANGED"].iterrows():
            rows.append({"kind": "frozen", "node": r["node"], "what": f"model file {r['file']}",
                         "before": r["sha256 before"], "after": r["sha256 after"]})
    st = state_table(result)
    for r in st[st["changed"] == "CHANGED"].itertuples():
        rows.append({"kind": "state", "node": r.node, "what": r.fact, "before": r.before, "after": r.after})
    return pd.DataFrame(rows, columns=["kind", "node", "what", "before", "after"])


def frozen_manifest(frozen: dict[str, NodeFreeze]) -> dict[str, Any]:
    """What the manifest keeps of the freeze (taken before the engine started), per node: image and image id,
    engine, commit, interpreter, every package's version and every model file's sha256 — the keys the A/B guard
    (:func:`servelab.measure.abtest.diff_manifests`) compares between runs."""
    return {node: freeze_summary(f) for node, f in frozen.items()}


def freeze_notes(result: FrozenRun) -> list[str]:
    """What the freeze could not read, per node and moment, in sentences."""
    return [f"{f.node} ({f.moment}): {n}" for fr in (result.frozen_before, result.frozen_after)
            for f in fr.values() for n in (f.notes or [])]
