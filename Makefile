# People and CI use the same targets. `make up` and `make test` create .venv on first use.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: up test lint docs docs-build fmt test-only test-slow fuzz-quick fuzz bench bench-peers bench-routing bench-cli conformance reliability soak install clean proto

# The fuzz runs happen in a network namespace of their own with only loopback up, so no URL the
# fuzzer makes up (callbacks, agent addresses) can send a packet off this machine.
NETNS := unshare --net --map-root-user sh -c 'ip link set lo up && exec "$$@"' netns

$(STAMP): pyproject.toml constraints.txt
	@echo "installing agent-reach into $(VENV), ~130 packages, 0.9 GB (first run or dependencies changed; 30 s on 2 cores, plus the download the first time pip fetches them) ..."
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $(STAMP)
	@echo "installed."

install: $(STAMP)

up: $(STAMP)
	$(BIN)/reach up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The docs site (mkdocs.yml). `make docs` serves it with live reload on DOCS_PORT (default: a free
# port, printed); `make docs-build` builds it into site/ with --strict, so a broken link fails.
DOCS_PORT ?= $(shell $(PY) -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# Material 9.7+ prints a banner about MkDocs 2.0 on every run; it says nothing about this site.
DOCS_ENV := NO_MKDOCS_2_WARNING=1

docs: $(STAMP)
	$(DOCS_ENV) $(BIN)/mkdocs serve --dev-addr 127.0.0.1:$(DOCS_PORT)

docs-build: $(STAMP)
	$(DOCS_ENV) $(BIN)/mkdocs build --strict --quiet

# Regenerate the committed protobuf modules after editing protos/agent_reach_proto/*.proto.
proto: $(STAMP)
	PYTHON=$(BIN)/python protos/generate.sh

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: lint docs-build test-only

# Three workers, each with its own Temporal dev server; whole files per worker, so a module's
# gateway fixture starts once. In collection order (integration, then the quick unit files),
# not xdist's default of the files with the most tests first: that leaves the files of a few
# long tests (fault outcomes, recovery, supervision, `reach up`) for the end, where one worker
# can be left finishing them alone. `make test-only XDIST=` runs serially. Each worker hands
# out ports from its own range below the kernel's ephemeral one (tests/conftest.py), so a
# port-0 bind never takes a port given to a server that has not bound it yet.
XDIST ?= -n 3 --dist loadfile --no-loadscope-reorder

test-only: $(STAMP)
	$(BIN)/pytest $(XDIST) -m "not slow"
	@$(MAKE) --no-print-directory fuzz-quick

# The slow tests: long real-time waits whose behaviour a faster test in `make test` also covers.
test-slow: $(STAMP)
	$(BIN)/pytest $(XDIST) -m slow

# Schemathesis over the gateway's OpenAPI against a real stack: bounded here, longer in `fuzz`.
fuzz-quick: $(STAMP)
	FUZZ_EXAMPLES=25 $(NETNS) $(BIN)/pytest tests/fuzz -q

fuzz: $(STAMP)
	FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-300} $(NETNS) $(BIN)/pytest tests/fuzz -q -s

# Every row, the production ones included; the Restate peer row too once bench-peers installed
# its server. ARGS='--runs 2' (same-run ratios), ARGS="--only 'row;row'".
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[bench]'
	$(BIN)/python bench/invoke.py $(ARGS)

# The same with the peer row: Restate's server from npm (a 225 MB binary, under .reach/peers,
# no lock file kept; its install scripts are not run) and its Python SDK. docs/benchmarks.md.
bench-peers: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[bench,peers]'
	npm install --no-save --no-audit --no-fund --ignore-scripts --no-package-lock \
		--prefix .reach/peers @restatedev/restate-server@1.7.12
	$(BIN)/python bench/invoke.py --peers on $(ARGS)

# Routing: the seed's outage per strategy, remap, skew, pick time, heartbeat ingest, memory.
bench-routing: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[bench]'
	$(BIN)/python bench/routing.py $(ARGS)

# CLI start-up: `reach --help`, `reach agents`, `reach trace` in fresh processes (issue 26);
# ARGS='--before /tmp/cli-before' compares with a worktree of earlier code.
bench-cli: $(STAMP)
	$(BIN)/python bench/cli_start.py $(ARGS)

# The MCP conformance suite (npm, Node 22+ from the dev extra) against the MCP front of a real
# stack, both spec versions; failures must be the listed ones (tests/conformance/). Not in
# `make test`: it downloads the suite and takes about a minute.
conformance: $(STAMP)
	$(BIN)/python tests/conformance/run_mcp.py $(ARGS)

# Fault injection with a ledger (issue 25, docs/reliability.md): 1,000 mixed requests over every
# SDK protocol through two gateways, a worker, Redis and Temporal of its own while each is
# SIGKILLed; prints the Markdown table, exits 1 if an invariant broke. Its short version
# (tests/reliability/test_reliability_short.py, ~45 s) runs in `make test`. ARGS='--requests N'.
reliability: $(STAMP)
	$(BIN)/python -m tests.reliability.run $(ARGS)

# 10 minutes at 80% of the maximum rate it measures first (ARGS='--rate R --duration S').
soak: $(STAMP)
	$(BIN)/python -m tests.reliability.run --soak $(ARGS)

clean:
	rm -rf $(VENV) .reach .mypy_cache .ruff_cache .pytest_cache .hypothesis
