"""infra/ files parse and keep secrets out (they cannot be run here: no Docker engine, no GPU)."""

from __future__ import annotations

import os
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


def test_prod_stack_is_what_compose_describes(tmp_path: Path) -> None:
    """`make prod-stack` (no Docker) runs the services, Airflow settings and queues of docker-compose.yml."""
    from pipeline.config import load_params
    from pipeline.services import prod_stack

    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    assert set(prod_stack.COMPOSE.values()) <= set(compose["services"])
    # compose's other services: the serving plane (started by the stages here), init steps (db migrate, buckets: same code)
    assert set(compose["services"]) - set(prod_stack.COMPOSE.values()) == {"litellm", "vllm-base", "airflow-init", "minio-init"}
    assert compose["services"]["minio-init"]["command"] == "python -m pipeline prod buckets"
    compose_env = compose["x-airflow"]["environment"]
    params = load_params(INFRA.parent / "params.yaml", environ={"PIPELINE__PROD_STACK__HOME": str(tmp_path)})
    ours = prod_stack.airflow_env(params.prod_stack)
    for name in prod_stack.AIRFLOW_ENV_NAMES:
        assert name in compose_env and name in ours, name
    assert ours["AIRFLOW__CORE__EXECUTOR"] == compose_env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    for name, scheme in (("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgresql+psycopg2://"), ("AIRFLOW__CELERY__RESULT_BACKEND", "db+postgresql://"),
                         ("AIRFLOW__CELERY__BROKER_URL", "redis://")):
        assert ours[name].startswith(scheme) and compose_env[name].startswith(scheme), name
    queues = {svc["command"].split("--queues ")[1].split()[0] for name, svc in compose["services"].items() if name.startswith("airflow-worker")}
    assert queues == set(params.prod_stack.workers) == {"default", "gpu"}
    # the secrets are generated into the stack's home, private, and never part of the repo
    assert all((tmp_path / "secrets" / f).stat().st_mode & 0o077 == 0 for f in os.listdir(tmp_path / "secrets"))


def test_vllm_workers_load_adapters_from_s3_through_their_sidecar(tmp_path: Path) -> None:
    """Each LoRA-serving vLLM Deployment has the sync-adapters sidecar, configured as a serving.workers entry
    whose adapter_dir is the volume the vLLM container reads; fixed-role workers have neither."""
    from pipeline.config import load_params

    docs = [d for d in yaml.safe_load_all((INFRA / "k8s/vllm-deployment.yaml").read_text()) if d]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert set(deployments) == services and len(deployments) >= 2
    lora = 0
    for name, dep in deployments.items():
        containers = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}
        if "--enable-lora" not in containers["vllm"]["args"]:
            assert "sync-adapters" not in containers, name
            continue
        lora += 1
        sidecar = containers["sync-adapters"]
        env = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e}
        worker_name = sidecar["command"][sidecar["command"].index("--worker") + 1]
        params = load_params(INFRA.parent / "params.yaml", environ={"PIPELINE__SERVING__WORKERS": env["PIPELINE__SERVING__WORKERS"]})
        worker = next(w for w in params.serving.workers if w.name == worker_name)
        assert worker.adapter_store and worker.adapter_store.startswith("s3://") and worker.adapter_store.split("/")[2] in params.prod_stack.buckets
        mounts = {m["mountPath"] for m in containers["vllm"]["volumeMounts"]} & {m["mountPath"] for m in sidecar["volumeMounts"]}
        assert mounts == {worker.adapter_dir}
        assert "VLLM_API_KEY" not in env and any(e["name"] == "VLLM_ALLOW_RUNTIME_LORA_UPDATING" for e in containers["vllm"]["env"])
        # every replica resolves adapters from the synced folder; promotion names the base model as this --model
        vllm_env = {e["name"]: e.get("value") for e in containers["vllm"]["env"]}
        args = containers["vllm"]["args"]
        assert vllm_env.get("VLLM_LORA_RESOLVER_CACHE_DIR") == worker.adapter_dir, name
        assert args[args.index("--model") + 1] == worker.model, name
    assert lora >= 1
