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


# in-function imports of other packages (standard library or third party) that stay on purpose, each with its reason:
# {module: {top-level package: why}}; every other import sits at the top of its module. ~N ms: the import's cost, on
# top of what `servelab phases` loads already (2 shared cores)
LAZY_PACKAGES_KEPT = {
    "cli.py": {"papermill": "only executing a notebook (run, demo, case) needs it; ~2.5 s with nbconvert, which "
                            "`servelab phases|targets|params` never load"},
    "core/notebooks.py": {"jupyter_client": "the kernel manager, only when a notebook is executed; ~50 ms (zmq) at "
                                            "the start of every command (cli imports this module)"},
    "core/redact.py": {"plotly": "the plotly.js bundle the rules skip, read once for a text long enough to hold it; "
                                 "the CLI's start-up loads no plotly and smi_probe's bare GPU machine has none"},
    "core/run.py": {"pandas": "merge_table only: trace-parsing and Dask worker processes and smi_probe (a bare GPU "
                              "machine) import core.run without pandas (~0.7 s each)"},
    "data/sglang_cpu/servelab_sglang_cpu_hook.py": {
        "torch": "the .pth runs the hook at every interpreter start in the sglang-cpu venv; torch is imported only "
                 "when torchvision or SGLang's expert recorder is"},
    "deploy/cluster.py": {"distributed": "the optional extra servelab[cluster] (~0.5 s), in require_dask() with the "
                                         "install hint when it is missing"},
    "deploy/cluster_tls.py": {"distributed": "the optional extra: TLSFiles.security() (require_dask lives in "
                                             "cluster.py, which imports this module)",
                              "cryptography": "certificates at a cluster's start only; ~45 ms at every command's "
                                              "start-up and Dask worker (it comes with paramiko: not ours to declare)"},
    "deploy/hosts.py": {"paramiko": "SSH targets only: ~60 ms at every command's start-up; smi_probe's bare GPU "
                                    "machine has no paramiko"},
    "measure/client.py": {"aiohttp": "import_aiohttp(): ~0.2 s at every command's start-up (cli imports the "
                                     "client); a caller imports it before a measurement window opens"},
    "phases/context.py": {"papermill": "papermill_output(), in a kernel plain papermill started: ~2.5 s for every "
                                       "phase module and `servelab params` otherwise",
                          "plotly": "open_phase() sets the notebook renderer: `servelab params phase0|1|5|8|9` "
                                    "load no plotly"},
}
MAX_LAZY_PACKAGE_IMPORTS = 15


def lazy_package_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, top-level package) of each import inside a function or lambda of ``tree`` that is neither servelab's
    nor relative (one per imported module of an ``import a, b``)."""
    found = []
    stack = [(node, False) for node in tree.body]
    while stack:
        node, in_function = stack.pop()
        if in_function and isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.lineno, (node.module or "").split(".")[0]))
        elif in_function and isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))
    return sorted((line, pkg) for line, pkg in found if pkg != "servelab")


def test_other_packages_are_imported_at_the_top_of_their_module() -> None:
    """An in-function import of another package is in LAZY_PACKAGES_KEPT with its reason, every entry there still
    occurs (an import moved to the top leaves the list with it), and there are at most MAX_LAZY_PACKAGE_IMPORTS."""
    lib = ROOT / "lib" / "servelab"
    found: dict[tuple[str, str], list[int]] = {}
    for p in sorted(lib.rglob("*.py")):
        for line, pkg in lazy_package_imports(ast.parse(p.read_text())):
            found.setdefault((p.relative_to(lib).as_posix(), pkg), []).append(line)
    kept = {(rel, pkg) for rel, pkgs in LAZY_PACKAGES_KEPT.items() for pkg in pkgs}
    assert sorted(f"{rel}:{line} {pkg}" for (rel, pkg), lines in found.items() if (rel, pkg) not in kept
                  for line in lines) == []
    assert sorted(f"{rel} {pkg}" for rel, pkg in kept - set(found)) == []
    assert sum(map(len, found.values())) <= MAX_LAZY_PACKAGE_IMPORTS


def test_the_lazy_import_check_fails_on_counter_examples() -> None:
    src = ("import json\ntry:\n    import uvloop\nexcept ImportError:\n    uvloop = None\n\n"
           "def f():\n    from servelab.core import run\n    from . import sibling\n    return run, sibling\n\n"
           "class C:\n    import re\n")
    assert lazy_package_imports(ast.parse(src)) == []          # module level, class level, servelab, relative
    src = ("def f():\n    import json, os.path\n\n"
           "class C:\n    async def g(self):\n        def h():\n            from plotly.subplots import make_subplots\n"
           "key = lambda: __import__('x')\n")
    assert lazy_package_imports(ast.parse(src)) == [(2, "json"), (2, "os"), (7, "plotly")]


# ---------------------------------------------------------------- the phase contract
# every phase module exposes run(ctx: PhaseContext) -> a result that knows its headline and findings; a notebook calls
# it once, reads its parameters only through it, and never reaches for a private name of the library

PHASES = ROOT / "lib" / "servelab" / "phases"
NOTEBOOKS = ROOT / "notebooks"


def run_entry_problems(source: str) -> list[str]:
    """What keeps one phase module's source from the contract's entry: one top-level ``run`` whose only parameter is
    ``ctx`` annotated ``PhaseContext``."""
    runs = [n for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "run"]
    if len(runs) != 1:
        return [f"{len(runs)} top-level run functions, not one"]
    a = runs[0].args
    params = a.posonlyargs + a.args + a.kwonlyargs
    out = []
    if [p.arg for p in params] != ["ctx"] or a.vararg or a.kwarg:
        out.append(f"run takes {[p.arg for p in params]}, not only ctx")
    ann = params[0].annotation if params else None
    if not (isinstance(ann, ast.Name) and ann.id == "PhaseContext"
            or isinstance(ann, ast.Constant) and ann.value == "PhaseContext"):
        out.append("ctx is not annotated PhaseContext")
    return out


def test_every_phase_module_has_one_run_taking_only_a_phase_context() -> None:
    mods = sorted(PHASES.glob("phase[0-9]_*.py"))
    assert len(mods) == 10
    problems = {m.name: run_entry_problems(m.read_text()) for m in mods}
    assert {k: v for k, v in problems.items() if v} == {}


def test_the_entry_check_fails_on_counter_examples() -> None:
    assert not run_entry_problems("def run(ctx: PhaseContext) -> R:\n    ...\n")
    assert run_entry_problems("def run_phase1(ctx: PhaseContext) -> R:\n    ...\n")               # named otherwise
    assert run_entry_problems("def run(ctx: PhaseContext, top_n: int = 3) -> R:\n    ...\n")    # a parameter copied
    assert run_entry_problems("def run(ctx: Any) -> R:\n    ...\n")                              # untyped context
    assert run_entry_problems("def run(ctx: PhaseContext, **kw: Any) -> R:\n    ...\n")
    assert run_entry_problems("class C:\n    def run(self, ctx: PhaseContext) -> R:\n        ...\n")   # not top level


def notebook_cells(path: Path) -> tuple[list[str], list[str]]:
    """(parameter names of the tagged parameters cell, the code cells after it)."""
    import json
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    k = next(i for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", []))
    names = [n.target.id for n in ast.parse("".join(cells[k]["source"])).body
             if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    return names, ["".join(c["source"]) for c in cells[k + 1:]]


def notebook_contract_problems(phase_module: str, params: list[str], cells: list[str]) -> list[str]:
    """What breaks the contract in one notebook's code after its parameters cell: ``run(ctx)`` of its phase module
    called other than once; a private library name used; a parameter handed to a call by hand (``name=name``,
    ``p["name"]``, ``ctx.params["name"]``, ``ctx.params.name`` or the bare name)."""
    out: list[str] = []
    lib: set[str] = set()           # names bound to servelab modules or objects
    phase_aliases: set[str] = set()  # names bound to this notebook's phase module
    run_names: set[str] = set()      # `run` imported from it
    runs = 0
    for src in cells:
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("servelab"):
                for a in node.names:
                    lib.add(a.asname or a.name)
                    if a.name.startswith("_"):
                        out.append(f"imports the private {node.module}.{a.name}")
                    if node.module == "servelab.phases" and a.name == phase_module:
                        phase_aliases.add(a.asname or a.name)
                    if node.module == f"servelab.phases.{phase_module}" and a.name == "run":
                        run_names.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("servelab"):
                        lib.add((a.asname or a.name).split(".")[0])
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and isinstance(node.value, ast.Name) \
                    and node.value.id in lib:
                out.append(f"uses the private {node.value.id}.{node.attr}")
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            is_run = (isinstance(f, ast.Attribute) and f.attr == "run" and isinstance(f.value, ast.Name)
                      and f.value.id in phase_aliases) or (isinstance(f, ast.Name) and f.id in run_names)
            if is_run:
                runs += 1
                if [ast.unparse(a) for a in node.args] != ["ctx"] or node.keywords:
                    out.append(f"calls {ast.unparse(node)}, not run(ctx)")
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if isinstance(arg, ast.Name) and arg.id in params:
                    out.append(f"hands the parameter {arg.id} to {ast.unparse(f)} by hand")
                if isinstance(arg, ast.Subscript) and isinstance(arg.slice, ast.Constant) and arg.slice.value in params:
                    out.append(f"hands the parameter {ast.unparse(arg)} to {ast.unparse(f)} by hand")
                if isinstance(arg, ast.Attribute) and arg.attr in params and ast.unparse(arg.value).endswith("params"):
                    out.append(f"hands the parameter {ast.unparse(arg)} to {ast.unparse(f)} by hand")
    if runs != 1:
        out.append(f"calls {phase_module}.run(ctx) {runs} times, not once")
    return out


@pytest.mark.parametrize("nb", sorted(NOTEBOOKS.glob("phase[0-9]_*.ipynb")), ids=lambda p: p.stem)
def test_each_notebook_calls_its_phase_run_once_and_copies_no_parameter(nb: Path) -> None:
    params, cells = notebook_cells(nb)
    assert notebook_contract_problems(nb.stem, params, cells) == []


def test_the_notebook_check_fails_on_counter_examples() -> None:
    good = ['from servelab.phases.context import open_phase, finish_phase\n'
            'from servelab.phases import phase6_kernels as phase6\nctx = open_phase(phase6.Params, globals())',
            'result = phase6.run(ctx)', 'phase6.ncu_view(result, "derived")',
            'finish_phase(ctx, headline=result.headline(), findings=result.findings())']
    params = ["top_n", "gpu"]
    assert notebook_contract_problems("phase6_kernels", params, good) == []
    for bad in (['phase6.run(ctx)'],                                              # called twice
                ['phase6.ncu_view(result, top_n=top_n)'],                         # name=name
                ['p = ctx.params\nphase6.ncu_view(result, p["top_n"])'],          # p["name"]
                ['phase6.ncu_view(result, ctx.params["gpu"])'],
                ['phase6.ncu_view(result, ctx.params.gpu)'],
                ['phase6.ncu_view(result, gpu)'],                                 # the bare name
                ['phase6._short_name("x")'],                                      # a private name
                ['from servelab.phases.phase6_kernels import _short_name']):
        assert notebook_contract_problems("phase6_kernels", params, good + bad), bad
    assert notebook_contract_problems("phase6_kernels", params, [good[0], good[2]])       # run never called
    assert notebook_contract_problems("phase6_kernels", params,
                                      [good[0], 'result = phase6.run(ctx, top_n=3)'])     # run(ctx) with more


def test_every_phase_result_is_a_phase_result() -> None:
    """run's return type satisfies PhaseResult (headline and findings); a class missing one does not."""
    import importlib
    import typing
    from servelab.phases.context import PhaseResult
    for m in sorted(PHASES.glob("phase[0-9]_*.py")):
        mod = importlib.import_module(f"servelab.phases.{m.stem}")
        cls = typing.get_type_hints(mod.run)["return"]
        assert isinstance(object.__new__(cls), PhaseResult), m.stem
        assert callable(cls.headline) and callable(cls.findings), m.stem

    class HeadlineOnly:
        def headline(self) -> dict:
            return {}
    assert not isinstance(HeadlineOnly(), PhaseResult)


# ---------------------------------------------------------------- each room holds what its name says

def test_phases_holds_only_the_phase_modules_and_their_context() -> None:
    """``phases/`` is one module per notebook plus the context (and the package's ``definition`` lookup); the
    sections, checks and commands that lived there belong to the layer that does their work."""
    names = sorted(p.name for p in PHASES.glob("*.py"))
    assert [n for n in names if not re.fullmatch(r"phase[0-9]_[a-z0-9_]+\.py", n)] == ["__init__.py", "context.py"]


def test_no_phase_module_keeps_a_run_phase_shell() -> None:
    """``run(ctx)`` is the phase: no ``run_phaseN`` beside it anywhere in the library."""
    found = [f"{rel}:{node.lineno} {node.name}" for rel, tree in library_trees(re.compile(r"def run_phase")).items()
             for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and re.fullmatch(r"run_phase\d", node.name)]
    assert found == []


MEASURING = {"CaseRun", "run_async", "run_sync", "run_requests", "run_requests_multi", "build_workload", "LoopMonitor"}


def test_phase_modules_hold_no_measurement_loop() -> None:
    """A phase module composes: it calls a measurement in ``measure`` and judges it with ``analyse``; it never
    opens a case (``CaseRun``), builds a workload or drives the client itself."""
    found = []
    for f in sorted(PHASES.glob("phase[0-9]_*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in MEASURING:
                found.append(f"{f.name}:{node.lineno} {name}")
    assert found == []


def test_figures_are_drawn_only_in_figure_modules() -> None:
    """A function named ``*_figure`` lives in a figure module (``figures.py`` or ``*_figures.py``), never in a
    compute or phase module."""
    found = [f"{rel}:{node.lineno} {node.name}" for rel, tree in library_trees(re.compile(r"def \w+_figure\b")).items()
             if not re.search(r"(^|/|_)figures\.py$", rel)
             for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.endswith("_figure")]
    assert found == []


def test_measure_and_report_type_the_run_scope_and_never_probe_it() -> None:
    """``measure`` and ``report`` take a ``core.scope.RunScope``: no ``ctx: Any`` and no ``getattr``/``hasattr`` on
    a context."""
    probe = re.compile(r"ctx: Any\b|(?:getattr|hasattr)\(ctx\b")
    found = [f"{rel}: {m.group(0)}" for rel, tree in library_trees(probe).items()
             if rel.startswith(("measure/", "report/"))
             for m in probe.finditer((ROOT / "lib" / "servelab" / rel).read_text())]
    assert found == []


@pytest.mark.parametrize("nb", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_each_committed_notebook_is_valid_and_has_no_outputs(nb: Path) -> None:
    """nbformat validates it with no warning (a cell without an id warns on every run, and will be an error) and
    its code cells carry no outputs or execution counts (executed copies live under outputs/<run_id>/ only)."""
    import warnings

    import nbformat
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        doc = nbformat.read(nb, as_version=4)
        nbformat.validate(doc)
    ids = [c.get("id") for c in doc.cells]
    assert None not in ids and len(set(ids)) == len(ids)
    assert all(c.get("outputs", []) == [] and c.get("execution_count") is None for c in doc.cells if c.cell_type == "code")
