# Two set-up commands on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEVSTAMP:= $(VENV)/.installed-dev
OUT     ?= out

.PHONY: install install-dev demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $@

$(DEVSTAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(STAMP)

install-dev: $(DEVSTAMP)

demo: $(STAMP)
	$(BIN)/kvroute demo --out $(OUT)

test: $(DEVSTAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	mkdir -p $(OUT)
	$(BIN)/kvroute bench routing --json $(OUT)/bench-routing.json
	$(BIN)/kvroute bench sim-speed --json $(OUT)/bench-sim-speed.json
	$(BIN)/kvroute bench gateway --json $(OUT)/bench-gateway.json

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache
