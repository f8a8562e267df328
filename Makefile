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
	$(BIN)/pip install -e '.[dev]'
	@touch $@

DEMO_CACHE = $$($(BIN)/featcache extract $(DEMO_EXTRACT) --json | $(BIN)/python -c 'import json,sys; print(json.load(sys.stdin)["cache"])')

demo: install
	$(BIN)/featcache extract $(DEMO_EXTRACT)
	$(BIN)/featcache info $(DEMO_CACHE)
	$(BIN)/featcache train --cache $(DEMO_CACHE) --algo fedpcl --algo fedproto --algo fedavg --rounds 50 --seeds 0,1,2 --out $(RUNS)

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m 'not slow'

bench: install
	$(BIN)/python bench/extract.py
	$(BIN)/python bench/train.py
	$(BIN)/python bench/grid.py

clean:
	rm -rf $(CACHE) $(RUNS) results .pytest_cache
