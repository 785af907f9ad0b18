# Two commands do all the set-up on a fresh machine:
#   make demo   # optimize three MLPs, print the report, the agreement and (on a GPU) the speed-ups
#   make test   # ruff + the test suite + the docstrings' examples (GPU tests skip without CUDA)
# On a machine whose python3 already has torch/triton/networkx (the GPU machine), NO_VENV=1 uses it.

VENV ?= .venv
ifdef NO_VENV
PY := python3
STAMP := .fxfuse-system-install
else
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
endif

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml requirements-dev.txt
ifndef NO_VENV
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
endif
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -q
	$(PY) -m pytest -q --doctest-modules fxfuse benchmarks/workloads.py benchmarks/limits.py benchmarks/results_table.py benchmarks/bench_sweep.py benchmarks/measure.py  # the docstrings' examples (GPU-only ones are skipped)

bench: $(STAMP)
	$(PY) benchmarks/bench_workloads.py

clean:
	rm -rf $(VENV) .fxfuse-system-install *.egg-info
