"""Trace analysis: Kineto per-rank traces → columnar frames → timeline metrics, cross-rank alignment,
NCCL forensics, the ten timeline questions and the evidence → action table (``docs/method.md#phase3``).

    from servelab.analyse.trace import analyse, ten_questions, evidence_actions
    a = analyse("path/to/capture")          # a folder of per-rank *.trace.json.gz (SGLang / vLLM)
    a.summary, a.top_kernels, a.gap_summary, a.nccl, a.step_skew ...

Modules: decode (one file's events → frame), chunked (parse a file, big ones in parallel worker processes),
identity (which rank a file is), load (Parquet cache, a capture folder's ranks), taxonomy (kernel classes),
windows (step windows), ops (per-rank GPU op table), metrics, exposed_comm (exposed communication per step
window), ranks (alignment, skew, PP), nccl (forensics), nsys (Nsight Systems), questions, actions, figures,
analysis (compose). The Phase 3 notebook calls
``servelab.phases.phase3_timeline``.
"""
from importlib import import_module

# names resolved on first use (PEP 562): a trace-parsing worker process imports ``chunked`` (and ``decode``) alone,
# without the analysis modules (0.2 s less to start each worker)
_EXPORTS = {"evidence_actions": "actions", "CaptureAnalysis": "analysis", "analyse": "analysis",
            "write_tables": "analysis", "Capture": "load", "RankIdentity": "identity", "RankTrace": "load",
            "TraceFormatError": "decode", "identity_from_name": "identity", "load_capture": "load", "load_trace": "load",
            "parse_trace": "chunked", "ten_questions": "questions", "CLASSES": "taxonomy", "Rule": "taxonomy",
            "classify_names": "taxonomy", "load_rules": "taxonomy"}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)


__all__ = ["analyse", "CaptureAnalysis", "write_tables", "evidence_actions", "ten_questions", "load_trace",
           "load_capture", "parse_trace", "Capture", "RankTrace", "RankIdentity", "TraceFormatError",
           "identity_from_name", "CLASSES", "Rule", "classify_names", "load_rules"]
