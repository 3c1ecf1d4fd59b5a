#!/usr/bin/env bash
# The whole suite: unit tests, integration tests that start real services on loopback (MLflow,
# vLLM, LiteLLM proxy, Airflow, moto S3), DAG integrity, notebooks. `pytest` alone runs only the
# fast ones. Called by `make test` and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/control/bin/python -m pytest -m "slow or not slow" -p no:cacheprovider "$@"
