# Two entry points for a fresh machine (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test protos bench lock clean

# make bench runs every benchmark: 10 to 16 minutes on a 2-vCPU machine, depending on the machine
# (docs/benchmarks.md, thirty-second and thirty-third rounds). The fleet benchmark runs its 50
# leaf brokers with 2,000 events each there; `make bench FLEET_EVENTS=10000` is its full size (500,000 events,
# about 7 more minutes). `bench.replay --formats 1,2` adds the old log format's figures.
FLEET_EVENTS ?= 2000

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
	$(BIN)/python -m bench.allocator_cpu
	$(BIN)/python -m bench.footprint
	$(BIN)/python -m bench.placement_quality
	$(BIN)/python -m bench.dra_prepare
	$(BIN)/python -m bench.log_size
	rm -f /tmp/gpuledger-bench-1m.sqlite /tmp/gpuledger-bench-1m.sqlite-wal /tmp/gpuledger-bench-1m.sqlite-shm
	$(BIN)/python -m bench.make_log /tmp/gpuledger-bench-1m.sqlite --events 1000000
	$(BIN)/python -m bench.replay --log /tmp/gpuledger-bench-1m.sqlite --formats 2
	$(BIN)/python -m bench.restart --log /tmp/gpuledger-bench-1m.sqlite --events 1000000
	$(BIN)/python -m bench.archive --events 1000000 --retention 100000 --from-log /tmp/gpuledger-bench-1m.sqlite
	rm -f /tmp/gpuledger-bench-1m.sqlite /tmp/gpuledger-bench-1m.sqlite-wal /tmp/gpuledger-bench-1m.sqlite-shm
	$(BIN)/python -m bench.append
	$(BIN)/python -m bench.publication_lag
	$(BIN)/python -m bench.fleet --nodes 50 --events $(FLEET_EVENTS)

# deploy/requirements.lock: the image's Python packages (pyproject's dependencies and the build backend)
# pinned with hashes for deploy/Dockerfile's Python. Existing pins are kept while they still satisfy
# pyproject.toml; `make lock UPGRADE=--upgrade` moves every pin to the newest release.
lock: $(BIN)/gpuledger
	$(BIN)/pip install --quiet --disable-pip-version-check uv
	$(BIN)/uv pip compile --quiet pyproject.toml deploy/build-requirements.in $(UPGRADE) --generate-hashes \
		--python-version 3.12 --python-platform linux --custom-compile-command "make lock" \
		-o deploy/requirements.lock

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
