# The two commands of the README: `make demo` and `make test`.
# Everything is installed into .venv; nothing outside the package registries.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The local CPU build of torch lives here on our machines; pinning the exact
# version keeps pip from pulling multi-GB CUDA wheels on a CPU machine.
TORCH_SPEC ?= torch==2.13.0
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
# A room without network: `make wheelhouse` (once, online, same OS and Python)
# fills wheelhouse/; then `make setup WHEELHOUSE=wheelhouse` installs from it alone.
WHEELHOUSE ?=
OFFLINE := $(if $(WHEELHOUSE),--no-index --find-links $(WHEELHOUSE),)

.PHONY: setup demo test lint bench lab wheelhouse clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check $(FIND_LINKS) $(OFFLINE) "$(TORCH_SPEC)"
	$(PIP) install -q --disable-pip-version-check $(FIND_LINKS) $(OFFLINE) -e ".[dev,trace]"
	@# The package is minivllm alone; the repository's own tools (tools.labs, whose
	@# checkers the lab notebooks import wherever their kernel starts) go on the
	@# venv's path here instead.
	$(PY) -c "import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()['purelib'], 'minivllm-repository.pth').write_text('$(CURDIR)\n')"
	@# Graphviz's dot draws the tracer's block diagrams (minivllm-trace render).
	@command -v dot >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q graphviz >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q graphviz >/dev/null 2>&1; }; }; } || \
		echo "note: Graphviz (dot) is not installed; minivllm-trace render needs it: apt-get install graphviz, brew install graphviz or conda install graphviz"
	touch $@

demo: setup
	$(PY) tools/demo.py

# Two workers, each given whole files (a notebook's cells share one kernel) and
# one CPU thread, so that the two never fight over the cores.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: setup
	$(PY) -m ruff check .

# The CPU benchmarks (tools/bench/), about 15 minutes in all; each prints its
# table and writes tools/bench/results/<name>.json (and most a .png). On a busy
# machine: make bench BENCH_FLAGS="--threads 1" (the model's CPU threads).
BENCH_FLAGS ?=
bench: setup
	$(PY) -m tools.bench.kv_efficiency
	$(PY) -m tools.bench.step_cost
	$(PY) -m tools.bench.attention --json tools/bench/results/attention.json
	$(PY) -m tools.bench.roofline $(BENCH_FLAGS)
	$(PY) -m tools.bench.latency $(BENCH_FLAGS)
	$(PY) -m tools.bench.throughput $(BENCH_FLAGS)

# JupyterLab on the generated labs (tools/labs/FORMAT.md).
lab: setup
	$(PIP) install -q --disable-pip-version-check $(FIND_LINKS) $(OFFLINE) -e ".[dev,trace,lab]"
	$(VENV)/bin/jupyter lab labs/

wheelhouse:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# One resolution, so the pinned torch (not a CUDA build) satisfies the package.
	$(PIP) download -q -d wheelhouse $(FIND_LINKS) "$(TORCH_SPEC)" setuptools wheel ".[dev,trace,lab]"

clean:
	rm -rf $(VENV) .pytest_cache
