"""The architecture, checked: the import contracts hold, a contract broken on purpose is caught, lint is
clean, engine knowledge stays in the engine adapters and the product points at nothing outside itself."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def lint_imports(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    exe = BIN / "lint-imports"
    if not exe.exists():
        pytest.skip("lint-imports is not installed in this environment (make test installs it)")
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(Path.home())}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([str(exe), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold() -> None:
    res = lint_imports(ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "BROKEN" not in res.stdout
    assert res.stdout.count("KEPT") >= 4


@pytest.fixture()
def tree_copy(tmp_path: Path) -> Path:
    """A copy of the package and the contracts, to break on purpose."""
    shutil.copytree(ROOT / "lib" / "servelab", tmp_path / "servelab",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.slow          # the import linter run on a copy of the package (seconds)
def test_an_import_cycle_added_on_purpose_is_caught(tree_copy: Path) -> None:
    # run -> paths exists; paths -> run closes a loop inside servelab.core
    with open(tree_copy / "servelab" / "core" / "paths.py", "a") as f:
        f.write("\nfrom servelab.core import run as _loop  # noqa: E402,F401\n")
    res = lint_imports(tree_copy, pythonpath=tree_copy)
    assert res.returncode != 0
    assert "No cycles are allowed in servelab.core" in res.stdout


@pytest.mark.slow          # the import linter run on a copy of the package (seconds)
def test_an_upward_import_is_caught(tree_copy: Path) -> None:
    # the request metrics (measure) reaching up into a phase module
    with open(tree_copy / "servelab" / "measure" / "request_metrics.py", "a") as f:
        f.write("\nfrom servelab.phases import context as _up  # noqa: E402,F401\n")
    res = lint_imports(tree_copy, pythonpath=tree_copy)
    assert res.returncode != 0
    assert "servelab.measure is not allowed to import servelab.phases" in res.stdout


@pytest.mark.slow          # the import linter run on a copy of the package (seconds)
def test_a_phase_importing_another_phase_is_caught(tree_copy: Path) -> None:
    with open(tree_copy / "servelab" / "phases" / "phase8_cache.py", "a") as f:
        f.write("\nfrom servelab.phases import phase1_perf_map as _other  # noqa: E402,F401\n")
    res = lint_imports(tree_copy, pythonpath=tree_copy)
    assert res.returncode != 0
    assert "phase8_cache is not allowed to import" in res.stdout


def test_ruff_is_clean() -> None:
    exe = BIN / "ruff"
    if not exe.exists():
        pytest.skip("ruff is not installed in this environment (make test installs it)")
    res = subprocess.run([str(exe), "check", "lib", "tests", "benchmarks"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:]


ENGINE_BRANCH = re.compile(r"""engine ?[!=]= ?["']|engine in [({\[]""")


def test_engine_branches_live_only_in_the_engine_adapters() -> None:
    lib = ROOT / "lib" / "servelab"
    found = [f"{p.relative_to(ROOT)}:{i}" for p in lib.rglob("*.py") if "engines" not in p.relative_to(lib).parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if ENGINE_BRANCH.search(line)]
    assert found == []


# the source documents by any name they go by ("seeds" alone is also the workload's random seeds: not matched)
OUTSIDE = re.compile(r"\.\./shared|[Ss]eed[s] §|[Ss]eeds'|[Tt]he seed[s] (?:ask|say|plan|report|document)|"
                     r"GLM[ ]report|the pla[n]\b|\b00[024] §")


def test_the_product_points_at_nothing_outside_itself() -> None:
    paths = [ROOT / "README.md", *(ROOT / "lib").rglob("*.py"), *(ROOT / "lib").rglob("*.json"),
             *(ROOT / "lib").rglob("*.yaml"), *(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "docs").rglob("*.md"),
             *(ROOT / "params").rglob("*.yaml"), *(ROOT / "data" / "samples").rglob("README.md")]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in paths if "egg-info" not in str(p)
             for i, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert found == []


# where "vllm" / "sglang" may stand as a whole string: the engine adapters, the engines' own installs, and the one
# place that names the two metric definitions (request_metrics.Definition)
ENGINE_NAME_HOMES = ("deploy/engines/", "deploy/vllm_cpu.py", "deploy/sglang_cpu.py", "measure/request_metrics.py")


def test_metric_definitions_are_named_as_definitions_not_as_engines() -> None:
    """A metric definition in the code is ``request_metrics.Definition`` (``SGLANG_BENCH``, ``VLLM_BENCH``), never the
    bare engine name: ``summaries["vllm"]`` read as "the vLLM engine's summary" to a newcomer."""
    trees = library_trees(re.compile(r"""["'](?:vllm|sglang)["']"""))
    found = [f"{rel}:{node.lineno}" for rel, tree in trees.items() if not rel.startswith(ENGINE_NAME_HOMES)
             for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in ("vllm", "sglang")]
    assert found == []


def library_trees(marker: re.Pattern[str]) -> dict[str, ast.Module]:
    """The modules of lib/servelab whose text matches ``marker``, parsed (relative path → syntax tree): a module the
    pattern does not match cannot hold what the caller looks for."""
    lib = ROOT / "lib" / "servelab"
    return {p.relative_to(lib).as_posix(): ast.parse(text) for p in sorted(lib.rglob("*.py"))
            if marker.search(text := p.read_text())}


MAX_MODULE_LINES = 700


def test_no_library_module_is_over_700_lines() -> None:
    lib = ROOT / "lib" / "servelab"
    big = {p.relative_to(lib).as_posix(): n for p in lib.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert big == {}, f"split these along their sections: {big}"


# in-function imports of servelab modules that stay on purpose (everything else goes to the top of its module):
# - cli.py: what a subcommand runs beyond core/deploy (pages, archive, phases), so `servelab phases|targets|params`
#   answer without loading nbconvert or plotly;
# - the engine adapters: the local engines' builders and installers (gguf/numpy, engine venvs), needed only for a
#   local target; every trace-parsing worker imports the adapters;
# - analyse/telemetry/smi_probe.py: the summary is optional on a bare GPU machine without pandas.
LAZY_IMPORTS_KEPT = {
    "cli.py": ("servelab.report.", "servelab.phases.", "servelab.measure"),
    "deploy/engines/llamacpp.py": ("servelab.deploy.models", "servelab.deploy.llamacpp_build"),
    "deploy/engines/sglang.py": ("servelab.deploy.sglang_cpu",),
    "deploy/engines/vllm.py": ("servelab.deploy.vllm_cpu",),
    "analyse/telemetry/smi_probe.py": ("servelab.analyse.telemetry.",),
}


def test_servelab_imports_sit_at_the_top_of_their_module() -> None:
    """No cycle needs an import inside a function (the contracts forbid cycles, in-function imports included); only
    the kinds in LAZY_IMPORTS_KEPT stay there, for the reason written above it."""
    found = []
    for rel, tree in library_trees(re.compile(r"^[ \t]+(?:from|import)[ \t]+servelab", re.M)).items():
        kept = LAZY_IMPORTS_KEPT.get(rel, ("\0",))
        stack = [(node, False) for node in tree.body]
        while stack:
            node, in_function = stack.pop()
            if in_function and isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                found += [f"{rel}:{node.lineno} {m}" for m in mods if m.startswith("servelab") and not m.startswith(kept)]
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            stack.extend((child, inner) for child in ast.iter_child_nodes(node))
    assert sorted(found) == []
