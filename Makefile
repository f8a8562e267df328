# featcache — install, demo, test, bench. Everything runs offline on CPU.
PY      ?= python3
VENV    ?= .venv
# the torch/torchvision pair of .ci/torch-$(TORCH).txt: newest (default) or oldest; CI tests both ends
TORCH   ?= newest
BIN     := $(VENV)/bin
CACHE   ?= cache
RUNS    ?= runs
DEMO_BACKBONES := --backbone efficientnet_lite0 --backbone efficientnet_lite1 --backbone efficientnet_lite2
DEMO_EXTRACT   := --dataset offline-digits $(DEMO_BACKBONES) --partition feature --per-class 10 --test-per-class 50 --image-size 64 --out $(CACHE)
DEMO_TRAIN     := --algo fedpcl --algo fedproto --algo fedavg --rounds 50 --seeds 0,1,2

.PHONY: install demo test test-fast test-oldest check bench gpu-check clean reproduce reproduce-quick docs docs-results algos-table

install: $(BIN)/featcache

$(BIN)/featcache: pyproject.toml .ci/torch-$(TORCH).txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -e '.[dev]' -c .ci/torch-$(TORCH).txt
	@touch $@

DEMO_CACHE = $$($(BIN)/featcache extract $(DEMO_EXTRACT) --json | $(BIN)/python -c 'import json,sys; print(json.load(sys.stdin)["cache"])')

demo: install
	$(BIN)/featcache extract $(DEMO_EXTRACT)
	$(BIN)/featcache info $(DEMO_CACHE)
	$(BIN)/featcache train --cache $(DEMO_CACHE) $(DEMO_TRAIN) --out $(RUNS)

# Tests run in one worker per core (pytest-xdist); a module's tests stay in one worker, which holds its fixtures.
PARALLEL = -n auto --dist loadfile

test: install
	$(BIN)/python -m pytest -q $(PARALLEL)

# The code's own checks: the floors (import-linter contracts in pyproject.toml), ruff's lint and format, mypy on the
# engine kit, the algorithms, the runs, the Flower apps and featcache.testing
check: install
	$(BIN)/lint-imports
	$(BIN)/ruff check featcache tests bench docs/hooks.py
	$(BIN)/ruff format --check featcache tests bench docs/hooks.py
	$(BIN)/mypy

test-fast: install
	$(BIN)/python -m pytest -q -m 'not slow'

# CI's run on the oldest torch/torchvision pair: the tests of the code that calls torch, torchvision and timm most
# directly (the engine and every algorithm's step through it, graph capture, the memory estimate, backbones, extraction)
OLDEST_TESTS := tests/test_engine.py tests/test_capture.py tests/test_footprint.py tests/test_memory.py \
	tests/test_optim.py tests/test_hook_order.py tests/test_backbones.py tests/test_extract.py \
	tests/test_embedding_identity.py tests/test_checkpoint.py
test-oldest: install
	$(BIN)/python -m pytest -q $(PARALLEL) -m 'not slow' $(OLDEST_TESTS)

# Reproduction of the seed papers' tables and figures: one target per pipelines/NAME.toml, writing
# $(RESULTS)/NAME.md (ours beside the paper's numbers) and NAME.png for figures. Single targets use the papers'
# settings (PROFILE=full); DATA=folder DATASET=name BACKBONES="spec spec ..." run them on the real data.
# reproduce-quick / reproduce run every target, JOBS at a time with THREADS torch threads each.
RESULTS   ?= results
PROFILE   ?= full
JOBS      ?= 2
THREADS   ?= 1
PIPELINES := $(sort $(basename $(notdir $(wildcard pipelines/*.toml))))
REPRODUCE_ARGS = --profile $(PROFILE) --out $(RESULTS) --cache $(CACHE) $(if $(DATA),--data-root $(DATA)) \
                 $(if $(DATASET),--dataset $(DATASET)) $(foreach b,$(BACKBONES),--backbones $(b))

.PHONY: $(PIPELINES)
$(PIPELINES): install
	$(BIN)/featcache reproduce pipelines/$@.toml $(REPRODUCE_ARGS)

reproduce-quick: install
	OMP_NUM_THREADS=$(THREADS) $(MAKE) --no-print-directory -k -j$(JOBS) --output-sync=target $(PIPELINES) PROFILE=quick
	$(BIN)/featcache info $(CACHE)/store

reproduce: install
	OMP_NUM_THREADS=$(THREADS) $(MAKE) --no-print-directory -k -j$(JOBS) --output-sync=target $(PIPELINES) PROFILE=full
	$(BIN)/featcache info $(CACHE)/store

# The documentation site in site/, offline; --strict: a broken link or reference fails. Installs the docs extra into
# the venv when mkdocs is missing.
docs: install
	@$(BIN)/python -c 'import mkdocs, material, mkdocstrings, mkdocs_include_markdown_plugin' 2>/dev/null || \
		$(BIN)/pip install -e '.[dev,docs]' -c .ci/torch-$(TORCH).txt
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The results snapshot the docs show (commit it): reproduce-quick's tables and figures copied into docs/results/quick/.
docs-results: reproduce-quick
	mkdir -p docs/results/quick
	cp $(RESULTS)/*.md $(RESULTS)/*.png docs/results/quick/

# featcache/algorithms/README.md's registry table, regenerated between its algos:begin/end markers from
# `featcache algos --markdown` (tests/test_docs.py fails when the committed table is stale).
ALGOS_README := featcache/algorithms/README.md
algos-table: install
	{ sed '/<!-- algos:begin -->/q' $(ALGOS_README); echo; $(BIN)/featcache algos --markdown; echo; \
	  sed -n '/<!-- algos:end -->/,$$p' $(ALGOS_README); } > $(ALGOS_README).tmp && mv $(ALGOS_README).tmp $(ALGOS_README)

bench: install
	$(BIN)/python bench/extract.py
	$(BIN)/python bench/train.py --demo-cache $(DEMO_CACHE) --demo-train '$(DEMO_TRAIN)'
	$(BIN)/python bench/uneven.py
	$(BIN)/python bench/grid.py
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/threads.py
	$(BIN)/python bench/clients.py
	$(BIN)/python bench/store_scale.py

# For a GPU owner: every test marked `gpu` and the three benchmarks on CUDA, their JSON printed; one line and
# success where no CUDA GPU is present.
gpu-check: install
	@if $(BIN)/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then \
		$(BIN)/python -m pytest -q -m gpu && \
		$(BIN)/python bench/extract.py --device cuda && \
		$(BIN)/python bench/train.py --device cuda && \
		$(BIN)/python bench/grid.py --device cuda; \
	else \
		echo "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False): nothing checked"; \
	fi

clean:
	rm -rf $(CACHE) $(RUNS) $(RESULTS) .pytest_cache site
