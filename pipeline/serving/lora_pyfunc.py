"""MLflow models-from-code entry point of a LoRA version: the adapter, answered by a vLLM worker.

``registry.register_adapter`` logs this file as the model's code and the adapter folder as the artifact
``adapter``, so a LoRA version is an MLflow pyfunc model: ``mlflow.pyfunc.load_model("models:/<role>@champion",
model_config={"base_url": "http://<worker>:8000"})`` works from any directory with the control plane's
packages (mlflow and the standard library: no torch, nothing from this repository). A 135M-to-8B adapter is
not something the control plane can run itself; what it can do is hand the adapter to the engine that
serves its base model, which is how the pipeline serves it too (``serving.deploy.deploy``). ``predict`` takes
rows of chat ``messages`` and returns the adapter's answers.

The worker must see the artifact's path (a worker on this host, or a shared volume) and serve the base
model the adapter was trained on; its key, if it has one, comes from the environment variable named by
``api_key_env`` (never from the model config, which MLflow logs). The pipeline itself never loads LoRA
versions this way: ``serving.deploy.deploy`` checks the digest and hot-loads the same folder.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel

# logged as the model's config: MLflow lets load_model(model_config=...) override only keys the logged config has
DEFAULTS = {"base_url": "", "api_key_env": "VLLM_API_KEY", "adapter_name": "adapter", "max_tokens": 256, "temperature": 0.0,
            "timeout_s": 120.0, "retries": 2}


class LoraAdapterModel(PythonModel):
    """Rows of ``messages`` (OpenAI chat format) -> the adapter's answer to each, from a vLLM worker that has it loaded."""

    def load_context(self, context: Any) -> None:
        cfg = {**DEFAULTS, **(context.model_config or {})}
        self.adapter = str(Path(context.artifacts["adapter"]).resolve())
        self.base_url = str(cfg["base_url"] or os.environ.get("LORA_WORKER_URL") or "").rstrip("/")
        if not self.base_url:
            raise ValueError("a LoRA version is answered by a vLLM worker serving its base model: pass "
                             "model_config={'base_url': 'http://host:port'} to mlflow.pyfunc.load_model (or set LORA_WORKER_URL)")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {self.base_url!r}: an http(s) URL of a vLLM worker")
        self.name = str(cfg["adapter_name"] or "adapter")
        self.key = os.environ.get(str(cfg["api_key_env"]), "")
        self.max_tokens, self.temperature = int(cfg["max_tokens"]), float(cfg["temperature"])
        self.timeout_s, self.retries = float(cfg["timeout_s"]), int(cfg["retries"])
        self.loaded = False

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One request with a timeout; a connection error or a 5xx is retried ``retries`` times with backoff."""
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {})}
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            url = f"{self.base_url}{path}"  # http(s) only: load_context refuses any other scheme
            request = urllib.request.Request(url, data=data, headers=headers, method=method)  # noqa: S310 - scheme checked
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:  # noqa: S310 - scheme checked
                    text = resp.read().decode()
                    return json.loads(text) if text.strip().startswith(("{", "[")) else text
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:300]
                if exc.code < 500 or attempt == self.retries:
                    raise RuntimeError(f"{url}: HTTP {exc.code}: {detail}") from exc
            except (urllib.error.URLError, TimeoutError) as exc:
                if attempt == self.retries:
                    raise RuntimeError(f"{url}: {exc}") from exc
            time.sleep(2.0 * (attempt + 1))
        raise AssertionError("unreachable")

    def _ensure_loaded(self) -> None:
        """Hand the adapter to the worker once (vLLM's runtime LoRA loading), unless it already serves that name."""
        if self.loaded:
            return
        served = {m["id"] for m in self._call("GET", "/v1/models").get("data", [])}
        if self.name not in served:
            self._call("POST", "/v1/load_lora_adapter", {"lora_name": self.name, "lora_path": self.adapter})
        self.loaded = True

    # a DataFrame hint: the logged signature's schema is what MLflow checks inputs against (any other hint it would
    # try, and fail, to turn into a second signature)
    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[str]:
        rows = model_input.to_dict("records") if hasattr(model_input, "to_dict") else list(model_input)
        self._ensure_loaded()
        p = params or {}
        answers = []
        for row in rows:
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"]]
            body = {"model": self.name, "messages": messages, "max_tokens": int(p.get("max_tokens", self.max_tokens)),
                    "temperature": float(p.get("temperature", self.temperature))}
            answers.append(self._call("POST", "/v1/chat/completions", body)["choices"][0]["message"]["content"])
        return answers


mlflow.models.set_model(LoraAdapterModel())
