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
	$(BIN)/python -m bench.replay
	$(BIN)/python -m bench.placement_quality

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
