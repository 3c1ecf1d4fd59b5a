"""Local services of the embedded default (MLflow, vLLM workers, LiteLLM proxy, Airflow).

Each runs detached in its own process group with a pid file and a log under ``serving.home`` so
that any later command (or a test's teardown) can find and stop the whole group.
"""
