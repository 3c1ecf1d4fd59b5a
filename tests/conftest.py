"""Shared fixtures: a throwaway project directory and a real MLflow server on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.config import Params, load_params
from pipeline.envs import model_python
from pipeline.services.process import free_port
from pipeline.serving import proxy, stack, worker

ROOT = Path(__file__).resolve().parent.parent
PUBMEDQA = Path(os.environ.get("PUBMEDQA_DIR", ROOT.parent / "shared" / "data" / "pubmedqa"))
SOURCE = PUBMEDQA / "ori_pqal.json"
TEST_IDS = PUBMEDQA / "test_ground_truth.json"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Modules of fast tests only run first, so they share the cores with the learning cycle started at collection
    # (pytest_collection_finish) instead of the suite waiting for it alone; modules with any service-starting test keep
    # their order after them. Whole modules move, so a module-scoped fixture is still set up once.
    heavy = {item.path for item in items if item.get_closest_marker("slow") or item.get_closest_marker("e2e")}
    items.sort(key=lambda item: item.path in heavy)
    if not SOURCE.exists():
        skip = pytest.mark.skip(reason=f"PubMedQA not found at {SOURCE} (set PUBMEDQA_DIR)")
        for item in items:
            if "pubmedqa" in item.fixturenames:
                item.add_marker(skip)


@pytest.fixture
def pubmedqa() -> dict[str, dict]:
    return json.loads(SOURCE.read_text())


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A scratch project root: params.yaml with absolute data paths; cwd moved there."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["data"]["source"] = str(SOURCE)
    params["data"]["test_ids"] = str(TEST_IDS)
    params["data"]["allow"]["local_roots"] = [str(PUBMEDQA), "."]  # the shared data and this scratch project
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith("PIPELINE__")]:
        monkeypatch.delenv(key)
    return tmp_path


def section(name: str, **update: object) -> Any:
    """A params.yaml section with a test's changes: every other value from the file, as a stage sees it (the code
    holds no defaults, #27)."""
    return getattr(load_params(ROOT / "params.yaml", environ={}), name).model_copy(update=update)


def set_param(root: Path, dotted: str, value: object) -> None:
    path = root / "params.yaml"
    params = yaml.safe_load(path.read_text())
    node = params
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node[key]
    node[leaf] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def over_length(schema: Any, scale: float, answer: dict[str, Any]) -> list[str]:
    """The fields of a structured ``answer`` longer than ``schema``'s strings allow at agents.text_scale ``scale``."""
    limits = schema.json_schema(scale)["properties"]
    over = []
    for field, value in answer.items():
        bound = limits[field].get("maxLength") or limits[field].get("items", {}).get("maxLength")
        if bound is not None and any(len(v) > bound for v in (value if isinstance(value, list) else [value])):
            over.append(field)
    return over


def mlflow_login(user: str = "writer") -> dict[str, str]:
    """The environment a process outside the pipeline's own setup logs in to a local server with (basic auth, #44):
    the reader for what only looks, the writer for what logs and registers."""
    from pipeline.config import load_params
    from pipeline.services.mlflow_server import password
    from pipeline.services.mlflow_users import MLFLOW_USERS

    return {"MLFLOW_TRACKING_USERNAME": MLFLOW_USERS[user],
            "MLFLOW_TRACKING_PASSWORD": password(load_params(ROOT / "params.yaml").mlflow, user)}


_MLFLOW: dict[str, Any] = {}  # the session's tracking server: started once, early when the learning cycle runs


def session_tracking_server(home: Path) -> str:
    """The session's MLflow server (SQLite + local artifacts, MLflow's basic-auth app) started by the project's code,
    once: by the first test that needs it, or at collection when the learning cycle starts in the background."""
    if not _MLFLOW:
        from pipeline.services import mlflow_server as server

        params = load_params(ROOT / "params.yaml", environ={"PIPELINE__MLFLOW__PORT": str(free_port()),
                                                             "PIPELINE__MLFLOW__HOME": str(home)})
        saved = os.environ.pop("MLFLOW_TRACKING_URI", None)
        _MLFLOW.update(uri=server.ensure(params.mlflow), params=params.mlflow, home=home, saved=saved)
    return str(_MLFLOW["uri"])


def pytest_collection_finish(session: pytest.Session) -> None:
    """The learning cycle (tests/test_learning_loop.py: one small `make run`, the suite's longest wait) starts as soon
    as the tests are collected and runs beside the modules before it, on the cores they leave idle (#54)."""
    if session.config.option.collectonly or not SOURCE.exists():
        return
    if any(item.path.name == "test_learning_loop.py" for item in session.items):
        from tests import test_learning_loop

        factory = session.config._tmp_path_factory  # type: ignore[attr-defined]  # pytest's own, as tmp_path_factory
        test_learning_loop.start(session_tracking_server(factory.mktemp("mlflow")), factory.mktemp("cycle"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session that ends before the cycle's tests (interrupted, -x) stops it; then the tracking server."""
    from tests import test_learning_loop

    test_learning_loop.stop()
    if "stack" in _EARLY:  # started ahead: let its start end, whichever way, before stopping what it started
        with contextlib.suppress(Exception):
            _EARLY["stack"].result(timeout=600)
    if "serving" in _EARLY:  # a stack no fixture stopped: started ahead and never used, or its start failed half-way
        stack.down(_EARLY.pop("serving"))
    _EARLY.clear()
    if _MLFLOW:
        from pipeline.services import mlflow_server as server

        server.down(_MLFLOW["params"])
        if _MLFLOW["saved"] is not None:
            os.environ["MLFLOW_TRACKING_URI"] = _MLFLOW["saved"]
        _MLFLOW.clear()


@pytest.fixture(scope="session")
def mlflow_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(_MLFLOW["home"]) if _MLFLOW else tmp_path_factory.mktemp("mlflow")


@pytest.fixture(scope="session")
def mlflow_server(mlflow_home: Path) -> str:
    """The session's MLflow server (see :func:`session_tracking_server`); stopped when the session finishes."""
    return session_tracking_server(mlflow_home)


@contextlib.contextmanager
def airflow_browser(url: str, user: str, password: str, wait_s: int = 15) -> Iterator[Any]:
    """Headless Chromium (Debian's, `scripts/setup_browser.sh`) through Selenium, logged into the Airflow UI at ``url``."""
    from selenium import webdriver
    from selenium.webdriver.common.by import By

    assert shutil.which("chromium") and shutil.which("chromedriver"), "run scripts/setup_browser.sh (make test-all does)"
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1100"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=shutil.which("chromedriver")))
    driver.implicitly_wait(wait_s)
    try:
        driver.get(f"{url}/auth/login?next=%2F")
        driver.find_element(By.NAME, "username").send_keys(user)
        driver.find_element(By.NAME, "password").send_keys(password)
        driver.find_element(By.XPATH, "//button[normalize-space()='Sign in']").click()
        driver.find_element(By.XPATH, "//*[normalize-space()='Dags']")  # logged in: the nav renders
        yield driver
    finally:
        driver.quit()


def dvc_stages(root: Path = ROOT) -> dict[str, dict[str, Any]]:
    """dvc.yaml's stages as DVC resolves them: params interpolated, each ``foreach`` expanded (``train_sft@<role>``)."""
    import yaml
    from dvc.parsing import DataResolver
    from dvc.repo import Repo

    repo = Repo(str(root))
    try:
        return DataResolver(repo, repo.root_dir, yaml.safe_load((root / "dvc.yaml").read_text())).resolve()["stages"]
    finally:
        repo.close()


def copy_project(dest: Path) -> Path:
    """Copy the tracked project files (what a fresh clone has) into ``dest`` and make it a git repo."""
    import subprocess

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        src = ROOT / rel
        if src.is_file() and not rel.startswith(("data/", "models/", "reports/validation/")):
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"], cwd=dest, check=True)
    return dest


# (in, out) features of SmolLM2-135M's projections (models/base): hidden 576, 9 heads and 3 KV heads of 64, MLP 1536
SMOLLM2_135M = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
                "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}


def lora_safetensors(rank: int, layers: list[str], decoder_layers: int = 2,
                     dims: dict[str, tuple[int, int]] = SMOLLM2_135M) -> bytes:
    """An adapter_model.safetensors as PEFT writes it (header written by hand: the control plane has no torch), with
    zero lora_A [rank, in] / lora_B [out, rank] weights on ``layers`` (q_proj, gate_proj, ...) of ``decoder_layers``
    decoder layers of a model with projections ``dims``."""
    header, offset = {}, 0
    for i in range(decoder_layers):
        for layer in layers:
            block = "self_attn" if layer in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            fin, fout = dims[layer]
            for ab, shape in (("A", [rank, fin]), ("B", [fout, rank])):
                size = 4 * shape[0] * shape[1]
                header[f"base_model.model.model.layers.{i}.{block}.{layer}.lora_{ab}.weight"] = {
                    "dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
                offset += size
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + bytes(offset)


# --- the real serving plane, shared by the serving and rollout integration tests (slow) ---

ADAPTER = """
import sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).save_pretrained(sys.argv[2])
"""


def _make_serving_models(root: Path) -> Path:
    """Base + test models materialised by the project's stage (the learning cycle's, when it ran it) and a LoRA adapter."""
    from tests import test_learning_loop

    made = test_learning_loop.materialized(load_params(ROOT / "params.yaml", environ={}).models)
    if made is not None:  # the learning cycle's stage already made them from the same params: the same bytes (#54)
        shutil.copytree(made["base"], root / "base")
        shutil.copytree(made["test"], root / "tiny")
    else:
        env_params = {"PIPELINE__MODELS__BASE__OUT_DIR": str(root / "base"), "PIPELINE__MODELS__TEST__OUT_DIR": str(root / "tiny")}
        # run from the scratch folder: the stage's metrics file must not land in the checkout's reports/
        # (a changed DVC metric there would make the next `dvc repro` re-materialise the model)
        subprocess.run([sys.executable, "-m", "pipeline", "--params", str(ROOT / "params.yaml"), "materialize-model", "--no-mlflow"],
                       cwd=root, check=True, env={**_clean_env(), **env_params}, capture_output=True)
    subprocess.run([model_python(), "-c", ADAPTER, str(root / "base"), str(root / "adapter-a")], check=True, capture_output=True)
    return root


_EARLY: dict[str, Any] = {}  # the session's models and serving stack, made while the learning cycle's tests wait for it


def serving_ahead(factory: pytest.TempPathFactory, session: pytest.Session) -> None:
    """Make the session's models and start its serving stack in the background, once, if a test of ``session`` uses it:
    called by the learning cycle's module when it starts waiting for the cycle, whose stages leave part of a core idle
    (service start-ups, one-request waits). The stack's boot is then off the suite's critical path, where the first
    module to use it paid for it (#54)."""
    if _EARLY or not any("serving_stack" in item.fixturenames for item in session.items):
        return
    models, home = factory.mktemp("models"), factory.mktemp("serving")
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="serving-ahead")
    made = pool.submit(_make_serving_models, models)
    _EARLY.update(models=made, stack=pool.submit(lambda: _serving_stack_up(made.result(), home)))
    pool.shutdown(wait=False)


@pytest.fixture(scope="session")
def serving_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Base + test models materialised by the project's stage and a LoRA adapter (:func:`_make_serving_models`)."""
    if "models" in _EARLY:
        return Path(_EARLY["models"].result())
    return _make_serving_models(tmp_path_factory.mktemp("models"))


GPU_RELEASES = ROOT / ".venv" / "gpu-unpacked"  # the GPU image's own vLLM, unsloth, trl, transformers (make setup)


def gpu_releases_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a model-venv process that imports the GPU image's releases (then this checkout) first."""
    assert GPU_RELEASES.is_dir(), f"{GPU_RELEASES} missing: run `make setup` (scripts/setup_envs.sh unpacks it)"
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE__", "MLFLOW_"))},
            "PYTHONPATH": f"{GPU_RELEASES}{os.pathsep}{ROOT}", **(env or {})}


def run_in_model_venv(argv: list[str], stdin: str | None = None, timeout: int = 300,
                      env: dict[str, str] | None = None) -> dict[str, Any]:
    """``python argv`` in the model venv (``env``; default: this checkout on its path, offline); returns the JSON object
    its last stdout line prints."""
    proc = subprocess.run([model_python(), *argv], input=stdin, capture_output=True, text=True, timeout=timeout,
                          env=env or {**_clean_env(), "HF_HUB_OFFLINE": "1"}, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_with_gpu_releases(argv: list[str], stdin: str | None = None, timeout: int = 300,
                          env: dict[str, str] | None = None) -> dict[str, Any]:
    """:func:`run_in_model_venv` with the GPU image's releases first on its path (then this checkout), for the contract
    tests of the GPU path."""
    return run_in_model_venv(argv, stdin, timeout, gpu_releases_env(env))


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE__")} | {"PYTHONPATH": str(ROOT)}


def _serving_stack_up(serving_models: Path, home: Path) -> Params:
    """One vLLM worker (base model + adapter-a) behind the proxy; a second worker is never started."""
    (home / "versions").mkdir()
    (home / "versions" / "v1.yaml").write_text((ROOT / "serving/routing/v1.yaml").read_text())
    base, down = free_port(), free_port()
    workers = (f"[{{name: base, model: '{serving_models / 'base'}', port: {base}, dtype: float32, lora_modules: {{adapter-a: '{serving_models / 'adapter-a'}'}}}},"
               f" {{name: offline, model: '{serving_models / 'base'}', port: {down}, dtype: float32}}]")
    p = load_params(ROOT / "params.yaml", environ={
        "PIPELINE__SERVING__WORKERS": workers, "PIPELINE__SERVING__HOME": str(home / "run"),
        "PIPELINE__SERVING__ROUTING_DIR": str(home / "versions"), "PIPELINE__SERVING__PROXY__PORT": str(free_port()),
        "PIPELINE__SERVING__PROXY__KEY_FILE": str(home / "secrets" / "key"),
        "PIPELINE__SERVING__WORKER_DEFAULTS__KEY_FILE": str(home / "secrets" / "worker_key"),
        "PIPELINE__SERVING__LIVE_FILE": str(home / "live-routing.json")})  # never the repository's tracked file
    _EARLY["serving"] = p.serving  # whoever started it stops it: the fixture, or the session's end if it never did
    with ThreadPoolExecutor(max_workers=1) as pool:  # side by side, as stack.ensure starts them
        proxy_up = pool.submit(proxy.up, p.serving)
        try:
            worker.up(p.serving, p.serving.workers[0])  # the "offline" worker is deliberately not started
        finally:
            proxy_up.result()
    return p


@pytest.fixture(scope="session")
def serving_stack(serving_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Params]:
    """The session's serving stack (:func:`_serving_stack_up`), started ahead when the learning cycle ran first."""
    p = _EARLY["stack"].result() if "stack" in _EARLY else _serving_stack_up(serving_models, tmp_path_factory.mktemp("serving"))
    try:
        yield p
    finally:
        stack.down(p.serving)
        _EARLY.pop("serving", None)
