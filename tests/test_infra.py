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


def test_rollout_job_template_renders_one_job_with_the_task() -> None:
    """Render the k8s runner's template with Agent Lightning's own code, as its controller does."""
    from omegaconf import OmegaConf

    from agentlightning.controller.k8s_reconciler import build_job_spec
    from agentlightning.schemas import Rollout, RolloutConfig, RolloutK8sConfig, RolloutLifecycleStatus

    task = {"data_id": "1", "task_json": '{"id": "1", "question": "Does <X> help?"}'}
    rollout = Rollout(rollout_id="r1", input=task, config=RolloutConfig(k8s=RolloutK8sConfig(job_template=(INFRA / "k8s/templates/agl-rollout-job.yaml.j2").read_text())),
                      status=RolloutLifecycleStatus(created_at=0.0, updated_at=0.0))
    config = OmegaConf.create({"k8s_runner": {"namespace": "pubmedqa", "ttl_after_finished": 60}, "agl_server": {"url": "http://agl:8090", "key": "k"}})
    job = build_job_spec(rollout, config)
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    import json

    assert json.loads(env["PUBMEDQA_TASK"]) == task and container["command"] == ["python", "-m", "pipeline.rl.agent"]
    assert env["AGL_EVENT_URL"] == "http://agl:8090/api/rollouts/r1/attempt/0/events"


def test_gpu_image_pins_the_documented_verl_vllm_pair() -> None:
    pins = (INFRA.parent / "requirements/gpu-rl.txt").read_text()
    assert "verl==0.8.0" in pins and "agentlightning==1.0.2" in pins
    assert "FROM vllm/vllm-openai:v0.20.2" in (INFRA / "docker/Dockerfile.gpu-worker").read_text()


def test_images_ports_and_env_names_agree_across_compose_k8s_and_params() -> None:
    """One control image and one GPU image everywhere; the gateway where params.yaml says; the vLLM
    image the GPU worker is built on; the key env names the code reads."""
    import re as _re

    from pipeline.config import load_params

    texts = {p.relative_to(INFRA).as_posix(): p.read_text() for p in [*(INFRA / "k8s").rglob("*.yaml"), *(INFRA / "k8s").rglob("*.j2"),
                                                                      INFRA / "docker-compose.yml"]}
    ours = {m for t in texts.values() for m in _re.findall(r"((?:[\w.-]+/)*pubmedqa-society/[\w-]+)", t)}
    assert {m.rsplit("/", 2)[-2] + "/" + m.rsplit("/", 1)[-1] for m in ours} == {"pubmedqa-society/control", "pubmedqa-society/gpu-worker"}
    vllm_tags = {m for t in texts.values() for m in _re.findall(r"vllm/vllm-openai:(v[\d.]+)", t)}
    assert vllm_tags == {_re.search(r"FROM vllm/vllm-openai:(v[\d.]+)", (INFRA / "docker/Dockerfile.gpu-worker").read_text()).group(1)}
    params = load_params(INFRA.parent / "params.yaml", environ={})
    gateway = texts["k8s/agl-gateway.yaml"]
    assert f"port={params.ppo.agl.port}" in gateway and f"agl-server.pubmedqa.svc:{params.ppo.agl.port}" in gateway
    assert "${oc.env:AGL_KEY}" in gateway and params.ppo.agl.key_env == "AGL_KEY"
    job = texts["k8s/templates/agl-rollout-job.yaml.j2"]
    from pipeline.rl.agent import TASK_ENV, TRACE_DIR_ENV

    assert TASK_ENV in job and TRACE_DIR_ENV in job and "PIPELINE__ROLLOUTS__LLM_BASE_URL" in job
