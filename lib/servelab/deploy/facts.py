"""Phase 0 facts: what exactly is running on each node, asked with real commands.

Each probe is an argv list run on a host. A probe whose program is absent is ``not present`` (a CPU
host has no nvidia-smi; that is a fact, not a failure). Raw outputs are kept next to the table.
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from gguf import GGUFReader

from servelab.core.run import redact_env, redact_text


@dataclass(frozen=True)
class Probe:
    fact: str
    argv: tuple[str, ...]
    group: str          # system | gpu | network | software | engine
    summarize: str = "first_line"   # first_line | all | lines:N | regex:<pattern>


PROBES: tuple[Probe, ...] = (
    Probe("hostname", ("hostname",), "system"),
    Probe("kernel", ("uname", "-srm"), "system"),
    Probe("os", ("sh", "-c", ". /etc/os-release && echo \"$PRETTY_NAME\""), "system"),
    Probe("cpu_model", ("sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"), "system"),
    Probe("cpu_count", ("nproc",), "system"),
    Probe("numa", ("sh", "-c", "ls -d /sys/devices/system/node/node* 2>/dev/null | wc -l"), "system"),
    Probe("memory_total", ("sh", "-c", "grep MemTotal /proc/meminfo"), "system"),
    Probe("python", ("python3", "--version"), "software"),
    Probe("gpu_list", ("nvidia-smi", "-L"), "gpu", "all"),
    Probe("gpu_driver", ("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"), "gpu"),
    Probe("gpu_query", ("nvidia-smi", "--query-gpu=index,name,memory.total,memory.used,utilization.gpu,"
                        "clocks.sm,clocks.mem,power.limit,pstate,pci.bus_id", "--format=csv,noheader"), "gpu", "all"),
    Probe("cuda_version", ("sh", "-c", "nvidia-smi | grep -o 'CUDA Version: [0-9.]*'"), "gpu"),
    Probe("nvcc", ("nvcc", "--version"), "gpu", "regex:release ([0-9.]+)"),
    Probe("gpu_topology", ("nvidia-smi", "topo", "-m"), "gpu", "all"),
    Probe("nccl_library", ("sh", "-c", "ldconfig -p | grep -m3 libnccl"), "gpu", "all"),
    Probe("dcgm", ("dcgmi", "--version"), "gpu"),
    Probe("rdma_devices", ("sh", "-c", "ls /sys/class/infiniband 2>/dev/null"), "network", "all"),
    Probe("netdevs", ("ip", "-brief", "link"), "network", "all"),
    Probe("addresses", ("ip", "-brief", "addr"), "network", "all"),
    Probe("docker", ("docker", "--version"), "software"),
    Probe("containers", ("docker", "ps", "--format", "{{.ID}} {{.Image}} {{.Names}} {{.Status}}"), "software", "all"),
)


def _summary(probe: Probe, out: str) -> str:
    out = out.strip()
    if not out:
        return ""
    if probe.summarize == "all":
        return out
    if probe.summarize.startswith("regex:"):
        m = re.search(probe.summarize[6:], out)
        return m.group(1) if m else out.splitlines()[0]
    return out.splitlines()[0].strip()


def collect_facts(host: Any, probes: tuple[Probe, ...] = PROBES, raw_dir: Path | None = None) -> pd.DataFrame:
    """Run every probe on ``host``; one row per fact: node, group, fact, status, value, command, exit code.

    status: ``ok``; ``not present`` (program missing, or nothing to report: e.g. no GPU, no RDMA);
    ``failed`` (the program exists and failed). Raw outputs go to ``raw_dir/<fact>.txt``.
    """
    rows = []
    for p in probes:
        r = host.run(list(p.argv), timeout=30)
        out = redact_text(r.stdout)
        missing = r.exit_code == 127 or "not found" in r.stderr and r.exit_code != 0
        value = _summary(p, out)
        if missing or (r.exit_code != 0 and p.argv[0] in ("nvidia-smi", "dcgmi", "nvcc", "docker")):
            status = "not present"
        elif not value and p.group in ("gpu", "network"):  # e.g. grep/ls found no NCCL, no RDMA device
            status = "not present"
        elif r.exit_code == 0:
            status = "ok"
        else:
            status = "failed"
        if raw_dir is not None:
            raw_dir.mkdir(parents=True, exist_ok=True)
            (raw_dir / f"{p.fact}.txt").write_text(f"$ {' '.join(p.argv)}\n# exit {r.exit_code}\n{out}\n{r.stderr}")
        rows.append({"node": host.name, "group": p.group, "fact": p.fact, "status": status,
                     "value": value if status == "ok" else "-", "command": " ".join(p.argv),
                     "exit_code": r.exit_code})
    return pd.DataFrame(rows)


def nccl_env(env: dict[str, str]) -> pd.DataFrame:
    """The communication variables (NCCL_*, GLOO_*, UCX_*, *_IFNAME) of an environment, redacted."""
    keep = {k: v for k, v in env.items() if k.startswith(("NCCL_", "GLOO_", "UCX_", "NVSHMEM_")) or "IFNAME" in k}
    return pd.DataFrame([{"variable": k, "value": v} for k, v in sorted(redact_env(keep).items())],
                        columns=["variable", "value"])


# ---------------------------------------------------------------- snapshots


def process_snapshot(host: Any) -> pd.DataFrame:
    """Processes on the host: pid, ppid, user, state (``ps`` STAT: ``Z`` = a zombie, exited and waiting to be
    reaped), cpu %, rss MiB, elapsed, command (secrets redacted)."""
    r = host.run(["ps", "-eo", "pid=,ppid=,user=,stat=,pcpu=,rss=,etime=,args="], timeout=30)
    rows = []
    for line in r.stdout.splitlines():
        parts = line.split(None, 7)
        if len(parts) < 8:
            continue
        pid, ppid, user, stat, cpu, rss, etime, args = parts
        rows.append({"node": host.name, "pid": int(pid), "ppid": int(ppid), "user": user, "state": stat,
                     "cpu_pct": float(cpu), "rss_mib": round(int(rss) / 1024, 1), "elapsed": etime,
                     "command": redact_text(args)[:300]})
    return pd.DataFrame(rows, columns=["node", "pid", "ppid", "user", "state", "cpu_pct", "rss_mib", "elapsed",
                                       "command"])


def port_snapshot(host: Any) -> pd.DataFrame:
    """Listening TCP sockets (``ss -ltnH``): address, port, process where visible."""
    r = host.run(["ss", "-ltnpH"], timeout=30)
    rows = []
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        local = parts[3]
        addr, _, port = local.rpartition(":")
        proc = " ".join(parts[5:]) if len(parts) > 5 else ""
        m = re.search(r'\("([^"]+)",pid=(\d+)', proc)
        rows.append({"node": host.name, "address": addr, "port": int(port) if port.isdigit() else port,
                     "process": m.group(1) if m else "", "pid": int(m.group(2)) if m else None})
    return pd.DataFrame(rows, columns=["node", "address", "port", "process", "pid"])


def snapshot_diff(before: pd.DataFrame, after: pd.DataFrame, key: list[str]) -> pd.DataFrame:
    """Rows of ``after`` not in ``before`` (new processes / new listening ports), by ``key``."""
    if before.empty:
        return after
    merged = after.merge(before[key].drop_duplicates(), on=key, how="left", indicator=True)
    return merged[merged["_merge"] == "left_only"].drop(columns="_merge").reset_index(drop=True)


def gguf_facts(path: Path) -> dict[str, Any]:
    """Architecture and sizes from a GGUF file's metadata (no tensors loaded)."""
    reader = GGUFReader(str(path))
    out: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if name.startswith("tokenizer.") or not fld.types:
            continue
        try:
            val = fld.contents()
        except Exception:
            continue
        if isinstance(val, (list, tuple)) and len(val) > 8:
            continue
        out[name] = val
    out["tensor_count"] = len(reader.tensors)
    return out


# ---------------------------------------------------------------- the frozen software and weights
#
# What Phase 0 freezes per node, taken before the engine starts and again after it stopped
# (``docs/method.md#freeze``): the engine's container image (name and id), the engine's own Python packages
# read by the engine's own interpreter (never servelab's), the engine's git commit where its install records one,
# and the sha256 of every file of the model. Every probe runs on the node through the host layer (SSH for a
# remote node), in docker mode inside a throw-away container of the engine's image.

# Run with the engine's interpreter: argv[1] is the engine's top-level module ("sglang", "vllm"), which is located
# but never imported. Prints one JSON object: the interpreter, every installed distribution (name, version, the
# raw direct_url.json where pip wrote one) and the engine module's place, with the git checkout that holds it.
SOFTWARE_SCRIPT = r'''
import json, os, subprocess, sys
from importlib import metadata, util

def git_checkout(start):
    d = os.path.abspath(start)
    while not os.path.exists(os.path.join(d, ".git")):
        if os.path.dirname(d) == d:
            return None
        d = os.path.dirname(d)
    gitdir = os.path.join(d, ".git")
    if os.path.isfile(gitdir):
        text = open(gitdir).read().strip()
        gitdir = os.path.normpath(os.path.join(d, text.split(":", 1)[1].strip())) if text.startswith("gitdir:") else gitdir
    common = gitdir
    if os.path.isfile(os.path.join(gitdir, "commondir")):
        common = os.path.normpath(os.path.join(gitdir, open(os.path.join(gitdir, "commondir")).read().strip()))
    try:
        head = open(os.path.join(gitdir, "HEAD")).read().strip()
    except OSError as exc:
        return {"root": d, "error": str(exc)}
    ref, commit = "", head
    if head.startswith("ref:"):
        ref, commit = head[4:].strip(), None
        for base in (gitdir, common):
            if os.path.isfile(os.path.join(base, ref)):
                commit = open(os.path.join(base, ref)).read().strip()
                break
        if commit is None and os.path.isfile(os.path.join(common, "packed-refs")):
            for line in open(os.path.join(common, "packed-refs")):
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref:
                    commit = parts[0]
    dirty = None
    try:
        r = subprocess.run(["git", "-C", d, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, timeout=120)
        dirty = bool(r.stdout.strip()) if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"root": d, "ref": ref, "commit": commit, "dirty": dirty}

pkg = sys.argv[1] if len(sys.argv) > 1 else ""
out = {"python": sys.version.split()[0], "executable": sys.executable, "prefix": sys.prefix, "packages": []}
seen = set()
for dist in metadata.distributions():
    name = dist.metadata["Name"] or ""
    key = name.lower().replace("_", "-").replace(".", "-")
    if not name or key in seen:
        continue
    seen.add(key)
    out["packages"].append({"name": name, "version": dist.version, "direct_url": dist.read_text("direct_url.json")})
if pkg:
    spec = util.find_spec(pkg)
    where = None
    if spec is not None:
        where = list(spec.submodule_search_locations or [])[:1] or [spec.origin]
        where = where[0]
    dists = metadata.packages_distributions().get(pkg, [])
    out["engine"] = {"module": pkg, "location": where, "distributions": dists,
                     "git": git_checkout(os.path.dirname(where) if where and os.path.isfile(where) else where)
                     if where else None}
print(json.dumps(out))
'''

# Run with python3 on the node: argv[1] the model path (a file, or a folder whose top-level files are hashed),
# argv[2] "list" or "hash", argv[3] (hash) the previous pass as {file: [size, mtime_ns, ctime_ns, inode, sha256]}:
# a file whose four stat values are unchanged keeps its sha256 (a changed content changes mtime and ctime, and
# ctime cannot be set back). One JSON line per file, streamed in 1 MiB reads.
WEIGHTS_SCRIPT = r'''
import hashlib, json, os, sys, time
root, mode = sys.argv[1], sys.argv[2]
prev = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
if not os.path.exists(root):
    print(json.dumps({"error": "no such file or folder on this node: " + root}))
    sys.exit(3)
if os.path.isfile(root):
    files = [(os.path.basename(root), root)]
else:
    files = [(n, os.path.join(root, n)) for n in sorted(os.listdir(root))
             if not n.startswith(".") and os.path.isfile(os.path.join(root, n))]
for rel, path in files:
    st = os.stat(path)
    key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    rec = {"file": rel, "bytes": st.st_size, "stat": key}
    if mode == "hash":
        old = prev.get(rel)
        if old and list(old[:4]) == key:
            rec.update(sha256=old[4], seconds=0.0, how="unchanged since hashed")
        else:
            t0, h = time.monotonic(), hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            rec.update(sha256=h.hexdigest(), seconds=round(time.monotonic() - t0, 3), how="hashed")
    print(json.dumps(rec), flush=True)
'''

HASH_MB_PER_S = 100.0          # the slowest hashing rate a timeout allows for (a network file system)
PROBE_PREFIX = "servelab-probe"


@dataclass
class EngineEnv:
    """Where a node's engine runs, as its launch plan says: the interpreter that runs it (None for a compiled
    engine), its top-level module, its argv (for the version command), and in docker mode the image and the
    container client. A probe runs bare on the node or in a throw-away container of the image."""
    node: str
    argv: tuple[str, ...]
    python: str | None = None
    package: str | None = None
    image: str | None = None
    client: str = "docker"
    env: dict[str, str] | None = None
    role: str = "head"

    def argv_for(self, argv: list[str], run_id: str = "") -> tuple[list[str], str]:
        """(``argv`` as run on the node, the probe container's name or ``""``): in docker mode
        ``docker run --rm --network none --entrypoint argv[0] IMAGE argv[1:]`` under a fresh name."""
        if not self.image:
            return list(argv), ""
        name = f"{PROBE_PREFIX}-{re.sub(r'[^A-Za-z0-9_.-]+', '-', run_id)[:40].strip('-.') or 'x'}-{secrets.token_hex(3)}"
        return [self.client, "run", "--rm", "--name", name, "--network", "none", "--entrypoint", argv[0], self.image,
                *argv[1:]], name


def engine_env(plan: Any, adapter: Any) -> EngineEnv:
    """The :class:`EngineEnv` of one launch plan (bare argv, or the container's engine argv and image)."""
    c = getattr(plan, "container", None)
    argv = list(c.engine_argv if c is not None else plan.argv)
    return EngineEnv(node=plan.node, argv=tuple(argv), python=adapter.engine_python(argv),
                     package=adapter.engine_package, image=c.image if c is not None else None,
                     client=c.client if c is not None else "docker", env=None if c is not None else dict(plan.env),
                     role=plan.role)


def run_in_engine_env(host: Any, eng: EngineEnv, argv: list[str], timeout: float, run_id: str = "") -> Any:
    """Run ``argv`` where the engine runs (bare with the engine's environment, or in a throw-away container of its
    image, removed on every exit path). Returns the host's ``Result``."""
    full, name = eng.argv_for(argv, run_id)
    try:
        return host.run(full, env=eng.env or None, timeout=timeout)
    finally:
        if name:
            host.run([eng.client, "rm", "-f", name], timeout=60)


def parse_direct_url(text: str | None) -> dict[str, Any]:
    """``direct_url.json`` (PEP 610, written by pip for a URL, VCS or local-folder install) → ``{"source", "url",
    "commit", "editable"}``; ``{}`` for an install from an index (pip writes no such file then)."""
    if not text:
        return {}
    try:
        d = json.loads(text)
    except ValueError:
        return {"source": "unreadable direct_url.json"}
    url = str(d.get("url", ""))
    if "vcs_info" in d:
        v = d["vcs_info"]
        return {"source": f"{v.get('vcs', 'vcs')} {url}" + (f"@{v['requested_revision']}" if v.get("requested_revision")
                                                             else ""), "url": url, "commit": v.get("commit_id", ""),
                "editable": False}
    if "dir_info" in d:
        return {"source": ("editable " if d["dir_info"].get("editable") else "") + f"folder {url}", "url": url,
                "commit": "", "editable": bool(d["dir_info"].get("editable"))}
    if "archive_info" in d:
        h = d["archive_info"].get("hash") or (d["archive_info"].get("hashes") or {}).get("sha256", "")
        return {"source": f"archive {url}" + (f" ({h})" if h else ""), "url": url, "commit": "", "editable": False}
    return {"source": url, "url": url, "commit": "", "editable": False}


_SCM_COMMIT = re.compile(r"(?:\+|\.)g([0-9a-f]{7,40})\b")     # setuptools-scm local versions: 0.6.1.dev12+g1a2b3c4


def parse_software(stdout: str) -> dict[str, Any]:
    """The output of :data:`SOFTWARE_SCRIPT` → ``{"python", "executable", "packages": DataFrame(package, version,
    installed_from, commit), "engine": {"distribution", "version", "commit", "commit_source", "location"}}``.

    The engine's commit, in this order: its distribution's ``direct_url.json`` (a VCS install records the commit
    it was built from), the git checkout holding its module (a source or editable install: ``HEAD``, with
    ``dirty`` when tracked files differ), the commit a setuptools-scm version carries (``+g<hex>``); otherwise
    none is recorded and ``commit_source`` says why."""
    d = json.loads(stdout.strip().splitlines()[-1])
    rows = []
    for p in d.get("packages", []):
        du = parse_direct_url(p.get("direct_url"))
        rows.append({"package": p["name"], "version": p["version"], "installed_from": du.get("source") or "index or wheel",
                     "commit": du.get("commit", "")})
    packages = pd.DataFrame(rows, columns=["package", "version", "installed_from", "commit"])
    packages = packages.sort_values("package", key=lambda s: s.str.lower()).reset_index(drop=True)
    out: dict[str, Any] = {"python": d.get("python", ""), "executable": d.get("executable", ""), "packages": packages}
    eng = d.get("engine")
    if eng is not None:
        dists = eng.get("distributions") or []
        dist = next((r for r in rows if r["package"] in dists), None)
        info = {"module": eng.get("module", ""), "location": eng.get("location") or "",
                "distribution": dist["package"] if dist else "", "version": dist["version"] if dist else "",
                "commit": "", "commit_source": ""}
        git = eng.get("git") or {}
        if not eng.get("location"):
            info["commit_source"] = f"the module {eng.get('module')} is not importable by this interpreter"
        elif dist and dist["commit"]:
            info.update(commit=dist["commit"], commit_source=f"direct_url.json of {dist['package']} ({dist['installed_from']})")
        elif git.get("commit"):
            info.update(commit=git["commit"] + ("-dirty" if git.get("dirty") else ""),
                        commit_source=f"git checkout {git['root']}" + (f" ({git['ref']})" if git.get("ref") else "")
                        + (": tracked files modified" if git.get("dirty") else ""))
        elif dist and (m := _SCM_COMMIT.search(dist["version"])):
            info.update(commit=m.group(1), commit_source=f"the version {dist['version']} (setuptools-scm)")
        elif dist:
            how = "an index or a wheel" if dist["installed_from"] == "index or wheel" else dist["installed_from"]
            info["commit_source"] = f"not recorded: {dist['package']} {dist['version']} was installed from {how}, " \
                                    "which records no commit"
        else:
            info["commit_source"] = "not recorded: no installed distribution owns the module"
        out["engine"] = info
    return out


def parse_image_inspect(stdout: str) -> dict[str, Any]:
    """``docker image inspect --format '{{json .}}' IMAGE`` → ``{"id", "tags", "digests", "created", "revision"}``
    (``revision``: the OCI ``org.opencontainers.image.revision`` label, the commit the image was built from, where
    the image carries it)."""
    d = json.loads(stdout.strip().splitlines()[-1])
    labels = ((d.get("Config") or {}).get("Labels") or {})
    return {"id": d.get("Id", ""), "tags": list(d.get("RepoTags") or []), "digests": list(d.get("RepoDigests") or []),
            "created": d.get("Created", ""), "revision": labels.get("org.opencontainers.image.revision", "")}


def parse_weight_lines(stdout: str) -> tuple[pd.DataFrame, str]:
    """The output of :data:`WEIGHTS_SCRIPT` → (frame: file, bytes, stat, sha256, seconds, how; error or ``""``)."""
    rows, error = [], ""
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if "error" in rec:
            error = rec["error"]
            continue
        rows.append(rec)
    cols = ["file", "bytes", "stat", "sha256", "seconds", "how"]
    return pd.DataFrame(rows, columns=cols) if rows else pd.DataFrame(columns=cols), error


def weight_checksums(host: Any, model_path: str, previous: pd.DataFrame | None = None, rehash: bool = False,
                     python: str = "python3") -> dict[str, Any]:
    """sha256 of the model on ``host``: the GGUF (or other) file, or every top-level file of a model folder
    (weights, config, tokenizer), streamed on the node itself. With ``previous`` (an earlier pass of the same node)
    a file whose size, mtime, ctime and inode are unchanged keeps its hash unless ``rehash``. Returns ``{"files":
    frame, "seconds", "bytes", "error", "results"}`` (``seconds``: the wall time of the hashing call; ``results``:
    the host's ``Result`` of each call)."""
    listing = host.run([python, "-c", WEIGHTS_SCRIPT, model_path, "list"], timeout=120)
    files, error = parse_weight_lines(listing.stdout)
    if listing.exit_code == 127 or (listing.exit_code != 0 and not error):
        why = (listing.stderr or listing.stdout).strip().splitlines()
        return {"files": files, "seconds": 0.0, "bytes": 0, "error": error or f"{python} on {host.name}: "
                + (why[-1] if why else f"exit {listing.exit_code}"), "results": [listing]}
    if error:
        return {"files": files, "seconds": 0.0, "bytes": 0, "error": error, "results": [listing]}
    total = int(files["bytes"].sum()) if len(files) else 0
    prev = {}
    if previous is not None and not rehash and len(previous):
        prev = {r.file: [*r.stat, r.sha256] for r in previous.itertuples() if isinstance(r.sha256, str) and r.sha256}
    t0 = time.monotonic()
    r = host.run([python, "-c", WEIGHTS_SCRIPT, model_path, "hash", json.dumps(prev)],
                 timeout=120 + total / (HASH_MB_PER_S * 1e6))
    seconds = round(time.monotonic() - t0, 2)
    files, error = parse_weight_lines(r.stdout)
    if r.exit_code != 0 and not error:
        error = f"hashing stopped (exit {r.exit_code}): {(r.stderr or '').strip()[-200:]}"
    return {"files": files, "seconds": seconds, "bytes": total, "error": error, "results": [listing, r]}


def weights_fingerprint(files: pd.DataFrame) -> str:
    """The model's one checksum: a single file's own sha256, else one sha256 over the ``<file> <sha256>`` lines of
    every file (sorted) — equal exactly when every file is."""
    if files.empty or files["sha256"].isna().any():
        return ""
    if len(files) == 1:
        return str(files["sha256"].iloc[0])
    lines = "".join(f"{f} {h}\n" for f, h in sorted(zip(files["file"], files["sha256"])))
    return hashlib.sha256(lines.encode()).hexdigest()


@dataclass
class NodeFreeze:
    """One node's frozen software and weights at one moment (``before`` the engine started, ``after`` it stopped)."""
    node: str
    moment: str
    engine: dict[str, Any]                  # name, distribution, version, commit, commit_source, python, executable
    packages: pd.DataFrame                  # package, version, installed_from, commit
    weights: pd.DataFrame                   # file, bytes, stat, sha256, seconds, how
    weights_seconds: float = 0.0
    weights_bytes: int = 0
    image: dict[str, Any] | None = None     # docker mode: name, id, tags, digests, created, revision
    notes: list[str] | None = None          # what could not be read, in sentences
    commands: list[Any] | None = None       # the host Results of the probes (recorded as executed commands)


def freeze_node(host: Any, eng: EngineEnv, adapter: Any, model_path: str, moment: str,
                previous: NodeFreeze | None = None, rehash: bool = False, run_id: str = "",
                raw_dir: Path | None = None) -> NodeFreeze:
    """Read on ``host`` what its engine runs from: the image (docker mode), the engine's packages with the engine's
    own interpreter (bare, or inside a throw-away container of the image), its commit, its version output
    (compiled engines), and the model's sha256 per file (see :func:`weight_checksums`; ``previous`` lets unchanged
    files keep their hash). Raw outputs go to ``raw_dir`` (redacted)."""
    notes: list[str] = []
    commands: list[Any] = []
    raw: dict[str, str] = {}
    image = None
    if eng.image:
        r = host.run([eng.client, "image", "inspect", "--format", "{{json .}}", eng.image], timeout=60)
        commands.append(r)
        raw["image_inspect"] = r.stdout + r.stderr
        if r.ok and r.stdout.strip():
            image = {"name": eng.image, **parse_image_inspect(r.stdout)}
        else:
            image = {"name": eng.image, "id": ""}
            notes.append(f"the image {eng.image} is not on {host.name} ({(r.stderr or '').strip()[:160] or r.exit_code})")
    engine: dict[str, Any] = {"name": adapter.name, "distribution": "", "version": "", "commit": "", "commit_source": "",
                              "python": "", "executable": eng.python or (eng.argv[0] if eng.argv else "")}
    packages = pd.DataFrame(columns=["package", "version", "installed_from", "commit"])
    if eng.python and eng.package and (not eng.image or (image and image.get("id"))):
        r = run_in_engine_env(host, eng, [eng.python, "-c", SOFTWARE_SCRIPT, eng.package], 300, run_id)
        commands.append(r)
        raw["packages"] = r.stdout + r.stderr
        try:
            sw = parse_software(r.stdout) if r.ok else None
        except (ValueError, KeyError, IndexError):
            sw = None
        if sw is None:
            why = (r.stderr or r.stdout).strip().splitlines()
            notes.append(f"the engine's packages could not be read with {eng.python}"
                         + (" in the image" if eng.image else "") + f" on {host.name}: "
                         + (why[-1][:200] if why else f"exit {r.exit_code}"))
        else:
            packages = sw["packages"]
            engine.update({k: v for k, v in sw.get("engine", {}).items()
                           if k in ("distribution", "version", "commit", "commit_source")},
                          python=sw["python"], executable=sw["executable"])
    elif not eng.python:
        engine["commit_source"] = "a compiled engine: no Python packages"
    if not eng.python and not eng.image and eng.argv:      # a compiled engine on the node: its executable's sha256
        r = host.run(["sh", "-c", 'sha256sum "$(command -v "$1")"', "servelab-sha256", eng.argv[0]], timeout=300)
        commands.append(r)
        digest = r.stdout.split()[0] if r.ok and r.stdout.strip() else ""
        engine["executable_sha256"] = digest if re.fullmatch(r"[0-9a-f]{64}", digest) else ""
        if not engine["executable_sha256"]:
            notes.append(f"the sha256 of {eng.argv[0]} on {host.name} could not be taken: "
                         f"{(r.stderr or r.stdout).strip()[:160] or r.exit_code}")
    # the version output of the head's engine (a worker may run another program: llama.cpp's RPC server)
    vcmd = adapter.version_command(list(eng.argv)) if eng.argv and eng.role == "head" else None
    if vcmd and (not eng.image or (image and image.get("id"))):
        r = run_in_engine_env(host, eng, vcmd, 60, run_id)
        commands.append(r)
        text = (r.stdout + r.stderr).strip()
        raw["version"] = text
        first = text.splitlines()[0].removeprefix("version:").strip()[:120] if r.ok and text else ""
        engine["version"] = engine["version"] or first
        commit = adapter.commit_from_version(text) if r.ok else ""
        if commit and not engine["commit"]:
            engine.update(commit=commit, commit_source=f"`{' '.join(vcmd)}`")
    if image and image.get("revision") and not engine["commit"]:
        engine.update(commit=image["revision"], commit_source="image label org.opencontainers.image.revision")
    if not engine["commit"] and not engine["commit_source"]:
        engine["commit_source"] = "not recorded by this engine's install"
    w = weight_checksums(host, model_path, previous.weights if previous is not None else None, rehash,
                         python=eng.python if eng.python and not eng.image else "python3")
    commands += w["results"]
    if w["error"]:
        notes.append(f"model checksums on {host.name}: {w['error']}")
    if raw_dir is not None:
        raw_dir.mkdir(parents=True, exist_ok=True)
        for k, v in raw.items():
            (raw_dir / f"{k}.txt").write_text(redact_text(v))
        (raw_dir / "weights.jsonl").write_text("".join(json.dumps(rec, default=str) + "\n"
                                                       for rec in w["files"].to_dict(orient="records")))
    return NodeFreeze(node=host.name, moment=moment, engine=engine, packages=packages, weights=w["files"],
                      weights_seconds=w["seconds"], weights_bytes=w["bytes"], image=image, notes=notes,
                      commands=commands)


def freeze_summary(f: NodeFreeze) -> dict[str, Any]:
    """What a run keeps of one node's freeze: image and image id (docker mode), engine and version, commit,
    interpreter, the executable's sha256, every package's version, every model file's sha256 and one sha256 over them
    — the manifest's ``frozen.<node>`` (Phase 0, before the engine started) and ``frozen_end.<node>`` (the run's end)."""
    e = f.engine
    d: dict[str, Any] = {}
    if f.image is not None:
        d.update(image=f.image.get("name", ""), image_id=f.image.get("id", ""))
    d.update(engine=" ".join(x for x in (e.get("distribution") or e.get("name", ""), e.get("version", "")) if x),
             engine_commit=e.get("commit", ""), python=e.get("python", ""),
             **({"executable_sha256": e["executable_sha256"]} if e.get("executable_sha256") else {}),
             packages={r.package: r.version for r in f.packages.itertuples()},
             weights={r.file: r.sha256 for r in f.weights.itertuples()},
             weights_sha256=weights_fingerprint(f.weights))
    return d


FREEZE_COLUMNS = ["node", "kind", "what", "before", "after"]
FREEZE_MARKING = ("driver", "engine", "image", "weights")     # the kinds that mark the run's comparisons
FREEZE_ITEM_KIND = {"image": "image", "image_id": "image", "engine": "engine", "engine_commit": "engine",
             "python": "engine", "executable_sha256": "engine", "weights_sha256": "weights"}


def compare_freezes(before: dict[str, Any], after: dict[str, Any], node: str) -> list[dict[str, Any]]:
    """The changed items between two freeze summaries of one node (``deploy.facts.freeze_summary`` dicts); the
    engine's own distribution among the packages counts as an ``engine`` change."""
    rows = []
    for item, kind in FREEZE_ITEM_KIND.items():
        if item in before or item in after:
            b, a = before.get(item, "absent"), after.get(item, "absent")
            if str(b) != str(a):
                rows.append({"node": node, "kind": kind, "what": item, "before": b, "after": a})
    own = str(after.get("engine") or before.get("engine") or "").split(" ")[0].lower().replace("_", "-")
    for group, kind in (("packages", "package"), ("weights", "weights")):
        b, a = before.get(group) or {}, after.get(group) or {}
        for name in sorted(set(b) | set(a)):
            if str(b.get(name, "absent")) != str(a.get(name, "absent")):
                is_engine = kind == "package" and own and name.lower().replace("_", "-") == own
                label = f"{'package' if kind == 'package' else 'model file'} {name}"
                rows.append({"node": node, "kind": "engine" if is_engine else kind, "what": label,
                             "before": b.get(name, "absent"), "after": a.get(name, "absent")})
    return rows
