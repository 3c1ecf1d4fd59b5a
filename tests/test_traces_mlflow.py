"""Rollout traces appear as MLflow traces (real tracking server)."""

from __future__ import annotations

import pytest

from pipeline.traces.mlflow_traces import log_traces
from pipeline.traces.schema import Span, Trace


@pytest.mark.slow
def test_rollout_trace_becomes_an_mlflow_span_tree(mlflow_server: str) -> None:
    import mlflow

    mlflow.set_tracking_uri(mlflow_server)
    mlflow.set_experiment("trace-view")
    trace = Trace(run_id="t1", shard=0, task_id="123", rollout_id="123-0", status="ok", label="yes", decision="GO", reward=0.6,
                  latency_s=3.0, spans=[
                      Span(kind="llm", name="geneticist", seq=0, data={"agent": "geneticist", "logical_model": "junior_researcher",
                                                                        "messages": [{"role": "user", "content": "q"}], "output": "{}", "latency_s": 1.0}),
                      Span(kind="tool", name="search_literature", seq=1, data={"sender": "geneticist", "args": {"query": "p53"}, "result": "PMID 1", "ok": True}),
                      Span(kind="decision", name="supervisor", seq=2, data={"candidates": ["geneticist"], "chosen": 0, "propensity": 0.9}),
                      Span(kind="reward", name="final", seq=3, data={"value": 0.6, "kind": "final", "reason": "ok"})])
    assert len(log_traces([trace.model_dump()])) == 1
    mlflow.flush_trace_async_logging() if hasattr(mlflow, "flush_trace_async_logging") else None
    found = mlflow.search_traces(return_type="list", filter_string="tags.`pipeline.run_id` = 't1'")
    assert len(found) == 1
    names = [s.name for s in found[0].data.spans]
    assert names[0] == "rollout 123-0" and {"llm:geneticist", "tool:search_literature", "decision:supervisor", "reward:final"} <= set(names)
