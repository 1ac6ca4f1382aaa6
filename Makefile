# Two commands set everything up on a fresh machine:
#   make reproduce   run the notebook series (full profile on an NVIDIA GPU, smoke on CPU)
#   make test        unit, notebook (nbval) and build checks
#
# Set-up: when the running Python already has everything hwlib needs (a GPU image without registry
# access, a conda env), it is used as it is with the checkout on PYTHONPATH; otherwise a local
# virtual environment .venv is built. TORCH_SPEC picks the torch build that goes into .venv:
# the default takes PyPI's (the CUDA build on Linux); CPU-only machines pass their CPU build,
# e.g. `make test TORCH_SPEC=torch==2.13.0`.

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch
RUN        ?= latest
ARGS       ?=

NEEDED := torch numpy scipy matplotlib tqdm papermill nbformat ipykernel ipywidgets pytest nbval
HAVE_ALL := $(shell $(PYTHON) -c "import $(shell echo $(NEEDED) | tr ' ' ',')" >/dev/null 2>&1 && echo yes)

ifeq ($(HAVE_ALL),yes)
PY := $(PYTHON)
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
SETUP_STAMP :=
else
PY := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.hwlib-setup
endif

# Keep load_inline and torch.compile build products inside the checkout, one place per machine.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions

.PHONY: setup reproduce test test-unit test-unit-late test-notebooks test-kernels test-browser lab table readme env clean

setup: $(SETUP_STAMP)

$(VENV)/.hwlib-setup: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	touch $@

reproduce: setup
	$(PY) -m hwlib.cli reproduce --run $(RUN) $(ARGS)

# Independent parts: `make test -j2` runs them side by side (CI does). The unit tests come in two
# parts so that two cores stay busy to the end: the subprocess-heavy runner tests start
# when the first of the two long suites ends.
UNIT_LATE := tests/test_integrity_cli.py
test: setup test-unit test-kernels test-notebooks test-unit-late test-browser

test-unit: setup
	$(PY) -m pytest -q tests --ignore=tests/test_browser.py $(addprefix --ignore=,$(UNIT_LATE))

test-unit-late: setup
	$(PY) -m pytest -q -p no:cacheprovider $(UNIT_LATE)

# The dashboards in a real browser: JupyterLab, notebook 98 run through Debian's Chromium (Playwright
# cannot download its own browser here). Screenshots land in outputs/browser/dashboard/screenshots/.
CHROMIUM ?= $(firstword $(wildcard /usr/lib/chromium/chromium) $(shell command -v chromium 2>/dev/null))
test-browser: setup
	@if [ -n "$(CHROMIUM)" ]; then \
	    HWLIB_CHROMIUM=$(CHROMIUM) HWLIB_BROWSER_OUTPUTS=$(CURDIR)/outputs/browser \
	        $(PY) -m pytest -q -p no:cacheprovider -rs tests/test_browser.py; \
	else echo "test-browser: SKIPPED: no Chromium found (Debian: apt-get install chromium); the dashboards were not tested in a browser"; fi

# JupyterLab on the checkout, opened at the notebooks (LAB_ARGS: e.g. --port=8899 --no-browser).
LAB_ARGS ?=
lab: setup
	@$(PY) -c "import jupyterlab" 2>/dev/null || { echo "make lab: JupyterLab is not installed for $(PY) (pip install jupyterlab)"; exit 1; }
	$(PY) -m jupyterlab --ServerApp.root_dir=$(CURDIR) --LabApp.default_url=/lab/tree/notebooks $(LAB_ARGS)

# nbval cannot inject parameters: the notebooks read HWLIB_PROFILE and HWLIB_RUN themselves.
test-notebooks: setup
	rm -rf outputs/nbval
	HWLIB_PROFILE=smoke HWLIB_RUN=outputs/nbval $(PY) -m pytest -q -p no:cacheprovider \
	    --nbval-lax --nbval-current-env notebooks

# Kernel sources (hwlib/kernels, shipped inside the package) are plain CUDA: they compile with nvcc
# alone, with their own headers, no torch headers, no GPU needed.
KERNELS_CU := $(wildcard hwlib/kernels/*.cu)
test-kernels:
	@test -n "$(KERNELS_CU)" || { echo "test-kernels: no hwlib/kernels/*.cu found"; exit 1; }
	@if command -v nvcc >/dev/null 2>&1; then \
	    out=$$(mktemp -d); \
	    for f in $(KERNELS_CU); do echo "nvcc -arch=sm_90 -c $$f"; \
	        nvcc -arch=sm_90 -c $$f -o $$out/$$(basename $$f .cu).o || { rm -rf $$out; exit 1; }; done; \
	    rm -rf $$out; \
	else echo "test-kernels: nvcc not on PATH, $(KERNELS_CU) not compiled"; fi

env: setup
	$(PY) -m hwlib.cli env

table: setup
	$(PY) -m hwlib.cli table --run $(RUN)

# Regenerate the README's reference table from outputs/reference/<gpu>/summary.json.
readme: setup
	$(PY) -m hwlib.cli readme

clean:
	rm -rf $(VENV) .torch_extensions outputs/nbval outputs/browser
