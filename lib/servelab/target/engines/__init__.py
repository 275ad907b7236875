"""Engine adapters: llama.cpp (the embedded default), SGLang and vLLM (production engines)."""
from __future__ import annotations

from servelab.target.engines.base import EngineAdapter, LaunchPlan
from servelab.target.engines.llamacpp import LlamaCppAdapter
from servelab.target.engines.sglang import SGLangAdapter
from servelab.target.engines.vllm import VLLMAdapter
from servelab.core.params import ParamError, did_you_mean

ADAPTERS: dict[str, type[EngineAdapter]] = {"llamacpp": LlamaCppAdapter, "sglang": SGLangAdapter,
                                            "vllm": VLLMAdapter}


def engine_for(name: str) -> EngineAdapter:
    if name not in ADAPTERS:
        raise ParamError(f"unknown engine '{name}'{did_you_mean(name, set(ADAPTERS))}")
    return ADAPTERS[name]()


__all__ = ["EngineAdapter", "LaunchPlan", "engine_for", "ADAPTERS"]
