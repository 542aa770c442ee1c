# `make serve` and `make test` each set up everything they need on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
REPO := examples/model_repository
HOST ?= 127.0.0.1
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002

.PHONY: serve test examples lint format bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[examples,test]'
	touch $(STAMP)

examples: $(STAMP)
	$(PY) examples/build.py

serve: examples
	$(PY) -m pdserve serve --model-repository $(REPO) --host $(HOST) --http-port $(HTTP_PORT) \
		--grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy pdserve

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: examples lint
	$(PY) -m pytest -q

bench: examples
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(REPO) examples/goldens
