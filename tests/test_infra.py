"""infra/ files parse and keep secrets out (they cannot be run here: no Docker engine, no GPU)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

INFRA = Path(__file__).resolve().parent.parent / "infra"
SECRET_KEYS = re.compile(r"(PASSWORD|SECRET|MASTER_KEY|TOKEN)$")


def test_compose_services_and_no_inline_secrets() -> None:
    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    assert {"postgres", "redis", "minio", "mlflow", "litellm", "vllm-base", "airflow-scheduler", "airflow-worker-gpu"} <= set(compose["services"])
    for name, svc in compose["services"].items():
        env = svc.get("environment") or {}
        for key, value in (env.items() if isinstance(env, dict) else []):
            if SECRET_KEYS.search(key):
                assert str(value).startswith("${"), f"{name}.{key} must come from the environment"


def test_manifests_parse() -> None:
    for path in (INFRA / "k8s").glob("*.yaml"):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert docs, path
    env_example = (INFRA / "env.example").read_text()
    assert all(line.endswith("=") or "MODEL" in line or "REGION" in line
               for line in env_example.splitlines() if line and not line.startswith("#"))


def test_only_the_proxy_and_the_gpu_worker_hold_the_vllm_key() -> None:
    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())

    def env_files(svc: dict) -> list[str]:
        files = svc.get("env_file") or []
        return [files] if isinstance(files, str) else list(files)

    holders = {name for name, svc in compose["services"].items() if "vllm.env" in env_files(svc)}
    assert holders == {"vllm-base", "litellm", "airflow-worker-gpu"}
    assert "VLLM_API_KEY" not in (INFRA / "env.example").read_text()
    assert (INFRA / "vllm.env.example").read_text().strip().endswith("VLLM_API_KEY=")
    vllm = [d for d in yaml.safe_load_all((INFRA / "k8s/vllm-deployment.yaml").read_text()) if d and d["kind"] == "Deployment"][0]
    env = {e["name"]: e for e in vllm["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "secretKeyRef" in env["VLLM_API_KEY"]["valueFrom"]
