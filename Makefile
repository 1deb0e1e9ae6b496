# Two commands for a newcomer: `make demo` (the main job) and `make test`.
# Each creates or refreshes the local virtual environment .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch 2.13.0, the release the results were measured with. Here the local wheels hold its CPU
# build; from PyPI on Linux it is the multi-GB CUDA build, so elsewhere take torch's CPU index:
#   make venv TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: venv demo minibatch fullbatch test fuzz docs compat sdist lint bench clean

# The install also compiles the CPU kernel (setup.py), so editing _dots.c reinstalls.
$(STAMP): pyproject.toml setup.py aadl_func/_src/_dots.c Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,examples,dev,docs]"
	touch $(STAMP)

venv: $(STAMP)

# The plot is also written to docs/images/, where the README and the site show it.
demo: $(STAMP)
	$(PY) examples/digits_demo.py --figure docs/images/digits_demo.png

# Minibatch Adam / SGD-momentum vs Anderson acceleration on held-out accuracy (a few minutes).
minibatch: $(STAMP)
	$(PY) examples/minibatch.py

# The full-batch suite (benchmarks/fullbatch): seven problems, the peers and AA tuned alike, 3
# seeds (about 30 minutes on two cores); results.json there and the page docs/fullbatch.md.
# FULLBATCH_ARGS: e.g. --quick, --problems softmax,rosenbrock, --recompute-f-star.
FULLBATCH_ARGS ?= --markdown docs/fullbatch.md
fullbatch: $(STAMP)
	$(PY) -m benchmarks.fullbatch.run $(FULLBATCH_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

# The long run of tests/test_fuzz.py (odd leaves and tampered states; `make test` runs a sample
# of 40 examples per test): FUZZ_EXAMPLES examples per test, the outcome counts printed.
FUZZ_EXAMPLES ?= 2000
fuzz: $(STAMP)
	AADL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s tests/test_fuzz.py

# The documentation site (mkdocs + mkdocstrings, API pages from the docstrings) into site/,
# strict: a broken link or a docstring that does not match its signature fails the build.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict -d site

# The suite against the oldest torch (with the oldest optree) pyproject.toml allows and the
# newest (with the newest optree) the index serves, each in its own venv under COMPAT_DIR (kept
# for the next run; PyPI's CUDA builds, ~6 GB each), and a table of the results. COMPAT_ARGS: releases and/or pytest arguments (scripts/compat.py).
COMPAT_DIR ?= .compat
compat:
	$(PYTHON) scripts/compat.py --venvs "$(COMPAT_DIR)" $(COMPAT_ARGS)

# The sdist built from a clean copy, installed into a fresh venv (which reuses .venv's
# dependencies: nothing is downloaded) and the whole suite run from it (scripts/sdist_check.py).
sdist: $(STAMP)
	$(PY) scripts/sdist_check.py

lint: $(STAMP)
	$(PY) -m ruff check aadl_func tests examples scripts benchmarks
	$(PY) -m ruff format --check aadl_func tests examples scripts benchmarks

bench: $(STAMP)
	$(PY) examples/benchmark.py --markdown docs/benchmark_results.md

clean:
	rm -rf $(VENV) runs bench_results site
