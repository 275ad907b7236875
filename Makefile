# The README's two commands. Both create (or reuse) the environment first.
#   make demo   the demo archive against the embedded local target (real llama-server + Gemma-3-270M)
#   make test   the whole test suite (what .ci/run calls)
# The checkout's .venv holds servelab (editable) with its `test` extra (pytest, ruff, import-linter ...: the
# tools of `make test` and `make lint`); `pip install .` alone installs only what servelab itself needs.
PY      ?= python3
VENV    ?= .venv
STAMP   := $(VENV)/.installed
SYSTEM_PACKAGES := cmake ninja-build gcc g++ python3-dev openssh-server sysstat numactl ethtool chromium fonts-dejavu-core fonts-wqy-zenhei iproute2 procps util-linux docker.io slurmctld slurmd slurm-client munge

.PHONY: demo test lint env system clean-outputs

$(STAMP): pyproject.toml setup.py lib/servelab/analyse/trace/_scan.c
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	@$(VENV)/bin/python -c "import servelab.analyse.trace._scan" 2>/dev/null || echo "warning: the trace scanner \
	was not compiled (no C compiler or Python headers): traces parse about 3x slower. Install gcc and python3-dev \
	(make system), then: rm $(STAMP) && make env"
	touch $(STAMP)

env: $(STAMP)

# Debian packages the tests need (real sshd, sysstat, headless chromium, the llama.cpp toolchain, the C compiler
# and Python headers of the trace scanner).
# Installed only where missing; needs root (as on CI and the dev machines).
system:
	@missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; fi

demo: system $(STAMP)
	$(VENV)/bin/servelab demo

test: system $(STAMP) lint
	$(VENV)/bin/pip install -q -e '.[cluster]'
	$(VENV)/bin/servelab build --tiny-only --sglang
	$(VENV)/bin/python -m pytest -q

# The architecture and the code style, checked: import contracts (pyproject [tool.importlinter]) and ruff.
lint: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check lib tests benchmarks

clean-outputs:
	rm -rf outputs
