"""The production executor on one host, without Docker: what ``make prod-stack|prod-run|prod-down`` run.

    python infra/local/prod_stack.py [--params FILE] up|status|dag-run|down   (the repository root on PYTHONPATH,
                                                                               as the Makefile exports it)

What ``infra/docker-compose.yml`` runs in containers, started here from Debian's packages and the
control environment, on loopback: Postgres (Airflow metadata, Celery results, MLflow backend store),
Redis (Celery broker), an S3-compatible server for MLflow artifacts and the DVC remote (moto's
server here: MinIO has no Debian package; compose and Kubernetes use MinIO), MLflow, and Airflow with
the CeleryExecutor: api-server, scheduler, dag-processor, triggerer and one Celery worker per queue
(``default``, and ``gpu`` where the DAG puts its GPU-bound tasks). The two stacks are kept in step
by ``COMPOSE`` and ``AIRFLOW_ENV_NAMES`` (tests/test_infra.py compares them with the compose file).

This is infrastructure, not pipeline code: it imports the ``pipeline`` package (the params schema, process
supervision, the deploy steps every stack shares: ``pipeline.services.buckets``, ``pipeline.services.mlflow_users``),
never the other way round. ``python -m pipeline prod up|status|dag-run|down`` runs this script in a child process.

Every process is a ``process.Service`` under ``prod_stack.home``; its secrets (the Postgres superuser's and
the ``airflow`` role's passwords, Redis' password, the S3 keys, MLflow's admin/writer/reader passwords and Flask
key, Airflow's JWT/API secrets and Fernet key) are generated there on first start, never in git. Every service
authenticates its clients (docs/security.md): Postgres asks every connection, socket or TCP, for a SCRAM-SHA-256
password (pg_hba.conf below, no ``trust``); Redis requires a password (``requirepass`` in a 0600 config file);
the S3 server accepts only requests signed with the stack's key; MLflow runs its basic-auth app (the Airflow
workers log, register and promote as a writer user, everyone else reads). No secret is ever on a command line
(``ps`` shows every argv): they reach the services through 0600 files and the children's environments.
Secrets, configs and logs are created 0600, the stack's folders 0700 (0711 for the home as root, so that
the ``postgres`` user reaches its data folder).
``dag-run`` triggers the DAG through Airflow's REST API, follows it, and prints which worker ran
each task: a task of the ``gpu`` queue that ran anywhere but the ``gpu`` worker is an error (the workers name
themselves with ``pipeline.services.airflow_server.worker_hostname``).
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import hmac
import importlib.util
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import redis
from celery import Celery
from werkzeug.serving import run_simple
from werkzeug.wrappers import Request, Response

from pipeline.config import ParamsError, ProdStackParams, load_params
from pipeline.envs import REPO_ROOT, pythonpath
from pipeline.services import airflow_server, buckets
from pipeline.services.mlflow_users import MLFLOW_ADMIN, MLFLOW_USERS, provision_mlflow_users
from pipeline.services.process import Service, ServiceError, free_port, port_is_free, start, stop

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
    "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
)
DAG_ID = "agent_retraining"
PG_SUPERUSER = "postgres"
# infra/postgres-init.sql + compose's POSTGRES_DB: Airflow's metadata and Celery results, MLflow's store, its users
DATABASES = ("airflow", "mlflow", "mlflow_auth")
S3_USER = "pipeline"  # the IAM user of the stack's S3 server: the only identity whose signed requests it serves


# --- paths, secrets, environments -----------------------------------------------------------

def _home(prod_stack: ProdStackParams) -> Path:
    return Path(prod_stack.home).resolve()


def _is_root() -> bool:
    return os.geteuid() == 0


def _private_dir(path: Path, mode: int = 0o700) -> Path:
    """A folder only its owner may list and enter (``mode`` exactly, whatever the umask)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)
    return path


def _home_mode() -> int:
    """The stack's home: 0700; as root 0711, so that the ``postgres`` user can traverse it to its data folder
    (it still cannot list it, and every file in it is 0600)."""
    return 0o711 if _is_root() else 0o700


def _home_dir(prod_stack: ProdStackParams) -> Path:
    return _private_dir(_home(prod_stack), _home_mode())


def write_private(path: Path, text: str, keep_existing: bool = False) -> Path:
    """Write ``text`` to ``path`` readable by its owner only: created 0600 (never for a moment with the umask's
    mode, as write-then-chmod would be), then renamed over ``path``; with ``keep_existing`` linked to ``path`` only
    if there is none yet (two processes creating one secret agree on the first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    if not keep_existing:
        os.replace(tmp, path)
        return path
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path


def _secret(prod_stack: ProdStackParams, name: str, make: Any = lambda: secrets.token_hex(20)) -> str:
    path = _home(prod_stack) / "secrets" / name
    if not path.exists():
        _private_dir(path.parent)
        write_private(path, make(), keep_existing=True)
    return path.read_text().strip()


def _service(prod_stack: ProdStackParams, name: str) -> Service:
    """The stack's service ``name``, its log (the child's stdout and stderr, which ``process.start`` appends
    to) created 0600 first: service logs may carry connection strings and tracebacks with secrets."""
    service = Service(name, _home_dir(prod_stack), _home_mode())  # `start` keeps the home at this mode
    fd = os.open(service.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.close(fd)
    service.log_file.chmod(0o600)
    return service


def _fernet_key() -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()


def _db_url(prod_stack: ProdStackParams, db: str, scheme: str = "postgresql+psycopg2", password: bool = True) -> str:
    """The ``airflow`` role's URL of ``db``; ``password=False`` leaves the password to libpq (``PGPASSWORD``)."""
    login = f"airflow:{_secret(prod_stack, 'postgres_password')}" if password else "airflow"
    return f"{scheme}://{login}@{prod_stack.host}:{prod_stack.postgres_port}/{db}"


def broker_url(prod_stack: ProdStackParams) -> str:
    """Celery's broker URL, with Redis' password: only ever in an environment (``AIRFLOW__CELERY__BROKER_URL``)
    or in memory, never on a command line or in a message."""
    return f"redis://:{_secret(prod_stack, 'redis_password')}@{prod_stack.host}:{prod_stack.redis_port}/0"


def mlflow_client_env(prod_stack: ProdStackParams, user: str = "writer") -> dict[str, str]:
    """How an MLflow client authenticates to the stack's server (MLflow's client reads these two variables)."""
    name = MLFLOW_USERS[user]
    return {"MLFLOW_TRACKING_USERNAME": name, "MLFLOW_TRACKING_PASSWORD": _secret(prod_stack, f"mlflow_{user}_password")}


def s3_env(prod_stack: ProdStackParams) -> dict[str, str]:
    """What every S3 client of the stack gets (MLflow server, DVC, boto3): endpoint and keys."""
    endpoint = f"http://{prod_stack.host}:{prod_stack.s3_port}"
    return {"AWS_ENDPOINT_URL": endpoint, "MLFLOW_S3_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": _secret(prod_stack, "s3_access_key", lambda: "pipeline" + secrets.token_hex(6)),
            "AWS_SECRET_ACCESS_KEY": _secret(prod_stack, "s3_secret_key"), "AWS_DEFAULT_REGION": "us-east-1"}


def mlflow_uri(prod_stack: ProdStackParams) -> str:
    return f"http://{prod_stack.host}:{prod_stack.mlflow_port}"


def airflow_url(prod_stack: ProdStackParams) -> str:
    return f"http://{prod_stack.host}:{prod_stack.airflow_port}"


def airflow_env(prod_stack: ProdStackParams, project: Path = REPO_ROOT) -> dict[str, str]:
    """The environment of every Airflow process (and so of every task): infra/docker-compose.yml's x-airflow."""
    home = _home(prod_stack) / "airflow"
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": _db_url(prod_stack, "airflow"),
        "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + _db_url(prod_stack, "airflow", "postgresql"),
        "AIRFLOW__CELERY__BROKER_URL": broker_url(prod_stack),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(project / "dags"),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{airflow_url(prod_stack)}/execution/",
        "AIRFLOW__API__HOST": prod_stack.host,
        "AIRFLOW__API__PORT": str(prod_stack.airflow_port),
        "AIRFLOW__API__BASE_URL": airflow_url(prod_stack),
        "AIRFLOW__API_AUTH__JWT_SECRET": _secret(prod_stack, "airflow_jwt_secret"),
        "AIRFLOW__API__SECRET_KEY": _secret(prod_stack, "airflow_api_secret"),
        "AIRFLOW__CORE__FERNET_KEY": _secret(prod_stack, "airflow_fernet_key", _fernet_key),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "True",
        "PIPELINE_ROOT": str(project),
        "MLFLOW_TRACKING_URI": mlflow_uri(prod_stack),
        **mlflow_client_env(prod_stack, "writer"),  # tasks log, register and promote: the writer user
        "PYTHONPATH": os.pathsep.join(filter(None, [str(project), os.environ.get("PYTHONPATH")])),
        **s3_env(prod_stack),
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
    return ["runuser", "-u", "postgres", "--", *cmd] if _is_root() else cmd


def _pg_dirs(prod_stack: ProdStackParams) -> tuple[Path, Path]:
    base = _home(prod_stack) / "postgres"
    return base / "data", base / "run"


def _to_postgres(*paths: Path) -> None:
    """As root, hand ``paths`` to the ``postgres`` user (the server and initdb run as it)."""
    if _is_root():
        for path in paths:
            shutil.chown(path, "postgres")


def scram_verifier(password: str, salt: bytes | None = None, iterations: int = 4096) -> str:
    """What PostgreSQL stores for a SCRAM-SHA-256 password (RFC 5802/7677): ``CREATE/ALTER ROLE ... PASSWORD``
    with it never carries the password itself, neither over the socket nor into a server log line."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(hashlib.sha256(client_key).digest())}:{b64(server_key)}"


def pg_hba_conf() -> str:
    """The stack's pg_hba.conf, rewritten on every start: every connection proves a password with SCRAM-SHA-256,
    over the Unix socket as over TCP; no ``trust`` (any local user could connect as anyone), no ``peer``; TCP
    only from this host's own addresses (the server listens on ``prod_stack.host``)."""
    return ("# written by infra/local/prod_stack.py on every start; edits are overwritten\n"
            "# TYPE  DATABASE  USER  ADDRESS       METHOD\n"
            "local   all       all                 scram-sha-256\n"
            "host    all       all   127.0.0.1/32  scram-sha-256\n"
            "host    all       all   ::1/128       scram-sha-256\n"
            "host    all       all   samehost      scram-sha-256\n")


def hba_trusts(text: str) -> bool:
    """Whether a pg_hba.conf lets any connection in without a password (``trust``)."""
    return any(line.split()[-1:] == ["trust"] for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def _write_hba(data: Path) -> None:
    _to_postgres(write_private(data / "pg_hba.conf", pg_hba_conf()))


def initdb_argv(prod_stack: ProdStackParams, pwfile: Path) -> list[str]:
    """initdb with password authentication from the first start: the superuser's password comes from ``pwfile``
    (a 0600 file, removed right after), never from the command line."""
    data, _ = _pg_dirs(prod_stack)
    return _as_postgres([_pg_bin("initdb"), "-D", str(data), "-U", PG_SUPERUSER, "-E", "UTF8", "--auth-local=scram-sha-256",
                         "--auth-host=scram-sha-256", f"--pwfile={pwfile}", "--no-instructions"])


def postgres_argv(prod_stack: ProdStackParams) -> list[str]:
    data, run = _pg_dirs(prod_stack)
    return _as_postgres([_pg_bin("postgres"), "-D", str(data), "-h", prod_stack.host, "-p", str(prod_stack.postgres_port),
                         "-k", str(run),
                         "-c", "max_connections=200", "-c", "password_encryption=scram-sha-256",
                         "-c", "unix_socket_permissions=0700"])  # the socket: its owner (the server's user) only


def _pg_ready(prod_stack: ProdStackParams) -> bool:
    argv = [_pg_bin("pg_isready"), "-q", "-h", prod_stack.host, "-p", str(prod_stack.postgres_port)]
    return subprocess.run(argv, check=False).returncode == 0


def psql_argv(prod_stack: ProdStackParams, db: str = "postgres") -> list[str]:
    """psql as the superuser over the socket; the SQL goes to its stdin and the password in ``PGPASSWORD`` of
    its environment only (``_psql``): neither is on the command line."""
    _, run = _pg_dirs(prod_stack)
    return _as_postgres([_pg_bin("psql"), "-X", "-q", "-h", str(run), "-p", str(prod_stack.postgres_port),
                         "-U", PG_SUPERUSER, "-d", db,
                         "-v", "ON_ERROR_STOP=1", "-tA"])


def _psql(prod_stack: ProdStackParams, sql: str, db: str = "postgres") -> str:
    env = {**os.environ, "PGPASSWORD": _secret(prod_stack, "postgres_superuser_password")}
    proc = subprocess.run(psql_argv(prod_stack, db), input=sql, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ServiceError(f"postgres: {sql.split()[0]} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def postgres_up(prod_stack: ProdStackParams) -> None:
    _home_dir(prod_stack)
    data, run = _pg_dirs(prod_stack)
    superuser_password = _secret(prod_stack, "postgres_superuser_password")
    if not (data / "PG_VERSION").exists():
        for d in (data.parent, data, run):
            _private_dir(d)
        _to_postgres(data.parent, data, run)
        if _is_root() and subprocess.run(_as_postgres(["test", "-w", str(data)]), check=False).returncode != 0:
            raise ServiceError(f"postgres: the postgres user cannot reach {data} (a parent directory is not traversable, "
                               "e.g. mode 0700): put prod_stack.home under a directory others may traverse")
        pwfile = write_private(data.parent / "initdb.pw", superuser_password + "\n")
        _to_postgres(pwfile)
        try:
            proc = subprocess.run(initdb_argv(prod_stack, pwfile), capture_output=True, text=True, check=False)
        finally:
            pwfile.unlink(missing_ok=True)
        if proc.returncode != 0:
            raise ServiceError(f"postgres: initdb {data} failed: {proc.stderr.strip()[-2000:]}")
    # a cluster this stack initialised before it used passwords trusts local users and its superuser has no
    # password yet: start it once as it is, give the superuser its password, then switch to pg_hba_conf()
    hba = data / "pg_hba.conf"
    legacy = hba_trusts(hba.read_text()) if hba.exists() else False
    if not legacy:
        _write_hba(data)
    service = _service(prod_stack, "postgres")
    _free_or_ours(service, prod_stack.host, prod_stack.postgres_port, "prod_stack.postgres_port")
    start(service, postgres_argv(prod_stack), lambda: _pg_ready(prod_stack), timeout_s=60,
          identity={"data": str(data), "port": prod_stack.postgres_port, "auth": "scram-sha-256"})
    if legacy:
        _psql(prod_stack, f"ALTER ROLE {PG_SUPERUSER} WITH PASSWORD '{scram_verifier(superuser_password)}';")
        _write_hba(data)
    _psql(prod_stack, "SELECT pg_reload_conf();")  # a server that was already running reads pg_hba.conf again
    # the airflow role (Airflow's metadata and Celery results, MLflow's stores): its password as a SCRAM verifier
    _psql(prod_stack, "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'airflow') "
                      "THEN CREATE ROLE airflow LOGIN; END IF; END $$;\n"
               f"ALTER ROLE airflow WITH LOGIN PASSWORD '{scram_verifier(_secret(prod_stack, 'postgres_password'))}';")
    for db in DATABASES:
        if _psql(prod_stack, f"SELECT 1 FROM pg_database WHERE datname = '{db}';") != "1":  # noqa: S608 - our constant names
            _psql(prod_stack, f"CREATE DATABASE {db} OWNER airflow;")


def redis_conf(prod_stack: ProdStackParams) -> str:
    """redis-server's config, in a 0600 file: its password (``requirepass``) is here, not on its command line."""
    data = _home(prod_stack) / "redis"
    return "\n".join([
        "# written by infra/local/prod_stack.py (mode 0600) on every start",
        f"bind {prod_stack.host}", f"port {prod_stack.redis_port}", "protected-mode yes",
        f"dir {json.dumps(str(data), ensure_ascii=False)}",
        "appendonly yes", 'save ""', f"requirepass {_secret(prod_stack, 'redis_password')}", ""])


def _redis_bin() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServiceError("redis-server not found: install Debian's redis-server package (scripts/setup_prod_stack.sh)")
    return binary


def redis_argv(prod_stack: ProdStackParams) -> list[str]:
    return [_redis_bin(), str(_home(prod_stack) / "redis" / "redis.conf")]


def _redis_ready(prod_stack: ProdStackParams) -> bool:
    client = redis.Redis(host=prod_stack.host, port=prod_stack.redis_port, password=_secret(prod_stack, "redis_password"),
                         socket_timeout=1.0)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def redis_up(prod_stack: ProdStackParams) -> None:
    data = _private_dir(_home_dir(prod_stack) / "redis")
    write_private(data / "redis.conf", redis_conf(prod_stack))
    service = _service(prod_stack, "redis")
    _free_or_ours(service, prod_stack.host, prod_stack.redis_port, "prod_stack.redis_port")
    start(service, redis_argv(prod_stack), lambda: _redis_ready(prod_stack), timeout_s=30,
          identity={"cmd": redis_argv(prod_stack), "auth": "requirepass"})


# --- S3, MLflow ---------------------------------------------------------------------------------

def s3_gate(method: str, path: str, headers: Any) -> tuple[int, str] | None:
    """What the stack's S3 server answers itself, before moto sees a request (None: moto serves it).

    moto's ``/moto-api/`` endpoints take no credentials and would let anyone reset its data or switch its
    authentication off (``/moto-api/reset-auth``) or dump every object and key (``/moto-api/data.json``): only
    the health probe ``GET /moto-api/`` is left, answered here. A request without a SigV4 ``Authorization`` header
    is refused here too (moto's IAM check would fail it with a 500); so are presigned URLs, which moto's
    authentication does not verify."""
    if path.rstrip("/") == "/moto-api":
        return (200, "ok") if method in ("GET", "HEAD") else (403, "moto's API is closed on this server")
    if path.startswith("/moto-api"):
        return 403, "moto's API is closed on this server"
    if not str(headers.get("Authorization") or "").startswith("AWS4-HMAC-SHA256 "):
        return 403, "AccessDenied: sign every request with the stack's key (SigV4 Authorization header; no presigned URLs)"
    return None


def s3_app(key: str, secret: str) -> Any:
    """moto's S3 server as a WSGI app that serves only requests signed with ``key``/``secret``.

    moto can check request signatures (its IAM emulation, ``INITIAL_NO_AUTH_ACTION_COUNT``) but only against the
    access keys of IAM users it generated itself, and ``python -m moto.server`` has no option to give it keys. So the
    IAM user ``pipeline`` is created in moto's backend with the stack's key and a policy allowing S3, signature checks
    are on from the first request, and ``s3_gate`` closes moto's unauthenticated API. Changes moto's process-wide
    state: only the stack's ``s3`` service process (``s3_server``) calls it."""
    # moto: a 0.4 s import that sets up process-wide mock backends, for the s3-server process only
    from moto import settings  # noqa: PLC0415 - s3-server process only (0.4 s import)
    from moto.core import DEFAULT_ACCOUNT_ID  # noqa: PLC0415 - s3-server process only
    from moto.iam.models import iam_backends  # noqa: PLC0415 - s3-server process only
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app  # noqa: PLC0415 - s3-server only

    iam = iam_backends[DEFAULT_ACCOUNT_ID]["aws"]
    iam.create_user(region_name="us-east-1", user_name=S3_USER)
    iam.put_user_policy(S3_USER, "s3", json.dumps({"Version": "2012-10-17",
                                                   "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    access_key = iam.create_access_key(S3_USER)  # moto draws its own id and secret: replace them with the stack's
    iam.access_keys.pop(access_key.access_key_id)
    access_key.access_key_id, access_key.secret_access_key = key, secret
    iam.access_keys[key] = access_key
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # every request from now on is authenticated
    moto_app = DomainDispatcherApplication(create_backend_app)

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        request = Request(environ)
        refused = s3_gate(request.method, request.path, request.headers)
        if refused is None:
            return moto_app(environ, start_response)
        return Response(refused[1], status=refused[0], mimetype="text/plain")(environ, start_response)

    return app


def s3_server(host: str, port: int) -> None:
    """The stack's ``s3`` service: ``s3_app`` with the key from this process' environment (``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY``, never argv), on ``host:port``."""
    from moto.moto_server.werkzeug_app import MotoRequestHandler  # noqa: PLC0415 - s3-server process only (0.4 s import)

    os.environ.setdefault("MOTO_PORT", str(port))
    app = s3_app(os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
    run_simple(host, port, app, threaded=True, request_handler=MotoRequestHandler)


def s3_argv(prod_stack: ProdStackParams) -> list[str]:
    """This script's ``s3-server`` (run with the repository root on PYTHONPATH: ``s3_up``)."""
    return [sys.executable, str(Path(__file__).resolve()), "s3-server", prod_stack.host, str(prod_stack.s3_port)]


def s3_up(prod_stack: ProdStackParams) -> None:
    service = _service(prod_stack, "s3")
    _free_or_ours(service, prod_stack.host, prod_stack.s3_port, "prod_stack.s3_port")
    env = s3_env(prod_stack)
    start(service, s3_argv(prod_stack), f"http://{prod_stack.host}:{prod_stack.s3_port}/moto-api/", timeout_s=60, cwd=REPO_ROOT,
          env={**env, "PYTHONPATH": pythonpath()},
          identity={"cmd": s3_argv(prod_stack), "auth": f"sigv4 iam user {S3_USER}"})
    buckets.ensure(prod_stack.buckets, prod_stack.s3, endpoint_url=env["AWS_ENDPOINT_URL"], region=env["AWS_DEFAULT_REGION"],
                   access_key=env["AWS_ACCESS_KEY_ID"], secret_key=env["AWS_SECRET_ACCESS_KEY"])


def mlflow_auth_ini(prod_stack: ProdStackParams) -> str:
    """MLflow's basic-auth config (``MLFLOW_AUTH_CONFIG_PATH``; keys of mlflow/server/auth/config.py): every user
    reads, only grants write; users live in Postgres' ``mlflow_auth``, reached with ``PGPASSWORD`` from the server's
    environment. No password here: the admin's comes from ``MLFLOW_AUTH_ADMIN_PASSWORD`` on the first start."""
    return "\n".join([
        "[mlflow]", "default_permission = READ",
        f"database_uri = postgresql://airflow@{prod_stack.host}:{prod_stack.postgres_port}/mlflow_auth",
        f"admin_username = {MLFLOW_ADMIN}", "authorization_function = mlflow.server.auth:authenticate_request_basic_auth",
        "grant_default_workspace_access = false", f"auth_cache_ttl_seconds = {prod_stack.mlflow_auth_cache_ttl_s}", ""])


def mlflow_argv(prod_stack: ProdStackParams) -> list[str]:
    return [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth",
            "--host", prod_stack.host, "--port", str(prod_stack.mlflow_port),
            "--workers", "1", "--artifacts-destination", f"s3://{prod_stack.buckets[0]}/artifacts"]


def mlflow_server_env(prod_stack: ProdStackParams) -> dict[str, str]:
    """The MLflow server's environment: where its secrets reach it (the command line has none)."""
    return {**s3_env(prod_stack),
            "MLFLOW_BACKEND_STORE_URI": _db_url(prod_stack, "mlflow", "postgresql", password=False),
            "PGPASSWORD": _secret(prod_stack, "postgres_password"),  # libpq's, for the backend and the auth store
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "MLFLOW_AUTH_CONFIG_PATH": str(_home(prod_stack) / "mlflow" / "basic_auth.ini"),
            "MLFLOW_AUTH_ADMIN_USERNAME": MLFLOW_ADMIN,
            "MLFLOW_AUTH_ADMIN_PASSWORD": _secret(prod_stack, "mlflow_admin_password"),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": _secret(prod_stack, "mlflow_flask_secret_key")}


def mlflow_auth_available() -> bool:
    """MLflow's basic-auth app imports Flask-WTF (the ``mlflow[auth]`` extra) for its CSRF protection."""
    return importlib.util.find_spec("flask_wtf") is not None


def _require_mlflow_auth() -> None:
    if not mlflow_auth_available():
        raise ServiceError("MLflow's basic-auth app needs Flask-WTF (mlflow[auth]), which this environment lacks: "
                           "add Flask-WTF (and WTForms) to requirements/control.lock.txt")


def mlflow_up(prod_stack: ProdStackParams) -> None:
    _require_mlflow_auth()
    write_private(_private_dir(_home_dir(prod_stack) / "mlflow") / "basic_auth.ini", mlflow_auth_ini(prod_stack))
    service = _service(prod_stack, "mlflow")
    _free_or_ours(service, prod_stack.host, prod_stack.mlflow_port, "prod_stack.mlflow_port")
    cmd = mlflow_argv(prod_stack)
    start(service, cmd, f"{mlflow_uri(prod_stack)}/health", env=mlflow_server_env(prod_stack), timeout_s=180,
          identity={"cmd": cmd, "store": "postgres/mlflow", "auth": "basic-auth postgres/mlflow_auth"})
    provision_mlflow_users(mlflow_uri(prod_stack), _secret(prod_stack, "mlflow_admin_password"),
                           {role: _secret(prod_stack, f"mlflow_{role}_password") for role in MLFLOW_USERS})


# --- Airflow with the CeleryExecutor ------------------------------------------------------------

def _health(prod_stack: ProdStackParams, component: str) -> bool:
    try:
        body = httpx.get(f"{airflow_url(prod_stack)}/api/v2/monitor/health", timeout=2.0).json()
    except (httpx.HTTPError, ValueError):
        return False
    return (body.get(component) or {}).get("status") == "healthy"


def worker_name(queue: str) -> str:
    """The Celery node name of the worker serving ``queue``."""
    return f"{queue}@{socket.gethostname()}"


def worker_ready(prod_stack: ProdStackParams, queue: str) -> bool:
    """The queue's Celery worker answers a ping through the broker."""
    app = Celery(broker=broker_url(prod_stack))
    try:
        return bool(app.control.ping(destination=[worker_name(queue)], timeout=1.0))
    finally:
        app.close()


def airflow_up(prod_stack: ProdStackParams, project: Path = REPO_ROOT) -> dict[str, str]:
    env = airflow_env(prod_stack, project)
    home = _private_dir(Path(env["AIRFLOW_HOME"]))  # airflow.cfg, the admin's password file, task logs
    airflow = airflow_server.airflow_bin()
    full_env = {**os.environ, **env}
    migrate = subprocess.run([airflow, "db", "migrate"], env=full_env, capture_output=True, text=True, check=False)
    if migrate.returncode != 0:
        raise ServiceError(f"airflow db migrate failed: {migrate.stderr[-2000:]}")
    subprocess.run([airflow, "pools", "set", "gpu", str(prod_stack.workers.get("gpu", 1)),
                    "GPU-bound stages: one slot per GPU worker process"],
                   env=full_env, capture_output=True, check=True)
    ident = {"project": str(project), "home": str(home)}
    api = _service(prod_stack, "airflow-apiserver")
    _free_or_ours(api, prod_stack.host, prod_stack.airflow_port, "prod_stack.airflow_port")
    start(api, [airflow, "api-server", "--host", prod_stack.host, "--port", str(prod_stack.airflow_port)],
          f"{airflow_url(prod_stack)}/api/v2/monitor/health",
          env=env, timeout_s=240, cwd=project, identity=ident)
    for component, key in (("scheduler", "scheduler"), ("dag-processor", "dag_processor"), ("triggerer", "triggerer")):
        start(_service(prod_stack, f"airflow-{component}"), [airflow, component], functools.partial(_health, prod_stack, key),
              env=env, timeout_s=240, cwd=project, identity=ident)
    for queue, concurrency in prod_stack.workers.items():
        worker_env = {**env, "PIPELINE_WORKER_QUEUE": queue,
                      "AIRFLOW__CORE__HOSTNAME_CALLABLE": "pipeline.services.airflow_server.worker_hostname",
                      # two workers on one host: each serves its task logs on its own port
                      "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(_free_port_for(prod_stack, f"log-{queue}"))}
        start(_service(prod_stack, f"airflow-worker-{queue}"),
              [airflow, "celery", "worker", "--queues", queue, "--concurrency", str(concurrency),
               "--celery-hostname", worker_name(queue)],
              functools.partial(worker_ready, prod_stack, queue), env=worker_env, timeout_s=240, cwd=project,
              identity={**ident, "queue": queue, "concurrency": concurrency})
    return {"url": airflow_url(prod_stack), "user": "admin", "password": airflow_server.admin_password(home)}


def _free_port_for(prod_stack: ProdStackParams, name: str) -> int:
    """A stable port per name (kept in the home, so a restart reuses it)."""
    path = _home(prod_stack) / "ports.json"
    ports = json.loads(path.read_text()) if path.exists() else {}
    if name not in ports or not port_is_free(prod_stack.host, ports[name]):
        ports[name] = free_port(prod_stack.host)
        path.write_text(json.dumps(ports))
    return int(ports[name])


def _free_or_ours(service: Service, host: str, port: int, param: str) -> None:
    if service.pid() is None and not port_is_free(host, port):
        raise ServiceError(f"port {port} on {host} is held by a process this stack did not start (its {service.name} would "
                           f"run from {service.home}); stop it or set {param} to a free port.")


# --- the whole stack ----------------------------------------------------------------------------

ORDER = list(COMPOSE)  # start order; stopped in reverse


def up(prod_stack: ProdStackParams, project: Path = REPO_ROOT) -> dict[str, str]:
    _require_mlflow_auth()  # before anything starts
    postgres_up(prod_stack)
    redis_up(prod_stack)
    s3_up(prod_stack)
    mlflow_up(prod_stack)
    info = airflow_up(prod_stack, project)
    return {**info, "mlflow": mlflow_uri(prod_stack), "s3": f"http://{prod_stack.host}:{prod_stack.s3_port}",
            "home": str(_home(prod_stack))}


def down(prod_stack: ProdStackParams) -> list[str]:
    home = _home(prod_stack)
    stopped = []
    for name in reversed(ORDER):
        t0 = time.monotonic()
        if stop(Service(name, home), grace_s=30):
            stopped.append(name)
        if time.monotonic() - t0 > 10:
            print(f"prod stack: {name} took {time.monotonic() - t0:.0f}s to stop", flush=True)
    return stopped


def status(prod_stack: ProdStackParams) -> dict[str, bool]:
    home = _home(prod_stack)
    return {name: Service(name, home).pid() is not None for name in ORDER}


def drop_s3_remote(project: Path) -> bool:
    """Undo ``use_s3_remote`` (the stack's S3 goes away with it): the committed default remote is back."""
    proc = subprocess.run([sys.executable, "-m", "dvc", "remote", "remove", "--local", "s3"], cwd=project, capture_output=True,
                          check=False)
    return proc.returncode == 0


def use_s3_remote(prod_stack: ProdStackParams, project: Path) -> None:
    """Point ``project``'s DVC at the stack's S3 remote, in ``.dvc/config.local`` (the committed default stays)."""
    env = {**os.environ, **s3_env(prod_stack)}
    dvc = [sys.executable, "-m", "dvc"]
    for args in (["remote", "add", "--local", "--force", "--default", "s3", prod_stack.dvc_remote],
                 ["remote", "modify", "--local", "s3", "endpointurl", f"http://{prod_stack.host}:{prod_stack.s3_port}"]):
        subprocess.run([*dvc, *args], cwd=project, env=env, check=True, capture_output=True)


# --- one DAG run through the REST API -------------------------------------------------------------

def _api(prod_stack: ProdStackParams) -> Any:
    home = _home(prod_stack) / "airflow"
    password = airflow_server.admin_password(home)
    token = httpx.post(f"{airflow_url(prod_stack)}/auth/token", json={"username": "admin", "password": password},
                       timeout=30).raise_for_status()
    return httpx.Client(base_url=f"{airflow_url(prod_stack)}/api/v2",
                        headers={"Authorization": f"Bearer {token.json()['access_token']}"}, timeout=60)


def dag_run(prod_stack: ProdStackParams, conf: dict[str, Any], timeout_s: float = 3600.0, poll_s: float = 10.0) -> dict[str, Any]:
    """Trigger the DAG, follow it to the end, and return the run with where each task instance ran."""
    api = _api(prod_stack)
    deadline = time.monotonic() + 300
    while api.get(f"/dags/{DAG_ID}").status_code == 404:  # the dag-processor has not parsed it yet
        if time.monotonic() > deadline:
            raise ServiceError(f"{DAG_ID} never appeared in Airflow at {airflow_url(prod_stack)}: "
                               f"see {prod_stack.home}/airflow-dag-processor.log")
        time.sleep(2)
    api.patch(f"/dags/{DAG_ID}", json={"is_paused": False}).raise_for_status()
    run = api.post(f"/dags/{DAG_ID}/dagRuns", json={"logical_date": None, "conf": conf}).raise_for_status().json()
    run_id = run["dag_run_id"]
    print(f"dag-run: {DAG_ID} {run_id} triggered; UI {airflow_url(prod_stack)}/dags/{DAG_ID}/runs/{run_id}", flush=True)
    seen: dict[str, str] = {}
    said_ahead = False
    deadline = time.monotonic() + timeout_s
    while True:
        state = api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}").raise_for_status().json()["state"]
        if state == "queued" and not said_ahead and (ahead := _runs_ahead(api, run_id)):
            said_ahead = True
            print(f"dag-run: waiting behind {', '.join(ahead)} (max_active_runs=1)", flush=True)
        found = api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances", params={"limit": 200}).raise_for_status()
        tis = found.json()["task_instances"]
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
            if ti["state"] in ("success", "failed") and ti["hostname"]
            and not ti["hostname"].startswith(f"{ti['queue']}-worker.")]


# --- CLI ----------------------------------------------------------------------------------------

def conf_object(text: str) -> dict[str, Any]:
    """``--conf``: a JSON object, refused by argparse in one line otherwise."""
    try:
        conf = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(conf, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of the DAG's Params, not a {type(conf).__name__}")
    return conf


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infra/local/prod_stack.py", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--params", default=None, help="params file (default: $PIPELINE_PARAMS or params.yaml)")
    sub = parser.add_subparsers(dest="action", metavar="action", required=True)
    sub.add_parser("up", help="start the stack (idempotent) and make its S3 this checkout's default DVC remote")
    sub.add_parser("status", help="which of the stack's services run")
    sub.add_parser("down", help="stop the stack (its data stays in prod_stack.home) and drop the S3 DVC remote")
    run = sub.add_parser("dag-run", help="one DAG run through Airflow's REST API; prints where each task ran")
    run.add_argument("--conf", default={}, type=conf_object,
                     help="the run's Params as JSON, e.g. '{\"tasks\": 1, \"eval_limit\": 1}'")
    run.add_argument("--timeout-s", type=float, default=3600.0)
    s3 = sub.add_parser("s3-server", help="the stack's S3 service process itself (what `up` starts; keys from the environment)")
    s3.add_argument("host")
    s3.add_argument("port", type=int)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.action == "s3-server":  # a child of `up`, with its keys in its environment: no params to read
        s3_server(args.host, args.port)
        return 0
    try:
        prod_stack = load_params(args.params).prod_stack
    except ParamsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return run_action(args, prod_stack)
    except ServiceError as exc:  # a service that cannot be started or must not be used: say why, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:  # dag-run against a stack that is down, or an API that refused
        print(f"error: Airflow's API at {airflow_url(prod_stack)}: {exc} (is the stack up? `make prod-stack`)",
              file=sys.stderr)
        return 1


def run_action(args: argparse.Namespace, prod_stack: ProdStackParams) -> int:
    if args.action == "up":
        info = up(prod_stack)
        use_s3_remote(prod_stack, REPO_ROOT)
        secrets_dir = Path(info["home"]) / "secrets"
        print(f"prod stack up (CeleryExecutor; workers {', '.join(prod_stack.workers)}): Airflow UI {info['url']} user admin "
              f"password {info['password']}; MLflow {info['mlflow']} (Postgres store, artifacts s3://{prod_stack.buckets[0]}; "
              f"basic auth: users {MLFLOW_ADMIN}, {MLFLOW_USERS['writer']}, {MLFLOW_USERS['reader']}, passwords in "
              f"{secrets_dir}/mlflow_*_password); S3 {info['s3']} (DVC remote {prod_stack.dvc_remote}, now this checkout's "
              f"default in .dvc/config.local); home {info['home']}")
        return 0
    if args.action == "down":
        print(f"prod stack: stopped {', '.join(down(prod_stack)) or 'nothing'}"
              + ("; DVC's default remote is the committed one again" if drop_s3_remote(REPO_ROOT) else ""))
        return 0
    if args.action == "status":
        for name, running in status(prod_stack).items():
            print(f"{name:<24} {'up' if running else 'down'}  (compose service: {COMPOSE[name]})")
        return 0
    result = dag_run(prod_stack, args.conf, timeout_s=args.timeout_s)
    wrong = misplaced(result["task_instances"])
    for line in wrong:
        print(f"misplaced: {line}", file=sys.stderr)
    print(f"dag-run: {result['run_id']} {result['state']}")
    return 0 if result["state"] == "success" and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
