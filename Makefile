# Two set-up commands on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEVSTAMP:= $(VENV)/.installed-dev
OUT     ?= out

.PHONY: install install-dev demo lint test bench fidelity clean

# held to mypy --strict: the pure layers and the gateway's protocols
STRICT  := src/kvroute/model src/kvroute/prefix src/kvroute/policy src/kvroute/gateway/breaker.py \
           src/kvroute/gateway/http.py src/kvroute/gateway/upstream.py
COV_MIN ?= 75

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[sim]'
	touch $@

$(DEVSTAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[sim,dev]'
	touch $@

install: $(STAMP)

install-dev: $(DEVSTAMP)

demo: $(STAMP)
	$(BIN)/kvroute demo --out $(OUT)

lint: $(DEVSTAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/mypy --strict --follow-imports=silent $(STRICT)

test: lint
	$(BIN)/python -m pytest --cov --cov-report=term:skip-covered --cov-fail-under=$(COV_MIN)

bench: $(STAMP)
	mkdir -p $(OUT)
	$(BIN)/kvroute bench routing --json $(OUT)/bench-routing.json
	$(BIN)/kvroute bench sim-speed --json $(OUT)/bench-sim-speed.json
	$(BIN)/kvroute bench gateway --json $(OUT)/bench-gateway.json
	$(BIN)/kvroute bench hostile --json $(OUT)/bench-hostile.json

# issue 12: three llama-servers live through the gateway vs simulate (calibrates them first);
# every policy FIDELITY_REPEATS times, interleaved, reported as medians with their spread
FIDELITY_REPEATS ?= 3
fidelity: $(DEVSTAMP)
	mkdir -p $(OUT)
	$(BIN)/python -m tests.llamacpp.fidelity --json $(OUT)/bench-fidelity.json -- --repeats $(FIDELITY_REPEATS)

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache
