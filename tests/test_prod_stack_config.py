"""`make prod-stack`'s credentials, without starting anything (issue #26): every service asks its clients for them,
no secret reaches a command line or a service record, and secrets, configs and logs are private. The services
themselves run in tests/test_prod_stack.py (`make test-all`)."""

from __future__ import annotations

import argparse
import ast
import base64
import configparser
import hashlib
import hmac
import importlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from werkzeug.test import Client

from infra.local import prod_stack
from pipeline.config import ProdStackParams, load_params
from pipeline.services import buckets, deploy, mlflow_users
from tests.conftest import ROOT


def _cfg(tmp_path: Path) -> ProdStackParams:
    return load_params(ROOT / "params.yaml", environ={"PIPELINE__PROD_STACK__HOME": str(tmp_path / "prod")}).prod_stack


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class _Recorder:
    """Stands in for process.start and subprocess.run: records what would have run, runs nothing."""

    def __init__(self, home: Path, pg_hba: Path | None = None) -> None:
        self.started: dict[str, dict[str, Any]] = {}
        self.runs: list[dict[str, Any]] = []
        self.pg_hba = pg_hba

    def start(self, service: Any, argv: list[str], health: Any, env: dict[str, str] | None = None, **kw: Any) -> int:
        self.started[service.name] = {"argv": list(argv), "env": dict(env or {}), "identity": kw.get("identity"),
                                      "service": service}
        return 1

    def run(self, argv: list[str], *a: Any, **kw: Any) -> Any:
        hba = self.pg_hba.read_text() if self.pg_hba and self.pg_hba.exists() else None
        self.runs.append({"argv": list(argv), "input": kw.get("input"), "env": kw.get("env"), "hba": hba})
        return SimpleNamespace(returncode=0, stdout="", stderr="")


def _bring_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              root: bool = False) -> tuple[ProdStackParams, _Recorder, dict[str, Any]]:
    """Every `up` step of the stack with recorded processes: (cfg, recorder, what provisioning and buckets received)."""
    cfg = _cfg(tmp_path)
    data, _ = prod_stack._pg_dirs(cfg)
    rec = _Recorder(prod_stack._home(cfg), data / "pg_hba.conf")
    calls: dict[str, Any] = {}
    monkeypatch.setattr(prod_stack, "start", rec.start)
    monkeypatch.setattr(prod_stack, "subprocess", SimpleNamespace(run=rec.run))
    monkeypatch.setattr(prod_stack, "_free_or_ours", lambda *a, **k: None)
    monkeypatch.setattr(prod_stack, "_free_port_for", lambda *a, **k: 0)
    monkeypatch.setattr(prod_stack, "_pg_bin", lambda name: f"/usr/lib/postgresql/16/bin/{name}")
    monkeypatch.setattr(prod_stack, "_redis_bin", lambda: "/usr/bin/redis-server")
    monkeypatch.setattr(prod_stack, "_is_root", lambda: root)
    monkeypatch.setattr(prod_stack.shutil, "chown", lambda *a, **k: None)
    monkeypatch.setattr(prod_stack, "mlflow_auth_available", lambda: True)
    monkeypatch.setattr(prod_stack, "provision_mlflow_users", lambda *a, **k: calls.setdefault("mlflow_users", (a, k)))
    monkeypatch.setattr(buckets, "ensure", lambda *a, **k: calls.setdefault("buckets", (a, k)))
    prod_stack.postgres_up(cfg)
    prod_stack.redis_up(cfg)
    prod_stack.s3_up(cfg)
    prod_stack.mlflow_up(cfg)
    prod_stack.airflow_up(cfg, ROOT)
    return cfg, rec, calls


@pytest.mark.parametrize("root", [False, True], ids=["user", "root"])
def test_no_secret_on_a_command_line_or_in_a_service_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root: bool) -> None:
    """Every argv the stack would run (services, initdb, psql, airflow setup) and every identity it records is free of
    every secret of the stack; the secrets travel in 0600 files, stdin and the children's environments."""
    cfg, rec, calls = _bring_up(tmp_path, monkeypatch, root)
    home = prod_stack._home(cfg)
    secrets = {p.name: p.read_text().strip() for p in (home / "secrets").iterdir()}
    assert {"postgres_password", "postgres_superuser_password", "redis_password", "s3_access_key", "s3_secret_key",
            "mlflow_admin_password", "mlflow_writer_password", "mlflow_reader_password", "mlflow_flask_secret_key",
            "airflow_fernet_key"} <= set(secrets)
    assert set(rec.started) == set(prod_stack.COMPOSE)
    argvs = [(name, s["argv"]) for name, s in rec.started.items()] + [("run", r["argv"]) for r in rec.runs]
    records = [json.dumps(s["identity"], default=str) for s in rec.started.values()]
    for name, value in secrets.items():
        for who, argv in argvs:
            shown = [a.replace(value, "<it>") for a in argv]
            assert not any(value in arg for arg in argv), f"{name} on the command line of {who}: {shown}"
        assert not any(value in r for r in records), f"{name} in a service's recorded identity"
    if root:  # Postgres' binaries run as the postgres user
        assert rec.started["postgres"]["argv"][:4] == ["runuser", "-u", "postgres", "--"]
    # the services get them from their environments, where they were given
    assert rec.started["mlflow"]["env"]["MLFLOW_AUTH_ADMIN_PASSWORD"] == secrets["mlflow_admin_password"]
    assert rec.started["s3"]["env"]["AWS_SECRET_ACCESS_KEY"] == secrets["s3_secret_key"]
    worker = rec.started["airflow-worker-gpu"]["env"]
    assert urlsplit(worker["AIRFLOW__CELERY__BROKER_URL"]).password == secrets["redis_password"]
    assert worker["MLFLOW_TRACKING_USERNAME"] == mlflow_users.MLFLOW_USERS["writer"]
    assert worker["MLFLOW_TRACKING_PASSWORD"] == secrets["mlflow_writer_password"]
    # SQL goes to psql's stdin, the superuser's password to its environment; role passwords only as SCRAM verifiers
    psql = [r for r in rec.runs if "/psql" in " ".join(r["argv"])]
    assert psql and all(r["input"] and r["env"]["PGPASSWORD"] == secrets["postgres_superuser_password"] for r in psql)
    role = next(r["input"] for r in psql if "ROLE airflow" in r["input"])
    assert "PASSWORD 'SCRAM-SHA-256$4096:" in role and secrets["postgres_password"] not in role
    created = {r["input"].split()[2] for r in psql if r["input"].startswith("CREATE DATABASE")}
    assert created == set(prod_stack.DATABASES)
    # initdb: password authentication from the start, the password from a file that is gone afterwards
    (initdb,) = [r["argv"] for r in rec.runs if any(a.endswith("/initdb") for a in r["argv"])]
    assert {"--auth-local=scram-sha-256", "--auth-host=scram-sha-256"} <= set(initdb)
    pwfile = Path(next(a for a in initdb if a.startswith("--pwfile=")).split("=", 1)[1])
    assert not pwfile.exists()
    assert calls["buckets"][1]["secret_key"] == secrets["s3_secret_key"]
    assert calls["mlflow_users"][0][1] == secrets["mlflow_admin_password"]


def test_secrets_configs_and_logs_are_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even under a permissive umask: secrets, pg_hba.conf, redis.conf, MLflow's auth config and every service's log are
    0600, their folders 0700."""
    old = os.umask(0)
    try:
        cfg, rec, _ = _bring_up(tmp_path, monkeypatch)
    finally:
        os.umask(old)
    home = prod_stack._home(cfg)
    data, _ = prod_stack._pg_dirs(cfg)
    files = [*(home / "secrets").iterdir(), data / "pg_hba.conf", home / "redis/redis.conf", home / "mlflow/basic_auth.ini",
             *(s["service"].log_file for s in rec.started.values())]
    assert len(files) > 20
    for path in files:
        assert _mode(path) == 0o600, f"{path.relative_to(home)}: {oct(_mode(path))}"
    for folder in (home, home / "secrets", home / "redis", home / "mlflow", home / "airflow", data, data.parent):
        assert _mode(folder) == 0o700, f"{folder}: {oct(_mode(folder))}"
    assert not list(home.rglob("*.tmp"))


def test_as_root_every_service_keeps_the_home_traversable_for_postgres(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As root the home is 0711 (Postgres runs as its own user below it) and every service the stack starts in it asks
    `start` for that mode, not its 0700 default; as another user 0700."""
    for root, mode in ((True, 0o711), (False, 0o700)):
        cfg, rec, _ = _bring_up(tmp_path / str(root), monkeypatch, root)
        assert _mode(prod_stack._home(cfg)) == mode
        homes = {s["service"].home_mode for s in rec.started.values() if s["service"].home == prod_stack._home(cfg)}
        assert homes == {mode}, (root, homes)


def test_pg_hba_asks_every_connection_for_a_scram_password() -> None:
    text = prod_stack.pg_hba_conf()
    rules = [line.split() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert {r[0] for r in rules} == {"local", "host"}
    assert all(r[-1] == "scram-sha-256" for r in rules), rules
    assert "trust" not in text and "peer" not in text and not prod_stack.hba_trusts(text)
    assert prod_stack.hba_trusts("# comment\nlocal all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n")
    assert all(r[3] in ("127.0.0.1/32", "::1/128", "samehost") for r in rules if r[0] == "host")  # this host only


def test_a_cluster_that_trusted_local_users_gets_a_superuser_password_then_loses_trust(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `.prod` initialised before passwords: started once as it is, the superuser gets its password (through the
    trusted socket), then pg_hba.conf is replaced and reloaded."""
    cfg = _cfg(tmp_path)
    data, _ = prod_stack._pg_dirs(cfg)
    data.mkdir(parents=True)
    (data / "PG_VERSION").write_text("15\n")
    legacy = "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
    (data / "pg_hba.conf").write_text(legacy)
    rec = _Recorder(prod_stack._home(cfg), data / "pg_hba.conf")
    monkeypatch.setattr(prod_stack, "start", rec.start)
    monkeypatch.setattr(prod_stack, "subprocess", SimpleNamespace(run=rec.run))
    monkeypatch.setattr(prod_stack, "_free_or_ours", lambda *a, **k: None)
    monkeypatch.setattr(prod_stack, "_pg_bin", lambda name: f"/usr/lib/postgresql/16/bin/{name}")
    monkeypatch.setattr(prod_stack, "_is_root", lambda: False)
    prod_stack.postgres_up(cfg)
    sql = [(r["input"], r["hba"]) for r in rec.runs if r["input"]]
    alter = next(i for i, (s, _) in enumerate(sql) if s.startswith(f"ALTER ROLE {prod_stack.PG_SUPERUSER} "))
    assert sql[alter][1] == legacy  # still trusted: the only way in without a password
    password = (prod_stack._home(cfg) / "secrets/postgres_superuser_password").read_text().strip()
    assert "SCRAM-SHA-256$" in sql[alter][0] and password not in sql[alter][0]
    assert sql[alter + 1][0].startswith("SELECT pg_reload_conf()") and sql[alter + 1][1] == prod_stack.pg_hba_conf()
    assert (data / "pg_hba.conf").read_text() == prod_stack.pg_hba_conf()


def test_scram_verifier_is_postgres_format_of_rfc7677() -> None:
    """The verifier's keys reproduce RFC 7677's example exchange (user "user", password "pencil")."""
    salt = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
    verifier = prod_stack.scram_verifier("pencil", salt=salt, iterations=4096)
    method, rest = verifier.split("$", 1)
    iterations_salt, keys = rest.split("$")
    stored_key, server_key = (base64.b64decode(k) for k in keys.split(":"))
    assert method == "SCRAM-SHA-256" and iterations_salt == "4096:W22ZaJ0SNY7soEsUEjb6gQ=="
    nonce = "rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
    auth_message = f"n=user,r=rOprNGfwEbeRWgbNEkqO,r={nonce},s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096,c=biws,r={nonce}".encode()
    server_signature = base64.b64encode(hmac.new(server_key, auth_message, "sha256").digest()).decode()
    assert server_signature == "6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
    proof = base64.b64decode("dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
    client_key = bytes(a ^ b for a, b in zip(proof, hmac.new(stored_key, auth_message, "sha256").digest(), strict=True))
    assert hashlib.sha256(client_key).digest() == stored_key
    assert prod_stack.scram_verifier("pencil") != prod_stack.scram_verifier("pencil")  # a fresh salt each time


def test_redis_requires_a_password_from_its_config_file(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    conf = prod_stack.redis_conf(cfg)
    password = (prod_stack._home(cfg) / "secrets/redis_password").read_text().strip()
    assert f"\nrequirepass {password}\n" in conf and f"\nbind {cfg.host}\n" in conf and "\nprotected-mode yes\n" in conf
    assert urlsplit(prod_stack.broker_url(cfg)).password == password


def test_mlflow_runs_basic_auth_with_read_by_default(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    argv = prod_stack.mlflow_argv(cfg)
    assert argv[argv.index("--app-name") + 1] == "basic-auth" and "--backend-store-uri" not in argv
    ini = configparser.ConfigParser()
    ini.read_string(prod_stack.mlflow_auth_ini(cfg))
    assert ini["mlflow"]["default_permission"] == "READ" and "admin_password" not in ini["mlflow"]
    assert urlsplit(ini["mlflow"]["database_uri"]).password is None
    env = prod_stack.mlflow_server_env(cfg)
    assert urlsplit(env["MLFLOW_BACKEND_STORE_URI"]).password is None and env["PGPASSWORD"]
    assert env["MLFLOW_AUTH_CONFIG_PATH"].endswith("basic_auth.ini") and env["MLFLOW_FLASK_SERVER_SECRET_KEY"]
    assert set(prod_stack.mlflow_client_env(cfg, "reader")) == {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}


def test_mlflow_users_are_provisioned_idempotently_with_passwords_in_bodies_only() -> None:
    """Against a stand-in of MLflow's auth API: the first run creates both users and the writer's grants, a second
    re-keys the users and grants nothing again; passwords appear only in JSON bodies, the admin's only in the header."""
    users: dict[str, str] = {}
    grants: dict[tuple[str, str, str], str] = {}
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        assert request.headers["Authorization"] == "Basic " + base64.b64encode(b"admin:admin-password-123").decode()
        path, body = request.url.path, json.loads(request.content or b"{}")
        if path.endswith("/users/get"):
            name = request.url.params["username"]
            return httpx.Response(200, json={"user": {"username": name}}) if name in users else httpx.Response(404, json={})
        if path.endswith("/users/create") or path.endswith("/users/update-password"):
            users[body["username"]] = body["password"]
            return httpx.Response(200, json={})
        if path.endswith("/users/permissions/list"):
            name = request.url.params["username"]
            return httpx.Response(200, json={"permissions": [
                {"resource_type": t, "resource_pattern": p, "permission": v, "role_name": "__user_2__"}
                for (u, t, p), v in grants.items() if u == name]})
        if path.endswith("/users/permissions/grant"):
            key = (body["username"], body["resource_type"], body["resource_id"])
            if key in grants:
                return httpx.Response(400, json={"error_code": "RESOURCE_ALREADY_EXISTS"})
            grants[key] = body["permission"]
            return httpx.Response(200, json={})
        return httpx.Response(404)

    passwords = {"writer": "writer-password-123", "reader": "reader-password-123"}
    transport = httpx.MockTransport(handler)
    first = mlflow_users.provision_mlflow_users("http://mlflow.test", "admin-password-123", passwords, transport=transport)
    assert set(first.values()) == {"created"}
    assert users == {mlflow_users.MLFLOW_USERS[r]: p for r, p in passwords.items()}
    writer = mlflow_users.MLFLOW_USERS["writer"]
    assert grants == {(writer, t, p): v for t, p, v in mlflow_users.MLFLOW_WRITER_GRANTS}
    assert ("registered_model", "*", "MANAGE") in mlflow_users.MLFLOW_WRITER_GRANTS  # promotion deletes aliases
    second = mlflow_users.provision_mlflow_users("http://mlflow.test", "admin-password-123", passwords, transport=transport)
    assert set(second.values()) == {"password set"} and len(grants) == len(mlflow_users.MLFLOW_WRITER_GRANTS)
    for request in seen:
        assert not any(p in str(request.url) for p in [*passwords.values(), "admin-password-123"])


def test_s3_gate_closes_motos_api_and_unsigned_requests() -> None:
    signed = {"Authorization": "AWS4-HMAC-SHA256 Credential=pipeline0123/20260101/us-east-1/s3/aws4_request, ..."}
    assert prod_stack.s3_gate("GET", "/moto-api/", {}) == (200, "ok")
    for method, path in (("POST", "/moto-api/reset-auth"), ("POST", "/moto-api/reset"), ("GET", "/moto-api/data.json"),
                         ("POST", "/moto-api/")):
        assert prod_stack.s3_gate(method, path, signed)[0] == 403, path  # type: ignore[index]
    assert prod_stack.s3_gate("GET", "/mlflow", {})[0] == 403  # type: ignore[index]
    assert prod_stack.s3_gate("GET", "/mlflow?X-Amz-Signature=abc", {})[0] == 403  # type: ignore[index]
    assert prod_stack.s3_gate("PUT", "/mlflow/key", signed) is None


def test_s3_app_serves_only_the_stacks_signed_requests() -> None:
    """The stack's S3 app in this process (WSGI, no server): a request signed with the stack's key is served, one signed
    with another secret or key or not signed at all is refused. moto's process-wide state is restored afterwards."""
    # moto hooks into botocore process-wide when imported (and takes 0.4 s): only this test needs it
    from moto import settings  # noqa: PLC0415 - see above
    from moto.core import DEFAULT_ACCOUNT_ID  # noqa: PLC0415 - see above
    from moto.iam.models import iam_backends  # noqa: PLC0415 - see above
    from moto.s3.models import s3_backends  # noqa: PLC0415 - see above

    key, secret = "pipelinetest0123abcd", "s3cr3t" * 6
    base = "http://127.0.0.1:59999"

    def request(method: str, path: str, creds: tuple[str, str] | None) -> int:
        headers = {}
        if creds:
            aws = AWSRequest(method=method, url=base + path, data=b"")
            S3SigV4Auth(Credentials(*creds), "s3", "us-east-1").add_auth(aws)
            headers = dict(aws.headers)
        return Client(app).open(path, method=method, headers=headers, base_url=base).status_code

    before = settings.INITIAL_NO_AUTH_ACTION_COUNT
    iam = iam_backends[DEFAULT_ACCOUNT_ID]["aws"]
    try:
        app = prod_stack.s3_app(key, secret)
        assert request("PUT", "/stack-bucket", (key, secret)) == 200
        assert request("GET", "/stack-bucket", (key, secret)) == 200
        assert request("GET", "/stack-bucket", (key, "wrong" * 8)) == 403
        assert request("GET", "/stack-bucket", ("AKIAIOSFODNN7EXAMPLE", secret)) == 403
        assert request("GET", "/stack-bucket", None) == 403
        assert request("POST", "/moto-api/reset-auth", None) == 403
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = before
        if prod_stack.S3_USER in iam.users:
            iam.delete_access_key(key, prod_stack.S3_USER)
            iam.delete_user_policy(prod_stack.S3_USER, "s3")
            iam.delete_user(prod_stack.S3_USER)
        s3_backends[DEFAULT_ACCOUNT_ID]["aws"].buckets.pop("stack-bucket", None)


def test_workers_name_themselves_with_a_callable_of_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`core.hostname_callable` names a function Airflow's workers import from the pipeline package (infra/ is not on
    their path): the queue in the hostname, which is how `dag-run` tells where a task ran."""
    _, rec, _ = _bring_up(tmp_path, monkeypatch)
    for queue in ("default", "gpu"):
        env = rec.started[f"airflow-worker-{queue}"]["env"]
        module, _, name = env["AIRFLOW__CORE__HOSTNAME_CALLABLE"].rpartition(".")
        assert module.startswith("pipeline.")
        monkeypatch.setenv("PIPELINE_WORKER_QUEUE", env["PIPELINE_WORKER_QUEUE"])
        hostname = getattr(importlib.import_module(module), name)()
        assert hostname.startswith(f"{queue}-worker.")
        assert not prod_stack.misplaced([{"task_id": "t", "queue": queue, "state": "success", "hostname": hostname}])


def test_the_package_never_imports_the_infra_code() -> None:
    """The production stack's process code lives in infra/: nothing under pipeline/ or dags/ imports it."""
    offenders = []
    for path in [*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "dags").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "infra" or n.startswith("infra.")]
    assert not offenders


def test_the_stack_script_runs_as_make_runs_it(tmp_path: Path) -> None:
    """`make prod-*` run infra/local/prod_stack.py as a script with the repository root on PYTHONPATH (the Makefile
    exports it); `python -m pipeline prod status` runs the same script in a child process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PIPELINE__PROD_STACK__HOME": str(tmp_path / "prod")}
    script = ROOT / "infra/local/prod_stack.py"
    shown = subprocess.run([sys.executable, str(script), "--help"], env=env, capture_output=True, text=True, check=False)
    assert shown.returncode == 0 and {"up", "status", "dag-run", "down"} <= set(shown.stdout.replace(",", " ").split())
    for argv in ([sys.executable, str(script), "status"], [sys.executable, "-m", "pipeline", "prod", "status"]):
        proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr
        assert [line.split()[:2] for line in proc.stdout.splitlines()] == [[name, "down"] for name in prod_stack.ORDER]


def test_pipeline_prod_hands_the_stack_actions_to_the_script(monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m pipeline prod up|status|dag-run|down` keep working: the same params file and options, passed on."""
    calls: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(deploy, "subprocess", SimpleNamespace(call=lambda argv, env: calls.append((argv, env)) or 3))
    parser = argparse.ArgumentParser()
    deploy.add_arguments(parser)
    args = parser.parse_args(["dag-run", "--conf", '{"tasks": 1}', "--timeout-s", "60"])
    args.params_path = "params/gpu.yaml"
    assert deploy.main(args, load_params(ROOT / "params.yaml")) == 3
    (argv, env), = calls
    assert argv == [sys.executable, str(ROOT / "infra/local/prod_stack.py"), "--params", "params/gpu.yaml", "dag-run",
                    "--conf", '{"tasks": 1}', "--timeout-s", "60.0"]
    assert str(ROOT) in env["PYTHONPATH"].split(os.pathsep)
    assert deploy.stack_argv("down", None)[2:] == ["down"]
