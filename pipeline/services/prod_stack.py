"""The production executor on one host, without Docker: ``python -m pipeline prod up|status|dag-run|down``.

What ``infra/docker-compose.yml`` runs in containers, started here from Debian's packages and the
control environment, on loopback: Postgres (Airflow metadata, Celery results, MLflow backend store),
Redis (Celery broker), an S3-compatible server for MLflow artifacts and the DVC remote (moto's
server here: MinIO has no Debian package; compose and Kubernetes use MinIO), MLflow, and Airflow with
the CeleryExecutor: api-server, scheduler, dag-processor, triggerer and one Celery worker per queue
(``default``, and ``gpu`` where the DAG puts its GPU-bound tasks). The two stacks are kept in step
by ``COMPOSE`` and ``AIRFLOW_ENV_NAMES`` (tests/test_infra.py compares them with the compose file).

Every process is a ``process.Service`` under ``prod_stack.home``; the database password, the S3 keys,
Airflow's JWT/API secrets and Fernet key are generated there on first start (mode 0600), never in git.
``dag-run`` triggers the DAG through Airflow's REST API, follows it, and prints which worker ran
each task: a task of the ``gpu`` queue that ran anywhere but the ``gpu`` worker is an error.

Only the standard library is imported at module level: Airflow workers import ``worker_hostname``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.config import Params, ProdStackParams
from pipeline.envs import REPO_ROOT
from pipeline.services import airflow_server
from pipeline.services.process import Service, ServiceError, port_is_free, start, stop

# our component -> the infra/docker-compose.yml service it stands for
COMPOSE = {
    "postgres": "postgres", "redis": "redis", "s3": "minio", "mlflow": "mlflow",
    "airflow-apiserver": "airflow-apiserver", "airflow-scheduler": "airflow-scheduler",
    "airflow-dag-processor": "airflow-dag-processor", "airflow-triggerer": "airflow-triggerer",
    "airflow-worker-default": "airflow-worker", "airflow-worker-gpu": "airflow-worker-gpu",
}
# the Airflow settings both stacks must give every Airflow process
AIRFLOW_ENV_NAMES = (
    "AIRFLOW__CORE__EXECUTOR", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CELERY__RESULT_BACKEND",
    "AIRFLOW__CELERY__BROKER_URL", "AIRFLOW__CORE__LOAD_EXAMPLES", "AIRFLOW__CORE__DAGS_FOLDER",
    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "PIPELINE_ROOT", "MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL",
)
DAG_ID = "agent_retraining"


def worker_hostname() -> str:
    """``core.hostname_callable`` of the Celery workers: the queue in the name each task instance
    records, so the UI, the API and ``dag-run`` show which worker ran it (both run on this host)."""
    return f"{os.environ.get('PIPELINE_WORKER_QUEUE', 'worker')}-worker.{socket.gethostname()}"


# --- paths, secrets, environments -----------------------------------------------------------

def _home(cfg: ProdStackParams) -> Path:
    return Path(cfg.home).resolve()


def _secret(cfg: ProdStackParams, name: str, make: Any = lambda: secrets.token_hex(20)) -> str:
    path = _home(cfg) / "secrets" / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(make())
        tmp.chmod(0o600)
        tmp.replace(path)
    return path.read_text().strip()


def _fernet_key() -> str:
    import base64

    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()


def _db_url(cfg: ProdStackParams, db: str, scheme: str = "postgresql+psycopg2") -> str:
    return f"{scheme}://airflow:{_secret(cfg, 'postgres_password')}@{cfg.host}:{cfg.postgres_port}/{db}"


def s3_env(cfg: ProdStackParams) -> dict[str, str]:
    """What every S3 client of the stack gets (MLflow server, DVC, boto3): endpoint and keys."""
    return {"AWS_ENDPOINT_URL": f"http://{cfg.host}:{cfg.s3_port}", "MLFLOW_S3_ENDPOINT_URL": f"http://{cfg.host}:{cfg.s3_port}",
            "AWS_ACCESS_KEY_ID": _secret(cfg, "s3_access_key", lambda: "pipeline" + secrets.token_hex(6)),
            "AWS_SECRET_ACCESS_KEY": _secret(cfg, "s3_secret_key"), "AWS_DEFAULT_REGION": "us-east-1"}


def mlflow_uri(cfg: ProdStackParams) -> str:
    return f"http://{cfg.host}:{cfg.mlflow_port}"


def airflow_url(cfg: ProdStackParams) -> str:
    return f"http://{cfg.host}:{cfg.airflow_port}"


def airflow_env(cfg: ProdStackParams, project: Path = REPO_ROOT) -> dict[str, str]:
    """The environment of every Airflow process (and so of every task): infra/docker-compose.yml's x-airflow."""
    home = _home(cfg) / "airflow"
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": _db_url(cfg, "airflow"),
        "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + _db_url(cfg, "airflow", "postgresql"),
        "AIRFLOW__CELERY__BROKER_URL": f"redis://{cfg.host}:{cfg.redis_port}/0",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(project / "dags"),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{airflow_url(cfg)}/execution/",
        "AIRFLOW__API__HOST": cfg.host,
        "AIRFLOW__API__PORT": str(cfg.airflow_port),
        "AIRFLOW__API__BASE_URL": airflow_url(cfg),
        "AIRFLOW__API_AUTH__JWT_SECRET": _secret(cfg, "airflow_jwt_secret"),
        "AIRFLOW__API__SECRET_KEY": _secret(cfg, "airflow_api_secret"),
        "AIRFLOW__CORE__FERNET_KEY": _secret(cfg, "airflow_fernet_key", _fernet_key),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "True",
        "PIPELINE_ROOT": str(project),
        "MLFLOW_TRACKING_URI": mlflow_uri(cfg),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(project), os.environ.get("PYTHONPATH")])),
        **s3_env(cfg),
    }


# --- Postgres and Redis from Debian's packages -------------------------------------------------

def _pg_bin(name: str) -> str:
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda p: int(p.parent.parent.name))
    if found:
        return str(found[-1])
    if which := shutil.which(name):
        return which
    raise ServiceError(f"PostgreSQL's {name} not found: install Debian's postgresql package (scripts/setup_prod_stack.sh)")


def _as_postgres(cmd: list[str]) -> list[str]:
    """Postgres refuses to run as root: as root, run its binaries as the package's ``postgres`` user."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _pg_dirs(cfg: ProdStackParams) -> tuple[Path, Path]:
    base = _home(cfg) / "postgres"
    return base / "data", base / "run"


def _pg_ready(cfg: ProdStackParams) -> bool:
    return subprocess.run([_pg_bin("pg_isready"), "-q", "-h", cfg.host, "-p", str(cfg.postgres_port)], check=False).returncode == 0


def _psql(cfg: ProdStackParams, sql: str, db: str = "postgres") -> str:
    _, run = _pg_dirs(cfg)
    proc = subprocess.run(_as_postgres([_pg_bin("psql"), "-h", str(run), "-p", str(cfg.postgres_port), "-U", "postgres", "-d", db,
                                        "-v", "ON_ERROR_STOP=1", "-tAc", sql]), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ServiceError(f"postgres: {sql.split()[0]} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def postgres_up(cfg: ProdStackParams) -> None:
    data, run = _pg_dirs(cfg)
    if not (data / "PG_VERSION").exists():
        data.mkdir(parents=True, exist_ok=True, mode=0o700)
        run.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(data.parent, "postgres")
            for d in (data, run):
                shutil.chown(d, "postgres")
            if subprocess.run(_as_postgres(["test", "-w", str(data)]), check=False).returncode != 0:
                raise ServiceError(f"postgres: the postgres user cannot reach {data} (a parent directory is not traversable, "
                                   "e.g. mode 0700): put prod_stack.home under a directory others may traverse")
        proc = subprocess.run(_as_postgres([_pg_bin("initdb"), "-D", str(data), "-U", "postgres", "-E", "UTF8", "--auth-local=trust",
                                            "--auth-host=scram-sha-256", "--no-instructions"]), capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ServiceError(f"postgres: initdb {data} failed: {proc.stderr.strip()[-2000:]}")
    service = Service("postgres", _home(cfg))
    _free_or_ours(service, cfg.host, cfg.postgres_port, "prod_stack.postgres_port")
    cmd = _as_postgres([_pg_bin("postgres"), "-D", str(data), "-h", cfg.host, "-p", str(cfg.postgres_port), "-k", str(run),
                        "-c", "max_connections=200"])
    start(service, cmd, lambda: _pg_ready(cfg), timeout_s=60, identity={"data": str(data), "port": cfg.postgres_port})
    password = _secret(cfg, "postgres_password")
    if _psql(cfg, "SELECT 1 FROM pg_roles WHERE rolname = 'airflow'") != "1":
        _psql(cfg, f"CREATE ROLE airflow LOGIN PASSWORD '{password}'")  # hex: nothing to quote
    for db in ("airflow", "mlflow"):  # the two databases of infra/postgres-init.sql + compose's POSTGRES_DB
        if _psql(cfg, f"SELECT 1 FROM pg_database WHERE datname = '{db}'") != "1":  # noqa: S608 - our two constant names
            _psql(cfg, f"CREATE DATABASE {db} OWNER airflow")


def _redis_ready(cfg: ProdStackParams) -> bool:
    try:
        with socket.create_connection((cfg.host, cfg.redis_port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def redis_up(cfg: ProdStackParams) -> None:
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServiceError("redis-server not found: install Debian's redis-server package (scripts/setup_prod_stack.sh)")
    data = _home(cfg) / "redis"
    data.mkdir(parents=True, exist_ok=True)
    service = Service("redis", _home(cfg))
    _free_or_ours(service, cfg.host, cfg.redis_port, "prod_stack.redis_port")
    cmd = [binary, "--bind", cfg.host, "--port", str(cfg.redis_port), "--dir", str(data), "--appendonly", "yes", "--save", ""]
    start(service, cmd, lambda: _redis_ready(cfg), timeout_s=30)


# --- S3, MLflow ---------------------------------------------------------------------------------

def s3_up(cfg: ProdStackParams) -> None:
    from pipeline.services import buckets

    service = Service("s3", _home(cfg))
    _free_or_ours(service, cfg.host, cfg.s3_port, "prod_stack.s3_port")
    start(service, [sys.executable, "-m", "moto.server", "-H", cfg.host, "-p", str(cfg.s3_port)],
          f"http://{cfg.host}:{cfg.s3_port}/moto-api/", timeout_s=60)
    env = s3_env(cfg)
    buckets.ensure(cfg.buckets, endpoint_url=env["AWS_ENDPOINT_URL"], region=env["AWS_DEFAULT_REGION"],
                   access_key=env["AWS_ACCESS_KEY_ID"], secret_key=env["AWS_SECRET_ACCESS_KEY"])


def mlflow_up(cfg: ProdStackParams) -> None:
    service = Service("mlflow", _home(cfg))
    _free_or_ours(service, cfg.host, cfg.mlflow_port, "prod_stack.mlflow_port")
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", cfg.host, "--port", str(cfg.mlflow_port), "--workers", "1",
           "--artifacts-destination", f"s3://{cfg.buckets[0]}/artifacts"]
    # the store URI (with its password) through the environment, not the process list
    env = {**s3_env(cfg), "MLFLOW_BACKEND_STORE_URI": _db_url(cfg, "mlflow", "postgresql"), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    start(service, cmd, f"{mlflow_uri(cfg)}/health", env=env, timeout_s=180, identity={"cmd": cmd, "store": "postgres/mlflow"})


# --- Airflow with the CeleryExecutor ------------------------------------------------------------

def _health(cfg: ProdStackParams, component: str) -> bool:
    import httpx

    try:
        body = httpx.get(f"{airflow_url(cfg)}/api/v2/monitor/health", timeout=2.0).json()
    except (httpx.HTTPError, ValueError):
        return False
    return (body.get(component) or {}).get("status") == "healthy"


def worker_name(queue: str) -> str:
    """The Celery node name of the worker serving ``queue``."""
    return f"{queue}@{socket.gethostname()}"


def worker_ready(cfg: ProdStackParams, queue: str) -> bool:
    """The queue's Celery worker answers a ping through the broker."""
    from celery import Celery

    app = Celery(broker=f"redis://{cfg.host}:{cfg.redis_port}/0")
    try:
        return bool(app.control.ping(destination=[worker_name(queue)], timeout=1.0))
    finally:
        app.close()


def airflow_up(cfg: ProdStackParams, project: Path = REPO_ROOT) -> dict[str, str]:
    env = airflow_env(cfg, project)
    home = Path(env["AIRFLOW_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    airflow = airflow_server.airflow_bin()
    full_env = {**os.environ, **env}
    migrate = subprocess.run([airflow, "db", "migrate"], env=full_env, capture_output=True, text=True, check=False)
    if migrate.returncode != 0:
        raise ServiceError(f"airflow db migrate failed: {migrate.stderr[-2000:]}")
    subprocess.run([airflow, "pools", "set", "gpu", str(cfg.workers.get("gpu", 1)), "GPU-bound stages: one slot per GPU worker process"],
                   env=full_env, capture_output=True, check=True)
    ident = {"project": str(project), "home": str(home)}
    api = Service("airflow-apiserver", _home(cfg))
    _free_or_ours(api, cfg.host, cfg.airflow_port, "prod_stack.airflow_port")
    start(api, [airflow, "api-server", "--host", cfg.host, "--port", str(cfg.airflow_port)], f"{airflow_url(cfg)}/api/v2/monitor/health",
          env=env, timeout_s=240, cwd=project, identity=ident)
    for component, key in (("scheduler", "scheduler"), ("dag-processor", "dag_processor"), ("triggerer", "triggerer")):
        start(Service(f"airflow-{component}", _home(cfg)), [airflow, component], lambda key=key: _health(cfg, key),  # type: ignore[misc]
              env=env, timeout_s=240, cwd=project, identity=ident)
    for queue, concurrency in cfg.workers.items():
        worker_env = {**env, "PIPELINE_WORKER_QUEUE": queue,
                      "AIRFLOW__CORE__HOSTNAME_CALLABLE": "pipeline.services.prod_stack.worker_hostname",
                      # two workers on one host: each serves its task logs on its own port
                      "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(_free_port_for(cfg, f"log-{queue}"))}
        start(Service(f"airflow-worker-{queue}", _home(cfg)),
              [airflow, "celery", "worker", "--queues", queue, "--concurrency", str(concurrency), "--celery-hostname", worker_name(queue)],
              lambda queue=queue: worker_ready(cfg, queue), env=worker_env, timeout_s=240, cwd=project,  # type: ignore[misc]
              identity={**ident, "queue": queue, "concurrency": concurrency})
    return {"url": airflow_url(cfg), "user": "admin", "password": airflow_server.admin_password(home)}


def _free_port_for(cfg: ProdStackParams, name: str) -> int:
    """A stable port per name (kept in the home, so a restart reuses it)."""
    path = _home(cfg) / "ports.json"
    ports = json.loads(path.read_text()) if path.exists() else {}
    if name not in ports or not port_is_free(cfg.host, ports[name]):
        from pipeline.services.process import free_port

        ports[name] = free_port(cfg.host)
        path.write_text(json.dumps(ports))
    return int(ports[name])


def _free_or_ours(service: Service, host: str, port: int, param: str) -> None:
    if service.pid() is None and not port_is_free(host, port):
        raise ServiceError(f"port {port} on {host} is held by a process this stack did not start (its {service.name} would "
                           f"run from {service.home}); stop it or set {param} to a free port.")


# --- the whole stack ----------------------------------------------------------------------------

ORDER = list(COMPOSE)  # start order; stopped in reverse


def up(params: Params, project: Path = REPO_ROOT) -> dict[str, str]:
    cfg = params.prod_stack
    postgres_up(cfg)
    redis_up(cfg)
    s3_up(cfg)
    mlflow_up(cfg)
    info = airflow_up(cfg, project)
    return {**info, "mlflow": mlflow_uri(cfg), "s3": f"http://{cfg.host}:{cfg.s3_port}", "home": str(_home(cfg))}


def down(params: Params) -> list[str]:
    home = _home(params.prod_stack)
    stopped = []
    for name in reversed(ORDER):
        t0 = time.monotonic()
        if stop(Service(name, home), grace_s=30):
            stopped.append(name)
        if time.monotonic() - t0 > 10:
            print(f"prod stack: {name} took {time.monotonic() - t0:.0f}s to stop", flush=True)
    return stopped


def status(params: Params) -> dict[str, bool]:
    home = _home(params.prod_stack)
    return {name: Service(name, home).pid() is not None for name in ORDER}


def drop_s3_remote(project: Path) -> bool:
    """Undo ``use_s3_remote`` (the stack's S3 goes away with it): the committed default remote is back."""
    proc = subprocess.run([sys.executable, "-m", "dvc", "remote", "remove", "--local", "s3"], cwd=project, capture_output=True, check=False)
    return proc.returncode == 0


def use_s3_remote(params: Params, project: Path) -> None:
    """Point ``project``'s DVC at the stack's S3 remote, in ``.dvc/config.local`` (the committed default stays)."""
    cfg = params.prod_stack
    env = {**os.environ, **s3_env(cfg)}
    dvc = [sys.executable, "-m", "dvc"]
    for args in (["remote", "add", "--local", "--force", "--default", "s3", cfg.dvc_remote],
                 ["remote", "modify", "--local", "s3", "endpointurl", f"http://{cfg.host}:{cfg.s3_port}"]):
        subprocess.run([*dvc, *args], cwd=project, env=env, check=True, capture_output=True)


# --- one DAG run through the REST API -------------------------------------------------------------

def _api(cfg: ProdStackParams) -> Any:
    import httpx

    home = _home(cfg) / "airflow"
    password = airflow_server.admin_password(home)
    token = httpx.post(f"{airflow_url(cfg)}/auth/token", json={"username": "admin", "password": password}, timeout=30).raise_for_status()
    return httpx.Client(base_url=f"{airflow_url(cfg)}/api/v2", headers={"Authorization": f"Bearer {token.json()['access_token']}"}, timeout=60)


def dag_run(params: Params, conf: dict[str, Any], timeout_s: float = 3600.0, poll_s: float = 10.0) -> dict[str, Any]:
    """Trigger the DAG, follow it to the end, and return the run with where each task instance ran."""
    cfg = params.prod_stack
    api = _api(cfg)
    deadline = time.monotonic() + 300
    while api.get(f"/dags/{DAG_ID}").status_code == 404:  # the dag-processor has not parsed it yet
        if time.monotonic() > deadline:
            raise ServiceError(f"{DAG_ID} never appeared in Airflow at {airflow_url(cfg)}: see {cfg.home}/airflow-dag-processor.log")
        time.sleep(2)
    api.patch(f"/dags/{DAG_ID}", json={"is_paused": False}).raise_for_status()
    run = api.post(f"/dags/{DAG_ID}/dagRuns", json={"logical_date": None, "conf": conf}).raise_for_status().json()
    run_id = run["dag_run_id"]
    print(f"dag-run: {DAG_ID} {run_id} triggered; UI {airflow_url(cfg)}/dags/{DAG_ID}/runs/{run_id}", flush=True)
    seen: dict[str, str] = {}
    said_ahead = False
    deadline = time.monotonic() + timeout_s
    while True:
        state = api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}").raise_for_status().json()["state"]
        if state == "queued" and not said_ahead and (ahead := _runs_ahead(api, run_id)):
            said_ahead = True
            print(f"dag-run: waiting behind {', '.join(ahead)} (max_active_runs=1)", flush=True)
        tis = api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances", params={"limit": 200}).raise_for_status().json()["task_instances"]
        for ti in tis:
            key = ti["task_id"] + (f"[{ti['map_index']}]" if ti["map_index"] >= 0 else "")
            if ti["state"] and seen.get(key) != ti["state"]:
                seen[key] = ti["state"]
                print(f"  {key:<20} {ti['state']:<16} queue={ti['queue']} on {ti['hostname'] or '-'}", flush=True)
        if state in ("success", "failed"):
            break
        if time.monotonic() > deadline:
            raise ServiceError(f"{DAG_ID} {run_id} still {state} after {timeout_s:.0f}s")
        time.sleep(poll_s)
    return {"run_id": run_id, "state": state, "task_instances": tis}


def _runs_ahead(api: Any, run_id: str) -> list[str]:
    """Active runs other than ``run_id``. Airflow 3.3's CronTriggerTimetable schedules the latest past cron
    point when a DAG is first unpaused (``catchup=False`` ignores ``run_immediately=False`` there), a moment
    after ``dag-run`` unpauses it; with ``max_active_runs=1`` that run goes first."""
    runs = api.get(f"/dags/{DAG_ID}/dagRuns", params={"state": ["queued", "running"]}).raise_for_status().json()["dag_runs"]
    return [r["dag_run_id"] for r in runs if r["dag_run_id"] != run_id]


def misplaced(task_instances: list[dict[str, Any]]) -> list[str]:
    """Task instances that ran on a worker other than their queue's (queue routing broken)."""
    return [f"{ti['task_id']} (queue {ti['queue']}) ran on {ti['hostname']}" for ti in task_instances
            if ti["state"] in ("success", "failed") and ti["hostname"] and not ti["hostname"].startswith(f"{ti['queue']}-worker.")]


# --- CLI ----------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down", "status", "dag-run", "buckets"],
                        help="buckets: only the boto3 bucket bootstrap, against $AWS_ENDPOINT_URL (compose's and k8s' init step)")
    parser.add_argument("--conf", default="{}", help="dag-run: the run's Params as JSON, e.g. '{\"tasks\": 1, \"eval_limit\": 1}'")
    parser.add_argument("--timeout-s", type=float, default=3600.0)


def main(args: argparse.Namespace, params: Params) -> int:
    cfg = params.prod_stack
    if args.action == "up":
        info = up(params)
        use_s3_remote(params, REPO_ROOT)
        print(f"prod stack up (CeleryExecutor; workers {', '.join(cfg.workers)}): Airflow UI {info['url']} user admin password "
              f"{info['password']}; MLflow {info['mlflow']} (Postgres store, artifacts s3://{cfg.buckets[0]}); "
              f"S3 {info['s3']} (DVC remote {cfg.dvc_remote}, now this checkout's default in .dvc/config.local); home {info['home']}")
        return 0
    if args.action == "down":
        print(f"prod stack: stopped {', '.join(down(params)) or 'nothing'}"
              + ("; DVC's default remote is the committed one again" if drop_s3_remote(REPO_ROOT) else ""))
        return 0
    if args.action == "buckets":
        from pipeline.services import buckets

        created = buckets.ensure(cfg.buckets)
        print(f"buckets: created {', '.join(created) or 'none'}; present {', '.join(cfg.buckets)}")
        return 0
    if args.action == "status":
        for name, running in status(params).items():
            print(f"{name:<24} {'up' if running else 'down'}  (compose service: {COMPOSE[name]})")
        return 0
    result = dag_run(params, json.loads(args.conf), timeout_s=args.timeout_s)
    wrong = misplaced(result["task_instances"])
    for line in wrong:
        print(f"misplaced: {line}", file=sys.stderr)
    print(f"dag-run: {result['run_id']} {result['state']}")
    return 0 if result["state"] == "success" and not wrong else 1
