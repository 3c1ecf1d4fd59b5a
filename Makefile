# The two commands a user needs (see README): `make run` and `make test`.
SHELL := /bin/bash
CTL := .venv/control/bin
export PYTHONPATH := $(CURDIR)
export PIPELINE_MODEL_PYTHON := $(CURDIR)/.venv/model/bin/python
export PATH := $(CURDIR)/$(CTL):$(PATH)

.PHONY: setup run learn test test-all test-fast services-down airflow lock lock-gpu prod-stack prod-run prod-down

setup:            ## create/reuse the pinned control-plane and model-plane environments
	@bash scripts/setup_envs.sh

run: setup        ## set up, start local services, run the pipeline with DVC, print where things are
	@bash scripts/run_pipeline.sh

learn: setup      ## one learning cycle of the PI (params/learn.yaml, reasoning-free): trained, gated, promoted, tested on all 500
	@bash scripts/learn.sh

test: setup       ## set up and run the whole test suite (unit, integration with real services, DAG, notebooks)
	@bash scripts/run_tests.sh

test-all: setup   ## `make test` plus the whole DAG under `airflow dags test` and on the CeleryExecutor stack, and the UI browser test (~45 min more)
	@bash scripts/setup_browser.sh
	@PYTEST_MARKERS="slow or not slow" bash scripts/run_tests.sh

test-fast: setup  ## unit tests only (no services)
	@$(CTL)/python -m pytest -q

airflow: setup    ## start `airflow standalone` on loopback with this repo's DAGs; prints UI URL + login
	@$(CTL)/python -m pipeline services up airflow

lock-gpu: setup   ## re-resolve the GPU image's lock (requirements/gpu.in -> gpu.lock.txt) with uv; CHECK=1 only checks it is current
	@bash scripts/lock_gpu.sh $(if $(CHECK),--check)

services-down:    ## stop every local service this project started
	@$(CTL)/python -m pipeline services down all

prod-stack: setup ## the production executor on this host, no Docker: Postgres + Redis (Debian), S3 (moto), MLflow, Airflow CeleryExecutor with default + gpu workers
	@bash scripts/setup_prod_stack.sh
	@$(CTL)/python infra/local/prod_stack.py up

prod-run: prod-stack ## one DAG run on the production executor (Params as CONF='{"tasks": 1}'); prints where each task ran
	@$(CTL)/python infra/local/prod_stack.py dag-run --conf '$(or $(CONF),{})'

prod-down:        ## stop the production-executor stack (its data stays in .prod/)
	@$(CTL)/python infra/local/prod_stack.py down

