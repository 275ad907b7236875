"""Targets: where a phase runs (engine, model, launch settings, nodes), read from ``params/targets/*.yaml``.

A target is validated as a whole when it is read, the engine's launch settings by the engine's own adapter,
so a typo in a target file fails before anything starts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any
from servelab.core.redact import known_secrets




@dataclass
class Node:
    """One machine of a target. ``kind`` is ``local`` or ``ssh``."""
    name: str
    kind: str = "local"
    role: str = "head"               # head | worker
    host: str = "127.0.0.1"
    port: int = 22
    user: str = ""
    key_file: str = ""
    known_hosts: str = ""            # default: ~/.ssh/known_hosts + ~/.config/servelab/known_hosts
    accept_new_host_key: bool = False  # explicit opt-in: the key is saved, then verified; recorded in the manifest
    gpus: int = 0
    netdevs: list[str] = field(default_factory=list)
    hcas: list[str] = field(default_factory=list)
    workdir: str = ""                # the node's private per-run folders go under it (default: its $TMPDIR)
    state_dir: str = ""              # pid records of what servelab started there (default: ~/.cache/servelab)


@dataclass
class Target:
    """Where a phase runs: the engine, its model, its launch settings and its nodes."""
    name: str
    engine: str                       # llamacpp | sglang | vllm
    model: str                        # model key (gemma3-270m, tiny) or a path on the nodes
    description: str = ""
    served_model_name: str = ""
    api_host: str = "127.0.0.1"       # address the client uses to reach the head node's server
    port: int = 0                     # 0 = pick a free port (local targets)
    launch: dict[str, Any] = field(default_factory=dict)   # engine settings, see engines/*
    env: dict[str, str] = field(default_factory=dict)      # passed to the engine processes (NCCL_*...)
    nodes: list[Node] = field(default_factory=list)
    gate: dict[str, Any] = field(default_factory=dict)     # transport gate (Phase 5); empty = none
    preflight: dict[str, Any] = field(default_factory=dict)
    scale: str = "local"              # case length scale: local | cluster
    api_key_env: str = ""             # name of the variable holding the head's API key (never the key itself)
    # attach: a server already running (Kubernetes, Slurm, a team's scripts); servelab starts and stops nothing
    endpoint: str = ""                # http(s)://host:port of the running server; set = attached, no launch
    metrics_path: str = ""            # its Prometheus page (default: the engine's), "none" when it has none
    profile: dict[str, Any] = field(default_factory=dict)   # attached profiler: {trace_dir: path as the nodes see it}
    source: str = ""                  # the file it was read from
    nodes_given: bool = True          # False: an attached target without nodes (no node facts, no collectors)

    def secret_values(self) -> tuple[str, ...]:
        """The secrets this target carries — values of its secret-named ``env`` variables, of secret flags in its
        launch arguments (``extra_args``, ``docker.extra_args``), credentials in URLs among them — for the literal
        scrub of everything written (:func:`servelab.core.redact.known_secrets`; process environment included)."""
        docker = self.launch.get("docker") if isinstance(self.launch.get("docker"), dict) else {}
        argv = [*(self.launch.get("extra_args") or []), *(docker.get("extra_args") or [])]
        return known_secrets(self.env, {k: v for k, v in self.launch.items() if isinstance(v, (str, int, float))},
                             argv=argv, urls=[*self.env.values(), *map(str, argv), self.description])

    @property
    def head(self) -> Node:
        heads = [n for n in self.nodes if n.role == "head"]
        return heads[0] if heads else self.nodes[0]

    def api_key(self) -> str:
        """The head's API key, read from this process's environment (``api_key_env``); "" when none is set up.
        A named variable that is unset or empty is an error, before anything starts."""
        if not self.api_key_env:
            return ""
        key = os.environ.get(self.api_key_env, "")
        if not key.strip() or "\n" in key:
            raise ValueError(f"target {self.name}: api_key_env names {self.api_key_env}, which is not set (or empty) "
                             f"here; export {self.api_key_env}=<the key> before running")
        return key.strip()

    @property
    def attached(self) -> bool:
        """A server already running at ``endpoint``: servelab starts and stops nothing there."""
        return bool(self.endpoint)

    @property
    def is_local(self) -> bool:
        return all(n.kind == "local" for n in self.nodes)
