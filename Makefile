# featcache — install, demo, test, bench. Everything runs offline on CPU.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
CACHE   ?= cache
RUNS    ?= runs
DEMO_BACKBONES := --backbone efficientnet_lite0 --backbone efficientnet_lite1 --backbone efficientnet_lite2
DEMO_EXTRACT   := --dataset offline-digits $(DEMO_BACKBONES) --partition feature --per-class 10 --test-per-class 50 --image-size 64 --out $(CACHE)

.PHONY: install demo test test-fast bench clean

install: $(BIN)/featcache

$(BIN)/featcache: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip >/dev/null
	$(BIN)/pip install -e '.[dev]'
	@touch $@

demo: install
	$(BIN)/featcache extract $(DEMO_EXTRACT)
	$(BIN)/featcache info $$($(BIN)/featcache extract $(DEMO_EXTRACT) --json | $(BIN)/python -c 'import json,sys; print(json.load(sys.stdin)["cache"])')

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m 'not slow'

bench: install
	$(BIN)/python bench/extract.py

clean:
	rm -rf $(CACHE) $(RUNS) results .pytest_cache
