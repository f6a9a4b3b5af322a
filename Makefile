# Two entry points for a fresh machine (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test protos bench clean

$(BIN)/gpuledger: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

demo: $(BIN)/gpuledger
	$(BIN)/gpuledger up --demo

test: $(BIN)/gpuledger
	$(BIN)/pytest

protos: $(BIN)/gpuledger
	$(BIN)/gpuledger gen-protos

bench: $(BIN)/gpuledger
	$(BIN)/python -m bench.allocate_rtt
	$(BIN)/python -m bench.placement_quality
	rm -f /tmp/gpuledger-bench-1m.sqlite
	$(BIN)/python -m bench.make_log /tmp/gpuledger-bench-1m.sqlite --events 1000000
	$(BIN)/python -m bench.replay --log /tmp/gpuledger-bench-1m.sqlite
	$(BIN)/python -m bench.restart --log /tmp/gpuledger-bench-1m.sqlite --events 1000000
	rm -f /tmp/gpuledger-bench-1m.sqlite
	$(BIN)/python -m bench.archive --events 1000000 --retention 100000
	$(BIN)/python -m bench.append
	$(BIN)/python -m bench.publication_lag

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
