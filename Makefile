# Two commands do all the set-up on a fresh machine:
#   make test   create .venv, install moelab with its test tools, run the test suite
#   make demo   create .venv, install moelab, run the embedded demonstration
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.moelab-installed

.PHONY: test demo lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch pinned so that pip takes the CPU build on local disk (no multi-GB download)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,bench]"
	# compile the CPU kernels of the maps now rather than inside the first call
	$(PY) -c "from moelab.maps import _kernels; _kernels.main()"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check moelab tests
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/moelab demo

bench: $(STAMP)
	$(VENV)/bin/moelab bench maps

lint: $(STAMP)
	$(PY) -m ruff check moelab tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
