"""infra/ files parse and keep secrets out (they cannot be run here: no Docker engine, no GPU)."""

from __future__ import annotations

import itertools
import os
import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
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
    vllm = next(d for d in yaml.safe_load_all((INFRA / "k8s/vllm-deployment.yaml").read_text()) if d and d["kind"] == "Deployment")
    env = {e["name"]: e for e in vllm["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "secretKeyRef" in env["VLLM_API_KEY"]["valueFrom"]


def test_rollout_job_template_renders_one_job_with_the_task() -> None:
    """Render the k8s runner's template with Agent Lightning's own code, as its controller does."""
    from agentlightning.controller.k8s_reconciler import build_job_spec
    from agentlightning.schemas import Rollout, RolloutConfig, RolloutK8sConfig, RolloutLifecycleStatus
    from omegaconf import OmegaConf

    task = {"data_id": "1", "task_json": '{"id": "1", "question": "Does <X> help?"}'}
    rollout = Rollout(rollout_id="r1", input=task, config=RolloutConfig(k8s=RolloutK8sConfig(job_template=(INFRA / "k8s/templates/agl-rollout-job.yaml.j2").read_text())),
                      status=RolloutLifecycleStatus(created_at=0.0, updated_at=0.0))
    config = OmegaConf.create({"k8s_runner": {"namespace": "mlops", "ttl_after_finished": 60}, "agl_server": {"url": "http://agl:8090", "key": "k"}})
    job = build_job_spec(rollout, config)
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    import json

    assert json.loads(env["PUBMEDQA_TASK"]) == task and container["command"] == ["python", "-m", "pipeline.rl.agent"]
    # the routed supervisor policy comes from the registry the trainer writes, read as MLflow's reader user
    assert env["MLFLOW_TRACKING_URI"] == _env(_ray_head()[2])["MLFLOW_TRACKING_URI"]
    assert [s["secretRef"]["name"] for s in container["envFrom"]] == ["mlflow-reader-credentials"]
    assert env["AGL_EVENT_URL"] == "http://agl:8090/api/rollouts/r1/attempt/0/events"


def test_gpu_image_pins_the_documented_verl_vllm_pair() -> None:
    pins = (INFRA.parent / "requirements/gpu.lock.txt").read_text().splitlines()
    assert "verl==0.8.0" in pins and "agentlightning==1.0.2" in pins and "vllm==0.20.2" in pins
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
    gateway = next(d for d in yaml.safe_load_all(texts["k8s/agl-gateway.yaml"]) if d["kind"] == "Service")
    assert [p["targetPort"] for p in gateway["spec"]["ports"]] == [params.ppo.agl.port]
    _, _, head = _ray_head()  # train_ppo's pod: the gateway key from a Secret, under the name ppo.agl.key_env says
    assert "secretKeyRef" in next(e for e in head["env"] if e["name"] == params.ppo.agl.key_env)["valueFrom"]
    job = texts["k8s/templates/agl-rollout-job.yaml.j2"]
    from pipeline.rl.agent import TASK_ENV, TRACE_DIR_ENV

    assert TASK_ENV in job and TRACE_DIR_ENV in job and "PIPELINE__ROLLOUTS__LLM_BASE_URL" in job


def test_prod_stack_is_what_compose_describes(tmp_path: Path) -> None:
    """`make prod-stack` (no Docker) runs the services, Airflow settings and queues of docker-compose.yml."""
    from pipeline.config import load_params
    from infra.local import prod_stack

    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    assert set(prod_stack.COMPOSE.values()) <= set(compose["services"])
    # compose's other services: the serving plane (started by the stages here), init steps (db migrate, buckets, MLflow's
    # users: the same code)
    assert set(compose["services"]) - set(prod_stack.COMPOSE.values()) == {"litellm", "vllm-base", "airflow-init", "minio-init",
                                                                           "mlflow-init"}
    assert compose["services"]["minio-init"]["command"] == "python -m pipeline prod buckets"
    assert compose["services"]["mlflow-init"]["command"] == "python -m pipeline prod mlflow-users"
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
        env = _env(sidecar)
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


# --- helpers shared by the checks below -----------------------------------------------------------------------

K8S = INFRA / "k8s"
ROOT = INFRA.parent
K8S_VERSION = "1.33.0"  # the Kubernetes release the manifests are validated against (kubernetes-validate's schemas)
# kinds kubernetes-validate has no schema for: checked structurally, their pod templates against the core schemas
NO_SCHEMA = {"RayCluster": "KubeRay CRD (ray.io/v1): not a core kind; its head/worker pod templates are validated as PodTemplates"}
# files in infra/k8s that are not manifests
NOT_MANIFESTS = {"airflow-values.yaml": "Helm values of the apache-airflow chart; its env, envFrom and volumes are validated inside a Pod"}
# Services the manifests address but do not define (deployed beside them, named in infra/README.md)
EXTERNAL_SERVICES = {"mlflow", "minio", "litellm"}
RUNNER_ENV = "PIPELINE__PPO__AGL__RUNNER"
EVERY_ADDRESS = "0.0.0.0"  # noqa: S104 - a bind address the config is checked with, nothing binds it here


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    """(file, document) of every Kubernetes object in infra/k8s/*.yaml."""
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) if p.name not in NOT_MANIFESTS for d in _docs(p)]


def _objects(kind: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["metadata"].get("namespace", ""), d["metadata"]["name"]): d for _, d in _manifests() if d["kind"] == kind}


def _configmaps() -> dict[str, dict[str, str]]:
    return {name: cm.get("data", {}) for (_, name), cm in _objects("ConfigMap").items()}


def _pods() -> dict[str, tuple[str, dict[str, str], dict[str, Any]]]:
    """Every pod the manifests create: label -> (namespace, pod labels, pod spec)."""
    out: dict[str, tuple[str, dict[str, str], dict[str, Any]]] = {}
    for _, d in _manifests():
        ns, name = d["metadata"].get("namespace", ""), d["metadata"]["name"]
        if d["kind"] in ("Deployment", "Job"):
            t = d["spec"]["template"]
            out[f"{d['kind']}/{name}"] = (ns, t.get("metadata", {}).get("labels", {}), t["spec"])
        elif d["kind"] == "Pod":
            out[f"Pod/{name}"] = (ns, d["metadata"].get("labels", {}), d["spec"])
        elif d["kind"] == "RayCluster":
            groups = [("head", d["spec"]["headGroupSpec"]), *[(g["groupName"], g) for g in d["spec"]["workerGroupSpecs"]]]
            for group, spec in groups:
                t = spec["template"]
                out[f"RayCluster/{name}/{group}"] = (ns, t.get("metadata", {}).get("labels", {}), t["spec"])
    return out


def _env(container: dict[str, Any], configmaps: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    """A container's plain env as Kubernetes assembles it: envFrom ConfigMaps first, then env (which wins)."""
    configmaps = _configmaps() if configmaps is None else configmaps
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(configmaps[source["configMapRef"]["name"]])
    env.update({e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e})
    return env


def _workdir(container: dict[str, Any]) -> PurePosixPath:
    """workingDir, else the WORKDIR of the project image the container runs."""
    if container.get("workingDir"):
        return PurePosixPath(container["workingDir"])
    dockerfile = {"control": "Dockerfile.control", "gpu-worker": "Dockerfile.gpu-worker"}[container["image"].split("/")[-1].split(":")[0]]
    return PurePosixPath(re.findall(r"^WORKDIR (\S+)", (INFRA / "docker" / dockerfile).read_text(), re.M)[-1])


def _backing(spec: dict[str, Any], container: dict[str, Any], path: PurePosixPath) -> tuple[str, str]:
    """(PVC, path inside it) that holds ``path`` in this container: the deepest mount above it; fails on pod-local storage."""
    for mount in sorted(container.get("volumeMounts", []), key=lambda m: len(m["mountPath"]), reverse=True):
        at = PurePosixPath(mount["mountPath"])
        if path == at or at in path.parents:
            volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
            assert "persistentVolumeClaim" in volume, f"{container['name']}: {path} is on {volume}, not a shared claim"
            return volume["persistentVolumeClaim"]["claimName"], str(PurePosixPath(mount.get("subPath", "")) / path.relative_to(at))
    raise AssertionError(f"{container['name']}: {path} is on the pod's own disk")


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _assert_lora_as_configured(argv: list[str], worker: Any, where: object) -> None:
    """The LoRA settings a manifest's vLLM runs with are the ones its serving config says (serving/worker.py
    check_adapter decides from the config what an adapter may be loaded into: docs/serving.md)."""
    if "--enable-lora" not in argv:
        return
    assert _flag(argv, "--max-lora-rank") == str(worker.max_lora_rank), where
    at = argv.index("--lora-target-modules") + 1 if "--lora-target-modules" in argv else None
    modules = None if at is None else list(itertools.takewhile(lambda a: not a.startswith("--"), argv[at:]))
    assert modules == worker.lora_target_modules, where


def _interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """docker compose's ${VAR} / ${VAR:-default} with an empty environment (the defaults, as in CI)."""
    env = env or {}
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1)) or (m.group(2) or ""), text)


def _compose_argvs(command: str | list[str]) -> list[list[str]]:
    """The processes a compose command runs: a `bash -c "a && b"` script is each of its commands."""
    if isinstance(command, list) and command[:2] == ["bash", "-c"]:
        return [shlex.split(part) for part in command[2].split("&&")]
    return [list(command) if isinstance(command, list) else shlex.split(command)]


def _render_job(params: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """One rollout Job as the controller started by gateway.running would create it: the project's controller
    overrides composed over Agent Lightning's own controller config (Hydra, as `python -m agentlightning.controller`),
    then Agent Lightning's build_job_spec on ppo.agl.job_template."""
    from agentlightning.controller.k8s_reconciler import build_job_spec
    from agentlightning.schemas import Rollout, RolloutConfig, RolloutK8sConfig, RolloutLifecycleStatus
    from hydra import compose, initialize_config_module

    from pipeline.rl import gateway

    monkeypatch.setenv("AGL_KEY", "test-key")
    with initialize_config_module(config_module="agentlightning.config", version_base=None):
        overrides = gateway.controller_overrides(params.ppo.agl, f"http://127.0.0.1:{params.ppo.agl.port}")
        config = compose("controller", overrides=overrides)
    rollout_cfg = gateway.rollout_config(params.ppo.agl)
    assert isinstance(rollout_cfg["k8s"], dict)
    rollout = Rollout(rollout_id="r1", input={"data_id": "1", "task_json": '{"id": "1"}'},
                      config=RolloutConfig(k8s=RolloutK8sConfig(job_template=rollout_cfg["k8s"]["job_template"])),
                      status=RolloutLifecycleStatus(created_at=0.0, updated_at=0.0))
    return build_job_spec(rollout, config)


def _ray_head() -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(namespace, pod spec, container) of the pod that runs train_ppo with the k8s runner (and so the controller)."""
    runners = [(ns, spec, c) for ns, _, spec in _pods().values() for c in spec["containers"] if _env(c).get(RUNNER_ENV) == "k8s"]
    assert len(runners) == 1, f"one pod runs the k8s runner's controller, found {len(runners)}"
    return runners[0]


def _k8s_params(container: dict[str, Any]) -> Any:
    from pipeline.config import load_params

    return load_params(ROOT / "params.yaml", environ={k: v for k, v in _env(container).items() if k.startswith("PIPELINE__")})


# --- a. served names -------------------------------------------------------------------------------------------

def test_k8s_vllm_deployments_serve_the_names_the_proxy_requests() -> None:
    """Each worker of the serving config the pipeline pods receive (one ConfigMap) is a Service on its port in front of
    a vLLM Deployment passing --served-model-name = the name the proxy requests (proxy.deployments), --port = the
    Service's targetPort and --model = the model promotion names."""
    from pipeline.config import load_params
    from pipeline.serving import proxy
    from pipeline.serving import worker as vllm

    configmaps = _configmaps()
    serving = configmaps["pipeline-serving"]
    params = load_params(ROOT / "params.yaml", environ=serving)
    services, deployments = _objects("Service"), _objects("Deployment")
    served: set[tuple[str, str]] = set()
    for worker in params.serving.workers:
        backend = proxy.deployments(params.serving)[worker.name]
        requested = backend["model"].removeprefix("hosted_vllm/")
        url = urlsplit(backend["api_base"])
        assert url.hostname and url.hostname.endswith(".svc") and url.hostname.count(".") == 2, url.hostname
        svc_name, ns, _ = url.hostname.split(".")
        svc = services[(ns, svc_name)]
        port = next(p for p in svc["spec"]["ports"] if p["port"] == url.port)
        pods = [(key, d) for key, d in deployments.items() if key[0] == ns
                and svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, f"{url.hostname}: {len(pods)} Deployments behind it"
        key, dep = pods[0]
        served.add(key)
        container = next(c for c in dep["spec"]["template"]["spec"]["containers"] if "--model" in c.get("args", []))
        args = container["args"]
        assert _flag(args, "--served-model-name") == requested == vllm.served_name(worker), f"{key}: the proxy requests {requested!r}"
        assert int(_flag(args, "--port") or 0) == port["targetPort"], key
        assert _flag(args, "--model") == vllm.model_id(worker), key
        assert not vllm.is_local(worker), worker  # stack.ensure only health-checks it
        lora = "--enable-lora" in args
        assert lora == worker.runtime_lora == (_env(container).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == "True"), key
        _assert_lora_as_configured(args, worker, key)
    assert served == {key for key, d in deployments.items() if any("vllm/vllm-openai" in c["image"]
                                                                  for c in d["spec"]["template"]["spec"]["containers"])}
    # one source: the pipeline's pods read the ConfigMap; nobody names the workers inline
    assert params.serving.proxy.host == serving["PIPELINE__SERVING__PROXY__HOST"]
    pods = _pods()
    for label, (_, _, spec) in pods.items():
        for c in spec["containers"]:
            assert "PIPELINE__SERVING__WORKERS" not in {e["name"] for e in c.get("env", [])}, f"{label}/{c['name']} names workers inline"
    readers = {"Pod/gpu-task/base", "RayCluster/verl/head/ray-head", "Deployment/vllm-society/sync-adapters"}
    for label in readers:
        pod, container = label.rsplit("/", 1)
        c = next(c for c in pods[pod][2]["containers"] if c["name"] == container)
        assert {"configMapRef": {"name": "pipeline-serving"}} in c.get("envFrom", []), label
    values = yaml.safe_load((K8S / "airflow-values.yaml").read_text())
    assert {"configMapRef": {"name": "pipeline-serving"}} in yaml.safe_load(values["extraEnvFrom"])
    assert not {e["name"] for e in values["env"]} & set(serving)


# --- b. compose's Airflow commands ------------------------------------------------------------------------------

def test_compose_airflow_commands_are_the_prod_stack_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither image has an `airflow` entrypoint: every Airflow service runs `airflow <subcommand>`, the subcommand
    `make prod-stack` starts for that service (captured from prod_stack.airflow_up), and airflow-init runs the same
    setup commands (db migrate, the gpu pool)."""
    from types import SimpleNamespace

    from pipeline.config import load_params
    from infra.local import prod_stack

    started: dict[str, list[str]] = {}
    setup: list[list[str]] = []
    monkeypatch.setattr(prod_stack, "start", lambda service, argv, *a, **k: started.__setitem__(service.name, argv))
    monkeypatch.setattr(prod_stack, "subprocess", SimpleNamespace(run=lambda argv, *a, **k: setup.append(argv) or SimpleNamespace(returncode=0)))
    monkeypatch.setattr(prod_stack, "_free_or_ours", lambda *a, **k: None)
    monkeypatch.setattr(prod_stack, "_free_port_for", lambda *a, **k: 0)
    params = load_params(ROOT / "params.yaml", environ={"PIPELINE__PROD_STACK__HOME": str(tmp_path)})
    prod_stack.airflow_up(params.prod_stack)

    services = yaml.safe_load((INFRA / "docker-compose.yml").read_text())["services"]
    airflow = {name for name in services if name.startswith("airflow-")}
    assert {prod_stack.COMPOSE[name] for name in started} == airflow - {"airflow-init"}

    def subcommand(argv: list[str]) -> list[str]:
        return list(itertools.takewhile(lambda a: not a.startswith("-"), argv))

    for name, argv in started.items():
        service = prod_stack.COMPOSE[name]
        (ours,) = _compose_argvs(services[service]["command"])
        assert ours[0] == "airflow", f"{service}: {ours} (the image has no airflow entrypoint)"
        assert subcommand(ours[1:]) == subcommand(argv[1:]), service
        options = {a for a in ours if a.startswith("--")}
        assert options <= {a for a in argv if a.startswith("--")}, service
        for option in options & {"--queues", "--concurrency"}:
            assert _flag(ours, option) == _flag(argv, option), f"{service} {option}"
    init = _compose_argvs(services["airflow-init"]["command"])
    assert all(a[0] == "airflow" for a in init) and [a[1:] for a in init] == [a[1:] for a in setup]


# --- c. compose's pipeline services use vllm-base -----------------------------------------------------------------

def test_compose_pipeline_services_use_the_vllm_base_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Airflow's services and the proxy get one serving.workers naming vllm-base: stack.ensure health-checks it
    instead of starting a local vLLM, and the proxy's request name and port are what vllm-base serves; GPU services
    get shared memory."""
    from pipeline.config import load_params
    from pipeline.serving import proxy
    from pipeline.serving import worker as vllm

    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    services = compose["services"]
    pipeline_services = {name for name in services if name.startswith("airflow-")} | {"litellm"}
    settings = {name: {k: v for k, v in (services[name].get("environment") or {}).items() if k.startswith("PIPELINE__SERVING__")}
                for name in pipeline_services}
    assert all("PIPELINE__SERVING__WORKERS" in s for s in settings.values()), settings
    assert len({yaml.safe_dump(s) for s in settings.values()}) == 1, "one serving config for every pipeline service"
    params = load_params(ROOT / "params.yaml", environ={k: _interpolate(v) for k, v in settings["litellm"].items()})
    assert params.serving.proxy.host in services
    monkeypatch.setattr(vllm, "http_ok", lambda url, *a, **k: True)
    monkeypatch.setattr(vllm, "start", lambda *a, **k: pytest.fail("stack.ensure would start a local vLLM"))
    for worker in params.serving.workers:
        assert not vllm.is_local(worker) and vllm.up(params.serving, worker) == f"http://{worker.host}:{worker.port}"
        backend = proxy.deployments(params.serving)[worker.name]
        url = urlsplit(backend["api_base"])
        assert url.hostname in services, url
        args = shlex.split(_interpolate(services[url.hostname]["command"]))
        assert _flag(args, "--served-model-name") == backend["model"].removeprefix("hosted_vllm/") == vllm.served_name(worker)
        assert int(_flag(args, "--port") or 0) == url.port and _flag(args, "--model") == vllm.model_id(worker)
        _assert_lora_as_configured(args, worker, url.hostname)
    gpu = {name for name, svc in services.items() if "gpu" in str(svc.get("deploy", {}))}
    assert gpu == {"vllm-base", "airflow-worker-gpu"}
    for name in gpu:
        assert services[name].get("ipc") == "host" or services[name].get("shm_size"), f"{name}: no shared memory for vLLM/NCCL"


def test_compose_structure() -> None:
    """What `docker compose config` would reject, checked without Docker: images/builds, commands, env files,
    dependencies and volumes all resolve."""
    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    services, volumes = compose["services"], set(compose["volumes"])
    for name, svc in services.items():
        assert svc.get("image"), name
        if "build" in svc:
            assert (INFRA / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file(), name
        if "command" in svc:
            assert all(argv and all(argv) for argv in _compose_argvs(svc["command"])), name
        files = svc.get("env_file") or []
        for f in [files] if isinstance(files, str) else files:
            assert (INFRA / (f.lstrip(".") + ".example")).is_file(), f"{name}: {f} has no committed example"
        assert set(svc.get("depends_on") or []) <= set(services), name
        env = svc.get("environment") or {}
        assert isinstance(env, dict) and all(isinstance(v, str | int | bool) for v in env.values()), name
        for mount in svc.get("volumes") or []:
            source = mount.split(":")[0]
            assert (source.startswith(".") and (INFRA / source).exists()) or source in volumes, f"{name}: {mount}"


# --- d. one namespace ---------------------------------------------------------------------------------------------

def test_one_namespace_across_manifests_references_and_docs() -> None:
    """Every metadata.namespace, RoleBinding subject, `<svc>.<ns>.svc` address, `kubectl/helm -n` in comments and docs,
    and the k8s runner's namespace name the same namespace; every address our manifests could define, they do."""
    from pipeline.config import load_params

    texts = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [*K8S.rglob("*.yaml"), *K8S.rglob("*.j2"), INFRA / "README.md",
                                                                       ROOT / "params.yaml", ROOT / "pipeline/config.py"]}
    found: dict[str, set[str]] = {}
    for path, text in texts.items():
        for svc, ns in re.findall(r"\b([a-z0-9-]+)\.([a-z0-9-]+)\.svc\b", text):
            found.setdefault(ns, set()).add(f"{path}: {svc}.{ns}.svc")
        for ns in re.findall(r"(?:kubectl|helm)\b[^\n`]*?(?:-n|--namespace)[ =]([a-z0-9-]+)", text):
            found.setdefault(ns, set()).add(f"{path}: -n {ns}")
    for file, doc in _manifests():
        found.setdefault(doc["metadata"].get("namespace", "<none>"), set()).add(f"{file}: {doc['kind']}/{doc['metadata']['name']}")
        for subject in doc.get("subjects", []):
            found.setdefault(subject.get("namespace", "<none>"), set()).add(f"{file}: subject {subject['name']}")
    _, _, head = _ray_head()
    params = load_params(ROOT / "params.yaml", environ={})
    for where, ns in (("params.yaml ppo.agl.k8s_namespace", params.ppo.agl.k8s_namespace),
                      ("ray head ppo.agl.k8s_namespace", _k8s_params(head).ppo.agl.k8s_namespace)):
        found.setdefault(ns, set()).add(where)
    assert len(found) == 1, {ns: sorted(where)[:6] for ns, where in found.items()}
    (namespace,) = found
    defined = {name for kind in ("Service",) for (_, name) in _objects(kind)}
    referenced = {svc for text in texts.values() for svc, _ in re.findall(r"\b([a-z0-9-]+)\.([a-z0-9-]+)\.svc\b", text)}
    assert referenced - defined == EXTERNAL_SERVICES, referenced - defined
    readme = (INFRA / "README.md").read_text()
    assert f"`{namespace}`" in readme and all(f"`{svc}`" in readme for svc in EXTERNAL_SERVICES)


# --- e. the gateway rollout Jobs reach -------------------------------------------------------------------------------

@pytest.mark.parametrize(("env", "reason"), [
    ({}, "set advertise_url"),
    ({"PIPELINE__PPO__AGL__HOST": EVERY_ADDRESS, "PIPELINE__PPO__AGL__ADVERTISE_URL": "http://127.0.0.1:8090"}, "loopback"),
    ({"PIPELINE__PPO__AGL__HOST": EVERY_ADDRESS, "PIPELINE__PPO__AGL__ADVERTISE_URL": "http://localhost:8090"}, "loopback"),
    ({"PIPELINE__PPO__AGL__HOST": EVERY_ADDRESS, "PIPELINE__PPO__AGL__ADVERTISE_URL": f"http://{EVERY_ADDRESS}:8090"}, "unspecified"),
    ({"PIPELINE__PPO__AGL__ADVERTISE_URL": "http://agl-gateway.mlops.svc:8090"}, "would bind 127.0.0.1"),
])
def test_k8s_runner_refuses_a_gateway_jobs_cannot_reach(env: dict[str, str], reason: str) -> None:
    from pipeline.config import ParamsError, load_params

    with pytest.raises(ParamsError) as err:
        load_params(ROOT / "params.yaml", environ={RUNNER_ENV: "k8s", **env})
    assert "ppo.agl" in str(err.value) and reason in str(err.value) and "runner k8s" in str(err.value)


def test_rollout_jobs_get_the_advertised_gateway_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the Ray head's settings, the Job the controller creates (the project's overrides + Agent Lightning's
    config and build_job_spec) reaches the gateway at ppo.agl.advertise_url, a Service in front of the head's
    gateway port, in the runner's namespace; the local runner keeps loopback."""
    from pipeline.config import load_params
    from pipeline.rl import gateway

    ns, _, head = _ray_head()
    params = _k8s_params(head)
    cfg = params.ppo.agl
    assert cfg.runner == "k8s" and cfg.advertise_url and params.ppo.backend == "verl"
    job = _render_job(params, monkeypatch)
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AGL_OPENAI_BASE_URL"].startswith(f"{cfg.advertise_url}/proxy/rollout/r1/"), env["AGL_OPENAI_BASE_URL"]
    assert env["AGL_EVENT_URL"] == f"{cfg.advertise_url}/api/rollouts/r1/attempt/0/events"
    assert job["metadata"]["namespace"] == cfg.k8s_namespace == ns
    # the advertised host is a Service selecting the head pod, forwarding to the port the gateway binds there
    url = urlsplit(cfg.advertise_url)
    assert url.hostname
    svc_name, svc_ns, _ = url.hostname.split(".")
    svc = _objects("Service")[(svc_ns, svc_name)]
    port = next(p for p in svc["spec"]["ports"] if p["port"] == (url.port or 80))
    assert port["targetPort"] == cfg.port and cfg.port in {p["containerPort"] for p in head.get("ports", [])}
    head_labels = _pods()["RayCluster/verl/head"][1]
    assert svc["spec"]["selector"].items() <= head_labels.items()
    assert gateway.local_host(cfg) == "127.0.0.1"  # the trainer and the controller on the head use loopback
    # the local runner: no agent_url, the subprocesses use the loopback URL
    local = load_params(ROOT / "params.yaml", environ={})
    overrides = gateway.controller_overrides(local.ppo.agl, "http://127.0.0.1:8090")
    assert not any(o.startswith(("agl_server.agent_url", "k8s_runner.")) for o in overrides)


# --- f. RBAC of the controller's pod -------------------------------------------------------------------------------

def test_the_controllers_service_account_may_create_rollout_jobs() -> None:
    ns, spec, head = _ray_head()
    params = _k8s_params(head)
    account = spec.get("serviceAccountName")
    assert account and (ns, account) in _objects("ServiceAccount"), f"the Ray head runs as {account!r}, not a ServiceAccount of ours"
    roles = _objects("Role")
    granted: set[tuple[str, str, str]] = set()
    for (binding_ns, _), binding in _objects("RoleBinding").items():
        if binding_ns != params.ppo.agl.k8s_namespace:
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account and s.get("namespace") == ns for s in binding["subjects"]):
            continue
        assert binding["roleRef"]["kind"] == "Role"
        for rule in roles[(binding_ns, binding["roleRef"]["name"])]["rules"]:
            granted |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    needed = {("batch", "jobs", v) for v in ("create", "get", "list", "watch", "delete")} | {("", "pods", v) for v in ("get", "list")}
    assert needed | {("", "pods/log", "get")} <= granted, sorted(needed - granted)


# --- g. checkpoints and traces on shared claims -------------------------------------------------------------------

def test_checkpoints_and_traces_land_on_shared_claims(monkeypatch: pytest.MonkeyPatch) -> None:
    """models/ (the base model, verl's checkpoints, the adapter) resolves to the same claim and path on the Ray head,
    every Ray worker and the GPU task pods; the RL trace store to the same claim in the rollout Job and the trainer's pods."""
    from pipeline.config import load_params

    params = load_params(ROOT / "params.yaml", environ={})
    out = PurePosixPath(params.ppo.at("senior_researcher").out_dir)
    assert out.parts[0] == "models"
    paths = [PurePosixPath(params.ppo.base_model), out.with_name(out.name + ".checkpoints"), out / "adapter"]
    pods = _pods()
    trainers = [label for label in pods if label.startswith(("RayCluster/", "Pod/gpu-task"))]
    assert {"RayCluster/verl/head", "RayCluster/verl/gpu", "Pod/gpu-task"} <= set(trainers)
    for rel in paths:
        where = {}
        for label in trainers:
            spec = pods[label][2]
            c = spec["containers"][0]
            where[label] = _backing(spec, c, _workdir(c) / rel)
        assert len(set(where.values())) == 1, (rel, where)
    job = _render_job(_k8s_params(_ray_head()[2]), monkeypatch)
    job_c = job["spec"]["template"]["spec"]["containers"][0]
    job_dir = PurePosixPath(_env(job_c)["PUBMEDQA_RL_TRACE_DIR"])
    where = {"job": _backing(job["spec"]["template"]["spec"], job_c, job_dir)}
    for label in ("RayCluster/verl/head", "Pod/gpu-task"):
        spec = pods[label][2]
        c = spec["containers"][0]
        where[label] = _backing(spec, c, _workdir(c) / params.ppo.agl.trace_dir)
    assert len(set(where.values())) == 1, where
    # what a rollout Job's agent reads besides its task: the tools' index and the live routing, the workspace's own
    for rel in (params.rollouts.index_dir, params.serving.live_file):
        seen = {"job": _backing(job["spec"]["template"]["spec"], job_c, _workdir(job_c) / rel)}
        for label in ("RayCluster/verl/head", "Pod/gpu-task"):
            spec = pods[label][2]
            seen[label] = _backing(spec, spec["containers"][0], _workdir(spec["containers"][0]) / rel)
        assert len(set(seen.values())) == 1, (rel, seen)
    claims = {name for (_, name) in _objects("PersistentVolumeClaim")}
    for label, (_, _, spec) in pods.items():
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, f"{label}: claim {v} is not defined (storage.yaml)"
    for (_, name), pvc in _objects("PersistentVolumeClaim").items():
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], name  # mounted by pods on different nodes


# --- h. Kubernetes schemas ------------------------------------------------------------------------------------------

def _validate(doc: dict[str, Any], where: str) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"{where}: {exc.message} at {'.'.join(map(str, exc.path))} (Kubernetes {K8S_VERSION})") from None


def test_manifests_match_the_kubernetes_schemas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every object in infra/k8s, the rendered rollout Job and the Helm values' pod settings against Kubernetes'
    OpenAPI schemas (kubernetes-validate, strict: unknown fields fail); CRDs structurally + their pod templates."""
    import kubernetes_validate

    assert K8S_VERSION in kubernetes_validate.utils.all_versions(), kubernetes_validate.utils.all_versions()
    files = {p.name for p in K8S.glob("*.yaml")}
    assert set(NOT_MANIFESTS) <= files
    for file, doc in _manifests():
        where = f"{file}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        assert {"apiVersion", "kind", "metadata"} <= set(doc), where
        if doc["kind"] not in NO_SCHEMA:
            _validate(doc, where)
            continue
        assert doc["apiVersion"] == "ray.io/v1" and doc["metadata"].get("namespace"), where
        spec = doc["spec"]
        assert set(spec) <= {"rayVersion", "headGroupSpec", "workerGroupSpecs", "enableInTreeAutoscaling", "autoscalerOptions"}, where
        groups = [("head", spec["headGroupSpec"]), *[(g["groupName"], g) for g in spec["workerGroupSpecs"]]]
        for group, g in groups:
            assert all(isinstance(v, str) for v in g.get("rayStartParams", {}).values()), f"{where} {group}: rayStartParams are strings"
            if group != "head":
                assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], f"{where} {group}"
            _validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{doc['metadata']['name']}-{group}"},
                       "template": g["template"]}, f"{where} {group} template")
    # the rollout Job exactly as the controller submits it
    _validate(_render_job(_k8s_params(_ray_head()[2]), monkeypatch), "templates/agl-rollout-job.yaml.j2 (rendered)")
    # Helm values: the env, envFrom and volumes the chart puts into its pods
    values = yaml.safe_load((K8S / "airflow-values.yaml").read_text())
    assert values["executor"] == "KubernetesExecutor"
    container = {"name": "base", "image": f"{values['images']['airflow']['repository']}:{values['images']['airflow']['tag']}",
                 "env": values["env"], "envFrom": yaml.safe_load(values["extraEnvFrom"]),
                 "volumeMounts": values["scheduler"]["extraVolumeMounts"]}
    _validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "airflow-values"},
               "spec": {"containers": [container], "volumes": values["scheduler"]["extraVolumes"]}}, "airflow-values.yaml")


def test_the_clusters_routing_names_the_clusters_workers() -> None:
    """Every routing version the cluster's pods load (serving.routing_dir from the ConfigMap) resolves to a worker they
    have: params.yaml's own v1 names the local `base` worker, which does not exist there."""
    from pipeline.config import load_params
    from pipeline.serving import routing

    params = load_params(ROOT / "params.yaml", environ=_configmaps()["pipeline-serving"])
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        numbers = routing.versions(params.serving)
        assert numbers and all(routing.load_version(params.serving, n)["roles"] for n in numbers)
        with pytest.raises(routing.RoutingError, match="no worker 'base'"):
            routing.load_version(params.serving.model_copy(update={"routing_dir": "serving/routing"}), 1)
    finally:
        os.chdir(old)


def test_a_remote_proxy_is_health_checked_never_started_here(tmp_path: Path) -> None:
    """compose and Kubernetes run LiteLLM as its own service: stack.ensure must not try to bind its host's port."""
    from pipeline.config import load_params
    from pipeline.services.process import ServiceError
    from pipeline.serving import proxy

    params = load_params(ROOT / "params.yaml", environ={"PIPELINE__SERVING__PROXY__HOST": "litellm.mlops.svc",
                                                        "PIPELINE__SERVING__HOME": str(tmp_path)})
    with pytest.raises(ServiceError, match="remote and not healthy; it is not started from here"):
        proxy.up(params.serving)


# --- i. every service asks for credentials; no secret on a command line (issue #26) ---------------------------------

def _example_secrets() -> set[str]:
    """The secret variables of the committed example env files: every name left empty there (the rest are settings)."""
    names: set[str] = set()
    for path in INFRA.glob("*.example"):
        for line in path.read_text().splitlines():
            if line and not line.startswith("#") and line.endswith("="):
                names.add(line[:-1])
    return names


def test_compose_mlflow_runs_the_basic_auth_app(tmp_path: Path) -> None:
    """compose's MLflow is the basic-auth app with the same auth settings `make prod-stack` writes (every user reads,
    grants write), its admin password and Flask key from mlflow.env (which only MLflow's services read), its stores'
    URIs without passwords; the Airflow services authenticate as the writer user mlflow-init creates."""
    import configparser

    from pipeline.config import load_params
    from infra.local import prod_stack

    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    services = compose["services"]
    mlflow = services["mlflow"]
    (argv,) = _compose_argvs(_interpolate(mlflow["command"]))
    assert argv[:3] == ["mlflow", "server", "--app-name"] and _flag(argv, "--app-name") == "basic-auth"
    assert "--backend-store-uri" not in argv
    env = mlflow["environment"]
    assert urlsplit(env["MLFLOW_BACKEND_STORE_URI"]).password is None and env["PGPASSWORD"] == "${POSTGRES_PASSWORD}"
    mount = next(m for m in mlflow["volumes"] if m.split(":")[1] == env["MLFLOW_AUTH_CONFIG_PATH"])
    ini = configparser.ConfigParser()
    ini.read(INFRA / mount.split(":")[0])
    params = load_params(ROOT / "params.yaml", environ={"PIPELINE__PROD_STACK__HOME": str(tmp_path)})
    ours = configparser.ConfigParser()
    ours.read_string(prod_stack.mlflow_auth_ini(params.prod_stack))
    assert ini["mlflow"]["default_permission"] == ours["mlflow"]["default_permission"] == "READ"
    assert {k: v for k, v in ini["mlflow"].items() if k != "database_uri"} == {k: v for k, v in ours["mlflow"].items() if k != "database_uri"}
    for config in (ini, ours):
        uri = urlsplit(config["mlflow"]["database_uri"])
        assert uri.path == "/mlflow_auth" and uri.password is None and "admin_password" not in config["mlflow"]
    assert "mlflow_auth" in (INFRA / "postgres-init.sql").read_text() and "mlflow_auth" in prod_stack.DATABASES
    # the server's own secrets: mlflow.env, read by MLflow's services only
    holders = {name for name, svc in services.items() if "mlflow.env" in (svc.get("env_file") or [])}
    assert holders == {"mlflow", "mlflow-init"}
    server_secrets = {"MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY", "MLFLOW_READER_PASSWORD"}
    example = (INFRA / "mlflow.env.example").read_text()
    assert all(f"\n{name}=\n" in example for name in server_secrets)
    assert not any(name in (INFRA / "env.example").read_text() for name in server_secrets)
    # the Airflow services: the writer user, its password from the environment
    airflow_env = compose["x-airflow"]["environment"]
    assert airflow_env["MLFLOW_TRACKING_USERNAME"] == prod_stack.MLFLOW_USERS["writer"]
    assert airflow_env["MLFLOW_TRACKING_PASSWORD"] == "${MLFLOW_WRITER_PASSWORD}"  # noqa: S105 - a variable's name
    assert compose["x-airflow"]["depends_on"]["mlflow-init"] == {"condition": "service_completed_successfully"}
    # Kubernetes: the pods that log to MLflow read the writer's credentials from a Secret
    values = yaml.safe_load((K8S / "airflow-values.yaml").read_text())
    pods = _pods()
    for label, env_from in (("airflow-values.yaml", yaml.safe_load(values["extraEnvFrom"])),
                            ("Pod/gpu-task", pods["Pod/gpu-task"][2]["containers"][0]["envFrom"]),
                            ("RayCluster/verl/head", pods["RayCluster/verl/head"][2]["containers"][0]["envFrom"])):
        assert {"secretRef": {"name": "mlflow-writer-credentials"}} in env_from, label


def test_compose_redis_requires_a_password_from_a_secret() -> None:
    """Redis reads requirepass from a compose secret on its stdin (no argv), the secret is .env's REDIS_PASSWORD, and the
    Celery broker URL of every Airflow service carries that password; Postgres asks for SCRAM passwords on the socket too."""
    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    redis = compose["services"]["redis"]
    shell, flag, script = redis["command"]
    assert (shell, flag) == ("sh", "-c")
    assert script.startswith("exec redis-server - <<EOF\n") and "requirepass $$(cat /run/secrets/redis_password)" in script
    assert redis["secrets"] == ["redis_password"] and compose["secrets"]["redis_password"] == {"environment": "REDIS_PASSWORD"}
    assert "REDIS_PASSWORD" in _example_secrets()
    broker = compose["x-airflow"]["environment"]["AIRFLOW__CELERY__BROKER_URL"]
    url = urlsplit(_interpolate(broker, {"REDIS_PASSWORD": "from-the-env"}))
    assert url.scheme == "redis" and url.hostname == "redis" and url.password == "from-the-env"  # noqa: S105 - a test value
    postgres = compose["services"]["postgres"]["environment"]
    assert postgres["POSTGRES_HOST_AUTH_METHOD"] == "scram-sha-256"
    assert set(postgres["POSTGRES_INITDB_ARGS"].split()) == {"--auth-local=scram-sha-256", "--auth-host=scram-sha-256"}


def test_no_secret_on_any_command_line_in_compose() -> None:
    """`ps` in a container shows every argv: no compose command or healthcheck interpolates a secret variable (the
    empty names of the example env files), and none carries a URL with a password."""
    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    secret_names = _example_secrets()
    assert {"POSTGRES_PASSWORD", "REDIS_PASSWORD", "MLFLOW_WRITER_PASSWORD", "MLFLOW_AUTH_ADMIN_PASSWORD", "VLLM_API_KEY",
            "LITELLM_MASTER_KEY", "AWS_SECRET_ACCESS_KEY"} <= secret_names
    for name, svc in compose["services"].items():
        lines = [svc.get("command") or "", (svc.get("healthcheck") or {}).get("test") or ""]
        text = "\n".join(" ".join(map(str, x)) if isinstance(x, list) else str(x) for x in lines)
        used = set(re.findall(r"\$\{?(\w+)", text.replace("$$", "")))
        assert not used & secret_names, f"{name}: {sorted(used & secret_names)} on a command line"
        assert not re.search(r"://[^/\s:@]*:[^/\s@]+@", text), f"{name}: a URL with a password on a command line"


# --- j. NetworkPolicies and the Ray dashboard --------------------------------------------------------------------

# pods these manifests do not define, with the labels they carry: the Airflow chart's (its own labels: tier=airflow on
# every pod it creates) and the services deployed beside the manifests (the labels infra/README.md asks for)
OTHER_PODS = {
    "airflow-worker": {"tier": "airflow", "component": "worker", "release": "airflow"},   # a KubernetesExecutor task pod
    "airflow-api-server": {"tier": "airflow", "component": "api-server", "release": "airflow"},
    "airflow-scheduler": {"tier": "airflow", "component": "scheduler", "release": "airflow"},
    "redis": {"tier": "airflow", "component": "redis", "release": "airflow"},
    "postgres": {"app.kubernetes.io/name": "postgresql", "app.kubernetes.io/instance": "airflow"},
    "litellm": {"app": "litellm"}, "mlflow": {"app": "mlflow"}, "minio": {"app": "minio"},
}
AIRFLOW_PODS = {"airflow-worker", "airflow-api-server", "airflow-scheduler", "redis", "gpu-task"}
RAY_PODS = {"ray-head", "ray-worker"}
# who the architecture needs to reach each pod, on the port it serves (docs/architecture.md, infra/README.md)
EXPECTED_INGRESS: dict[tuple[str, int], set[str]] = {
    ("litellm", 4000): AIRFLOW_PODS | {"ray-head", "rollout"},
    ("vllm-society", 8000): {"litellm", "gpu-task", "ray-head"},
    ("vllm-judge", 8001): {"litellm", "gpu-task", "ray-head"},
    ("mlflow", 5000): AIRFLOW_PODS | {"ray-head", "rollout"},                  # rollout: the routed policy, as the reader
    ("minio", 9000): AIRFLOW_PODS | {"ray-head", "mlflow", "vllm-society"},   # vllm-society: its sync-adapters sidecar
    ("ray-head", 8090): RAY_PODS | {"rollout"},                                  # the RL gateway (agl-gateway)
    ("ray-head", 8265): RAY_PODS,                                                # Ray's dashboard (on loopback anyway)
    ("ray-head", 6379): RAY_PODS,                                                # Ray's GCS
    ("ray-worker", 10002): RAY_PODS,
    ("postgres", 5432): AIRFLOW_PODS | {"mlflow"},
    ("redis", 6379): AIRFLOW_PODS,
    ("airflow-api-server", 8080): AIRFLOW_PODS,                                  # the execution API of task pods
    ("gpu-task", 8793): AIRFLOW_PODS,                                            # a task pod's log server
    ("rollout", 8080): set(),                                                    # nothing connects to a rollout Job
}


def _policies() -> list[dict[str, Any]]:
    return [d for _, d in _manifests() if d["kind"] == "NetworkPolicy"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels + matchExpressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _admits(policies: list[dict[str, Any]], target: dict[str, str], port: int, client: dict[str, str]) -> bool:
    """Whether some ingress policy selecting the target pod lets the client pod (same namespace) in on ``port``."""
    for policy in policies:
        spec = policy["spec"]
        if "Ingress" not in spec.get("policyTypes", ["Ingress"]) or not _selects(spec["podSelector"], target):
            continue
        for rule in spec.get("ingress") or []:
            if rule.get("ports") and not any(p.get("port") == port for p in rule["ports"]):
                continue
            if any(_selects(peer["podSelector"], client) for peer in rule["from"]):
                return True
    return False


def _network_pods(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, str]]:
    """name -> labels of every pod the policies concern: ours (the manifests, the rendered rollout Job) and the others."""
    pods = _pods()
    job = _render_job(_k8s_params(_ray_head()[2]), monkeypatch)
    ours = {"gpu-task": pods["Pod/gpu-task"][1], "ray-head": pods["RayCluster/verl/head"][1], "ray-worker": pods["RayCluster/verl/gpu"][1],
            "vllm-society": pods["Deployment/vllm-society"][1], "vllm-judge": pods["Deployment/vllm-judge"][1],
            "rollout": job["spec"]["template"]["metadata"]["labels"]}
    return {**ours, **OTHER_PODS}


def test_network_policies_deny_by_default_and_validate() -> None:
    """Every NetworkPolicy validates against Kubernetes' schema; one denies all ingress in the namespace; every allow rule
    names its clients as pods of the namespace (no rule open to everything, no other namespace, no IP block)."""
    policies = _policies()
    for policy in policies:
        _validate(policy, f"network-policies.yaml: NetworkPolicy/{policy['metadata']['name']}")
        assert policy["metadata"]["namespace"] == "mlops", policy["metadata"]["name"]
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and p["spec"]["policyTypes"] == ["Ingress"] and not p["spec"].get("ingress")]
    assert len(deny) == 1, "one default-deny ingress policy for the whole namespace"
    for policy in policies:
        for rule in policy["spec"].get("ingress") or []:
            assert rule.get("from"), f"{policy['metadata']['name']}: a rule without `from` admits every pod and address"
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"} and peer["podSelector"], f"{policy['metadata']['name']}: {peer}"


def test_every_service_admits_exactly_its_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Service (ours and the ones deployed beside the manifests), and each pod-to-pod path that has none, admits
    exactly the clients the architecture needs on its port: e.g. the proxy <- Airflow, Ray head, rollout Jobs; vLLM <- the
    proxy, GPU task pods, Ray head; MLflow <- Airflow, Ray head; the gateway <- rollout Jobs; nothing reaches a rollout Job."""
    policies = _policies()
    pods = _network_pods(monkeypatch)
    for (target, port), expected in EXPECTED_INGRESS.items():
        admitted = {name for name, labels in pods.items() if _admits(policies, pods[target], port, labels)}
        assert admitted == expected, f"{target}:{port}: admits {sorted(admitted - expected)} too, not {sorted(expected - admitted)}"
    # every Service's pods and port are among the paths above
    services = {name: svc["spec"] for (_, name), svc in _objects("Service").items()}
    services |= {name: {"selector": OTHER_PODS[name], "ports": [{"port": port, "targetPort": port}]}
                 for name, port in (("mlflow", 5000), ("minio", 9000), ("litellm", 4000))}
    assert set(services) >= EXTERNAL_SERVICES
    for name, spec in services.items():
        behind = [pod for pod, labels in pods.items() if spec["selector"].items() <= labels.items()]
        assert behind, f"Service {name} selects no pod"
        for pod in behind:
            for port in spec["ports"]:
                key = (pod, port.get("targetPort", port["port"]))
                assert key in EXPECTED_INGRESS, f"Service {name}: {key} has no expected clients"
    # the sync-adapters sidecar is what the adapter-store label stands for
    for label, (_, labels, spec) in _pods().items():
        sidecar = any(c["name"] == "sync-adapters" for c in spec["containers"])
        assert (labels.get("pubmedqa-society.io/adapter-store") == "true") == sidecar, label


def test_ray_dashboard_listens_on_loopback_and_no_service_exposes_it() -> None:
    (ray,) = _objects("RayCluster").values()
    head = ray["spec"]["headGroupSpec"]
    params = head["rayStartParams"]
    assert params.get("dashboard-host") == "127.0.0.1" or params.get("include-dashboard") == "false", params
    assert EVERY_ADDRESS not in params.values()
    pods = _pods()
    ray_pods = [labels for label, (_, labels, _) in pods.items() if label.startswith("RayCluster/")]
    for (_, name), svc in _objects("Service").items():
        if any(svc["spec"]["selector"].items() <= labels.items() for labels in ray_pods):
            assert [p["targetPort"] for p in svc["spec"]["ports"]] == [8090], f"Service {name} exposes a Ray port"
    for _, _, spec in pods.values():
        for c in spec["containers"]:
            assert not {p["containerPort"] for p in c.get("ports", [])} & {8265, 52365, 10001}, c["name"]


# --- the workers' key on every path ---------------------------------------------------------------------------------

GUARD = "vllm_guard.KeyOnEveryPath"


def test_every_vllm_worker_in_compose_and_k8s_requires_the_key_on_every_path(tmp_path: Path) -> None:
    """vLLM 0.20.2 (the stock image's) checks --api-key only under /v1 (server_utils.AuthenticationMiddleware), so
    /invocations, /tokenize, /pooling and /scale_elastic_ep would answer anyone. Every stock-image worker loads the
    project's guard as `vllm serve`'s --middleware (a class: app.add_middleware, api_server.build_app of 0.20.2), from a
    folder on PYTHONPATH holding the local workers' own file alone; the guard imports with the standard library only."""
    import subprocess
    import sys

    guard_file = INFRA.parent / "pipeline/serving/vllm_guard.py"
    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    workers = {n: s for n, s in compose["services"].items() if str(s.get("image", "")).startswith("vllm/vllm-openai")}
    assert workers
    for name, svc in workers.items():
        argv = shlex.split(_interpolate(svc["command"]))
        assert _flag(argv, "--middleware") == GUARD, name
        folder = svc["environment"]["PYTHONPATH"]
        mounts = [v.split(":") for v in svc["volumes"] if str(v).endswith(":ro") and ":" in v]
        source = next(src for src, dest, _ in mounts if dest == f"{folder}/vllm_guard.py")
        assert (INFRA / source).resolve() == guard_file, name  # compose resolves a bind mount from the file's folder
    # the control image holds the checkout at /opt/project: the init container copies the guard out of it
    assert "COPY . /opt/project" in (INFRA / "docker/Dockerfile.control").read_text()
    deployments = [d for d in yaml.safe_load_all((INFRA / "k8s/vllm-deployment.yaml").read_text()) if d and d["kind"] == "Deployment"]
    for dep in deployments:
        spec = dep["spec"]["template"]["spec"]
        vllm = next(c for c in spec["containers"] if c["image"].startswith("vllm/vllm-openai"))
        assert _flag(vllm["args"], "--middleware") == GUARD, dep["metadata"]["name"]
        folder = _env(vllm)["PYTHONPATH"]
        volume = next(m["name"] for m in vllm["volumeMounts"] if m["mountPath"] == folder)
        init = next(c for c in spec["initContainers"] if any(m["name"] == volume for m in c["volumeMounts"]))
        dest = next(m["mountPath"] for m in init["volumeMounts"] if m["name"] == volume)
        assert init["command"] == ["cp", "/opt/project/pipeline/serving/vllm_guard.py", f"{dest}/vllm_guard.py"], init
        assert "control" in init["image"]
    # what the containers import: the file alone, no site-packages (-S), the key from the environment
    alone = tmp_path / "guard"
    alone.mkdir()
    (alone / "vllm_guard.py").write_bytes(guard_file.read_bytes())
    code = "import sys, vllm_guard; g = vllm_guard.KeyOnEveryPath(lambda *a: None); print(sorted(m for m in sys.modules if m.split('.')[0] == 'pipeline'))"
    out = subprocess.run([sys.executable, "-S", "-c", code], env={"PYTHONPATH": str(alone), "VLLM_API_KEY": "k"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    refused = subprocess.run([sys.executable, "-S", "-c", "import vllm_guard; vllm_guard.KeyOnEveryPath(lambda *a: None)"],
                             env={"PYTHONPATH": str(alone)}, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "VLLM_API_KEY is not set" in refused.stderr


def test_prod_dag_run_refuses_bad_params_and_a_stack_that_is_down_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`make prod-run CONF=...` with a typo in the JSON, or before `make prod-stack`: one line each, no traceback; and
    `prod buckets` with no S3 keys says so."""
    from infra.local import prod_stack
    from pipeline import cli
    from pipeline.services.process import free_port

    for conf, why in (("{tasks: 1}", "not JSON (Expecting property name enclosed in double quotes, column 2)"),
                      ("[1]", "must be a JSON object of the DAG's Params, not a list")):
        with pytest.raises(SystemExit):
            prod_stack.main(["dag-run", "--conf", conf])
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: argument --conf: {why}")
    port = free_port()
    monkeypatch.setenv("PIPELINE__PROD_STACK__HOME", str(tmp_path / "prod"))
    monkeypatch.setenv("PIPELINE__PROD_STACK__AIRFLOW_PORT", str(port))
    assert prod_stack.main(["dag-run", "--conf", '{"tasks": 1}']) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: Airflow's API at http://127.0.0.1:{port}: ") and err.count("\n") == 1, err
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert cli.main(["prod", "buckets"]) == 1
    assert capsys.readouterr().err == f"error: buckets at http://127.0.0.1:{port}: Unable to locate credentials\n"
