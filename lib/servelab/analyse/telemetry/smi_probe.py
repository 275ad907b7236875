"""Record the Phase 2 nvidia-smi query loop for a while and summarise it (a shell one-liner entry).

    PYTHONPATH=lib python3 -m servelab.analyse.telemetry.smi_probe --seconds 20 --interval 0.2 --out /tmp/smi

writes ``<out>/telemetry/local/nvidia_smi.csv`` (raw, exactly the ``collectors.SMI_FIELDS`` list),
``nvidia-smi.status.json`` and ``clock.json`` next to it, and — when pandas is importable —
``<out>/smi_summary.csv`` (per GPU and metric: samples, mean, P95, max), which it also prints.
Collection itself needs only the standard library, so it runs on a bare GPU machine; parse the raw
file later with ``servelab.analyse.telemetry.parse_smi`` where pandas is installed. Exit status: 0 ok,
1 the collector died early, 2 it could not start (nvidia-smi missing or no GPU).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from servelab.measure.telemetry.collectors import nvidia_smi
from servelab.measure.telemetry.runner import NodePlan, RequiredCollectorError, start_telemetry
from servelab.deploy.hosts import LocalHost


def probe(out: Path, seconds: float, interval_s: float) -> tuple[int, str]:
    """Run the collector for ``seconds``; return (exit status, text to print)."""
    case_dir = Path(out)
    try:
        session = start_telemetry(case_dir, [NodePlan(LocalHost(), [nvidia_smi(interval_s, required=True)],
                                                      node="local")], grace_s=0.5)
    except RequiredCollectorError as exc:
        return 2, str(exc)
    t0 = time.time_ns()
    time.sleep(seconds)
    t1 = time.time_ns()
    result = session.stop()
    code = 0 if result.ok else 1
    note = "" if result.ok else "\n" + "; ".join(result.failures)
    try:
        from servelab.analyse.telemetry.frames import nan_to_dash
        from servelab.analyse.telemetry.load import load_case_telemetry
        from servelab.analyse.telemetry.summary import summarize_by_device
        from servelab.analyse.telemetry.windows import CaseWindow
    except ImportError as exc:
        raw = case_dir / "telemetry" / "local" / "nvidia_smi.csv"
        return code, f"raw samples in {raw} ({raw.stat().st_size} bytes); no summary here: {exc}{note}"
    case = load_case_telemetry(case_dir, "smi_probe", CaseWindow("smi_probe", t0, t1))
    table = summarize_by_device(case, sorted(set(case.samples.metric)))
    table.to_csv(case_dir / "smi_summary.csv", index=False)
    return code, nan_to_dash(table).to_string(index=False) + note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=1.0, help="sampling interval in seconds (≥ 0.1)")
    ap.add_argument("--out", type=Path, default=Path("smi_probe"))
    a = ap.parse_args(argv)
    code, text = probe(a.out, a.seconds, a.interval)
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
