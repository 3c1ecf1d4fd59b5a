#!/usr/bin/env bash
# The whole suite: unit tests, integration tests that start real services on loopback (MLflow,
# vLLM, LiteLLM proxy, Airflow, moto S3), DAG integrity, notebooks. `pytest` alone runs only the
# fast ones. Called by `make test` and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
# Lint and types first (seconds): pipeline/, dags/ and infra/local/ must be clean (config in pyproject.toml).
.venv/control/bin/ruff check pipeline dags infra/local
# mypy's incremental cache lives beside the cached venvs, outside the checkout: a fresh clone (CI) checks in seconds
# instead of ~1.5 min; mypy itself invalidates it on a change of code, options or mypy version.
MYPY_CACHE_DIR="${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pubmedqa-society/mypy}" .venv/control/bin/mypy
# `make test` (and CI) leave out the e2e marker (whole-loop runs through Airflow, the prod stack, a killed shard):
# `make test-all` adds it.
# The host's speed before and after (the same suite took 21 and 38 min at two hours): read a suite's time with it.
host() { PYTHONPATH=. .venv/control/bin/python benchmarks/bench_host.py --line || true; }
host
status=0
.venv/control/bin/python -m pytest -m "${PYTEST_MARKERS:-(slow or not slow) and not e2e}" -p no:cacheprovider --durations=15 "$@" || status=$?
host
exit "$status"
