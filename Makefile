# Two commands do all the set-up on a fresh machine:
#   make test   create .venv, install moelab with its test tools, run the test suite
#               (all but the multi-rank tests, which `make test-multiprocess` runs)
#   make demo   create .venv, install moelab, get the default corpus, run the demonstration
#               (the sparse-maps study at the cpu scale: four maps trained, swept over K
#               and reported in demo/report.md; about 3 minutes on 2 quiet cores)
PYTHON ?= python3
# the default corpus: the Python documentation's reST sources, from Debian's python3-doc
CORPUS := /usr/share/doc/python3/html/_sources
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.moelab-installed
# installed without their dependencies, at the versions of constraints.txt
ENGINES_NODEPS := torchtitan ai2-olmo-core cached-path triton
# what the engine modules moelab imports need of those dependencies
ENGINES_DEPS := torchdata torch_checkpointing tyro einops spmd_types dataclass-extensions \
                bettermap importlib_resources google-cloud-storage boto3

.PHONY: test test-multiprocess demo corpus lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch pinned so that pip takes the CPU build on local disk (no multi-GB download)
	$(PY) -m pip install --quiet torch==2.13.0
	# the versions the suite is checked against (constraints.txt)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,bench,data,hf,eval,track]"
	# the training engines' bridges (docs/engines.md): torchtitan asks for datasets<4.8 and
	# OLMo-core's cached-path for huggingface_hub<2, which the harness's versions exclude,
	# and the engine modules moelab imports use neither; so these come without their
	# declared dependencies, then the ones those modules do import
	$(PY) -m pip install --quiet -c constraints.txt --no-deps $(ENGINES_NODEPS)
	$(PY) -m pip install --quiet -c constraints.txt $(ENGINES_DEPS)
	@echo "(pip's dependency conflicts above for torchtitan, ai2-olmo-core and cached-path are expected: see the Makefile)"
	# compile the CPU kernels of the maps now rather than inside the first call
	$(PY) -c "from moelab.maps import _kernels; _kernels.main()"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check moelab tests
	$(PY) -m pytest -q -m "not multiprocess"

# the tests that start several ranks (DDP, FSDP2, expert parallelism over gloo): about
# 3 minutes on 2 cores; CI (.ci/run) runs them after `make test`
test-multiprocess: $(STAMP)
	$(PY) -m pytest -q -m multiprocess

demo: $(STAMP) corpus
	$(VENV)/bin/moelab demo

corpus:
	@test -d $(CORPUS) || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq python3-doc; \
	  else echo "the default corpus is missing: run 'sudo apt-get install python3-doc'"; fi; }

bench: $(STAMP)
	$(VENV)/bin/moelab bench maps

lint: $(STAMP)
	$(PY) -m ruff check moelab tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
