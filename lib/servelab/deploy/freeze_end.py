"""The run-end freeze: the environment frozen again when the run's last phase has ended, compared with Phase 0's.

Phase 0 freezes every node before its engine starts (``manifest.json`` ``frozen.<node>``: image, engine and
version, commit, interpreter, every package, every model file's sha256) and again right after its own smoke start.
A run lasts longer than Phase 0: packages get upgraded, a driver gets reinstalled, weights get replaced while later
phases measure. :func:`freeze_end` takes the freeze once more — after every ``servelab run`` of a later phase, at
the end of ``servelab demo``, or by ``servelab freeze RUN_ID`` on an existing run — on every node of the run's
target, and the node's GPU driver (``nvidia-smi``) with it, and compares each item with Phase 0's record:

- ``frozen_end.<node>`` in the manifest: the summary at the end, with when it was taken;
- ``frozen_end_changes``: one row per changed item (``node``, ``kind`` — ``driver``, ``engine``, ``image``,
  ``weights`` or ``package`` —, ``what``, ``before``, ``after``), also in ``<run>/freeze_end.csv``.

The run index shows the rows per node; a change of kind driver, engine, image or weights marks every A/B the run
takes part in (:attr:`servelab.measure.abtest.ABResult.drift`): its numbers may come from two environments.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from servelab.core.run import now_iso, read_manifest, update_manifest
from servelab.deploy import hosts as hostlib
from servelab.deploy.engines import engine_for
from servelab.deploy.facts import FREEZE_COLUMNS, collect_facts, compare_freezes, engine_env, freeze_node, freeze_summary
from servelab.deploy.server import plan_launch
from servelab.deploy.spec import Target

def freeze_end(run_dir: Path, target: Target) -> pd.DataFrame:
    """Freeze every node of ``target`` now and compare with Phase 0's freeze of the run (nothing to compare, and
    nothing written, when Phase 0 did not freeze it); records the result in the manifest and ``freeze_end.csv``."""
    run_dir = Path(run_dir)
    m = read_manifest(run_dir)
    before = m.get("frozen") or {}
    if not before:
        return pd.DataFrame(columns=FREEZE_COLUMNS)
    adapter = engine_for(target.engine)
    plans, model_path = plan_launch(target)
    nodes = {n.name: hostlib.connect(n) for n in target.nodes}
    rows: list[dict[str, Any]] = []
    summaries: dict[str, Any] = {}
    try:
        for plan in plans:
            host = nodes[plan.node]
            f = freeze_node(host, engine_env(plan, adapter), adapter, model_path, "end",
                            raw_dir=run_dir / "freeze_end" / plan.node)
            summaries[plan.node] = {**freeze_summary(f), "taken": now_iso()}
            rows += compare_freezes(before.get(plan.node) or {}, summaries[plan.node], plan.node)
            facts = collect_facts(host, raw_dir=run_dir / "freeze_end" / plan.node / "facts")
            drv = facts[facts["fact"] == "gpu_driver"]["value"]
            was = ((m.get("hosts") or {}).get(plan.node) or {}).get("gpu_driver")
            now = str(drv.iloc[0]) if len(drv) else None
            summaries[plan.node]["gpu_driver"] = now
            if was is not None and now is not None and str(was) != now:
                rows.append({"node": plan.node, "kind": "driver", "what": "gpu_driver", "before": was, "after": now})
    finally:
        for h in nodes.values():
            h.close()
    out = pd.DataFrame(rows, columns=FREEZE_COLUMNS)
    out.to_csv(run_dir / "freeze_end.csv", index=False)
    update_manifest(run_dir, frozen_end=summaries, frozen_end_changes=out.to_dict("records"))
    return out
