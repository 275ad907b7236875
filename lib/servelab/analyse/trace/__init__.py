"""Trace analysis: Kineto per-rank traces → columnar frames → timeline metrics, cross-rank alignment,
NCCL forensics, the ten timeline questions and the evidence → action table (``docs/method.md#phase3``).

    from servelab.analyse.trace import analyse, ten_questions, evidence_actions
    a = analyse("path/to/capture")          # a folder of per-rank *.trace.json.gz (SGLang / vLLM)
    a.summary, a.top_kernels, a.gap_summary, a.nccl, a.step_skew ...

Modules: load (parse + Parquet cache + rank identity), taxonomy (kernel classes), windows (step windows),
ops (per-rank GPU op table), metrics, ranks (alignment, skew, PP), nccl (forensics), nsys (Nsight Systems),
questions, actions, figures, analysis (compose). The Phase 3 notebook calls ``servelab.phases.phase3_timeline``.
"""
from servelab.analyse.trace.actions import evidence_actions
from servelab.analyse.trace.analysis import CaptureAnalysis, analyse, write_tables
from servelab.analyse.trace.load import (Capture, RankIdentity, RankTrace, TraceFormatError, identity_from_name, load_capture,
                                 load_trace, parse_trace)
from servelab.analyse.trace.questions import ten_questions
from servelab.analyse.trace.taxonomy import CLASSES, Rule, classify_names, load_rules

__all__ = ["analyse", "CaptureAnalysis", "write_tables", "evidence_actions", "ten_questions", "load_trace",
           "load_capture", "parse_trace", "Capture", "RankTrace", "RankIdentity", "TraceFormatError",
           "identity_from_name", "CLASSES", "Rule", "classify_names", "load_rules"]
