# specgate: speculative decoding behind Triton. `make serve` and `make test` are all a new user needs.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
ENGINE ?= cpu
DTYPE ?= auto
SPEC ?= build/specs/smollm2-eagle.yaml
SMOKE_SPEC ?= build/specs/smollm2-ngram.yaml
STAMP := $(VENV)/.installed
# the optional dependencies make setup installs (the image's: none)
EXTRAS ?= dev

SOAK_S ?= 600

SCENARIO ?= all
USERS ?= 4
DURATION ?= 60s

.PHONY: setup build-engines serve lint test test-unit soak bench bench-baseline bench-engine bench-routes bench-perplexity bench-curve bench-gate bench-batching bench-front bench-report loadtest train-eagle image image-test gpu-smoke clean

setup: $(STAMP)  ## create .venv and install everything (idempotent)
	@PATH="$$PATH:/usr/sbin" command -v haproxy >/dev/null && command -v prometheus >/dev/null || \
	  echo "[setup] make serve REPLICAS=N and its tests need HAProxy and Prometheus: apt-get install haproxy prometheus (as root)"

$(STAMP): pyproject.toml build/install_llamacpp.py build/llamacpp_patch.py $(wildcard build/llamacpp_kernels/*)
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	$(VPY) build/install_llamacpp.py
	@touch $(STAMP)

build-engines: setup  ## ENGINE=cpu (default, llama.cpp; MODEL=any chat GGUF, DRAFT=its draft GGUF; EXACT=0 turns exact greedy off; STREAM_INTERVAL_MS=20 a fixed streaming interval, 0 = every token; unset, the engine measures what a response costs and streams within STREAM_COST_BUDGET=0.05 of decode time) | torch (the PyTorch reference; DTYPE=auto|float32|bfloat16) | trtllm
ifeq ($(ENGINE),trtllm)
	$(VPY) -m build.build_engines --engine trtllm --spec $(SPEC) $(if $(DRY_RUN),--dry-run)
else
	$(VPY) -m build.build_engines --engine $(ENGINE) --dtype $(DTYPE) $(if $(MODEL),--model $(MODEL)) $(if $(DRAFT),--draft $(DRAFT)) $(if $(filter 0 false no,$(EXACT)),--no-exact) $(if $(STREAM_INTERVAL_MS),--stream-interval-ms $(STREAM_INTERVAL_MS)) $(if $(STREAM_COST_BUDGET),--stream-cost-budget $(STREAM_COST_BUDGET)) $(if $(CALIBRATION_PATH),--calibration-path $(CALIBRATION_PATH))
endif

serve: build-engines  ## start tritonserver on :8000 (HTTP) :8001 (gRPC) :8002 (metrics) and the OpenAI-compatible front on :9000 (FRONT_PORT=); REPLICAS=N: N of them behind HAProxy with a Prometheus (docs/deploy.md)
ifdef REPLICAS
	$(VPY) -m specgate_deploy --replicas $(REPLICAS)
else
	$(VPY) -m specgate_deploy.serve
endif

lint: setup  ## ruff: lint and import order
	$(VPY) -m ruff check .

test: build-engines  ## unit + sweeps + integration tests (starts its own tritonserver on ports 18000-18002); PYTEST_ARGS= passes more
	$(VPY) -m pytest -q $(PYTEST_ARGS)

test-unit: setup  ## the unit tier alone (no server, no long sweeps): the inner loop, under 3 minutes
	$(VPY) -m pytest -q tests/unit $(PYTEST_ARGS)

soak: build-engines  ## SOAK_S seconds (600) of mixed traffic, cancellations and policy reloads against a test server; prints the figures
	SPECGATE_SOAK_S=$(SOAK_S) $(VPY) -m pytest -q -s tests/integration/test_gate_soak.py

bench-baseline: build-engines  ## engine in-process vs through Triton vs transformers generate
	$(VPY) -m bench.baseline

bench-engine: build-engines  ## speculative algorithms: acceptance, accepted/step, TPOT, speedup, memory
	$(VPY) -m bench.engine

bench-curve: build-engines  ## the verification cost curve: exact mode's kernels against the earlier exact mode's and upstream's, alternated in one process
	$(VPY) -m bench.curve $(if $(GGUF),--gguf $(GGUF))

bench-routes: build-engines  ## per prompt category through Triton: the default route against speculation off and a clean llama-cpp-python process
	$(VPY) -m bench.served_routes

bench-perplexity: build-engines  ## perplexity on held-out text of the shipped GGUF and of Q4_0 / Q8_0 made from it (needs the [train] extra)
	$(VPY) -m bench.perplexity

bench-gate: build-engines  ## gate decision latency and end-to-end overhead
	$(VPY) -m bench.gate

bench-batching: build-engines  ## batched vs unbatched baseline vs speculative at concurrency 1-8
	$(VPY) -m bench.batching

bench-front: build-engines  ## TPOT through the OpenAI-compatible front vs llm over gRPC, paired
	$(VPY) -m bench.front

bench-report: build-engines  ## concurrency sweep through a real server + one Markdown/PNG report of all results
	$(VPY) -m bench.report

bench: bench-baseline bench-engine bench-routes bench-curve bench-gate bench-batching bench-front bench-report  ## everything, then results/report/

loadtest: setup  ## Locust against a running server (make serve): SCENARIO=all|baseline|speculative|gated|mixed-temperature USERS= DURATION=
	$(VPY) -m loadtest.run --scenario $(SCENARIO) --users $(USERS) --duration $(DURATION)

train-eagle: build-engines  ## train the EAGLE head on CPU (resumes; never run in CI)
	$(VPY) -m pip install --quiet -e '.[train]'
	$(VPY) -m build.train_eagle $(TRAIN_ARGS)

image:  ## the CPU image (deploy/Dockerfile), built with podman from Debian's packages (no registry); prints its size and build time. Needs podman (as root once: python3 build/image.py setup)
	$(PY) build/image.py build

image-test:  ## make image, then run it read-only as the pod does, on IMAGE_TEST_PORT=48000 (HTTP; +1 gRPC, +2 metrics, +9 front), talk to it, stop it
	$(PY) build/image_test.py

gpu-smoke:  ## on a GPU machine with TensorRT-LLM (see docs/trtllm.md); never run here
	$(VPY) -m build.gpu_smoke --spec $(SMOKE_SPEC)

clean:  ## remove build outputs (keeps downloads)
	rm -rf artifacts/model_repository artifacts/engines artifacts/test-*
