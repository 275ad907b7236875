"""Engine adapters: llama.cpp (the embedded default), SGLang and vLLM (production engines).

Everything that differs between engines is a method or attribute of an adapter; the helpers below ask
every adapter in turn for what a file name says (the engine that wrote it is not known up front).
"""
from __future__ import annotations

from typing import Any

from servelab.deploy.engines.base import EngineAdapter, LaunchPlan, ProfileError, ProfileRequest
from servelab.deploy.engines.llamacpp import LlamaCppAdapter
from servelab.deploy.engines.sglang import SGLangAdapter
from servelab.deploy.engines.vllm import VLLMAdapter
from servelab.core.params import ParamError, did_you_mean

ADAPTERS: dict[str, type[EngineAdapter]] = {"llamacpp": LlamaCppAdapter, "sglang": SGLangAdapter,
                                            "vllm": VLLMAdapter}


def engine_for(name: str) -> EngineAdapter:
    if name not in ADAPTERS:
        raise ParamError(f"unknown engine '{name}'{did_you_mean(name, set(ADAPTERS))}")
    return ADAPTERS[name]()


def all_engines() -> list[EngineAdapter]:
    return [cls() for cls in ADAPTERS.values()]


def profile_file(file_name: str) -> dict[str, Any]:
    """What a file in a profiler folder is, by the first engine whose naming rules it follows
    (``EngineAdapter.profile_file``); ``{"kind": "other"}`` when none does."""
    for engine in all_engines():
        out = engine.profile_file(file_name)
        if out is not None:
            return out
    return {"kind": "other"}


def trace_identity(file_name: str) -> dict[str, Any] | None:
    """The rank identity a trace file name carries by the first engine whose naming rules it follows
    (``EngineAdapter.trace_identity``); None when it follows none."""
    for engine in all_engines():
        out = engine.trace_identity(file_name)
        if out is not None:
            return out
    return None


def trace_name_hints() -> tuple[str, ...]:
    """Every engine's regexes that mark a file name as a trace."""
    return tuple(h for e in all_engines() for h in e.trace_name_hints)


def trace_skip_dirs() -> tuple[str, ...]:
    """Every engine's trace sub-folders that hold no serving-step traces."""
    return tuple(d for e in all_engines() for d in e.trace_skip_dirs)


__all__ = ["EngineAdapter", "LaunchPlan", "ProfileError", "ProfileRequest", "engine_for", "all_engines", "ADAPTERS",
           "profile_file", "trace_identity", "trace_name_hints", "trace_skip_dirs"]
