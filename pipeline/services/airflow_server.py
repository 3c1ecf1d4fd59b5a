"""``airflow standalone`` for the embedded default: this repo's dags/, SQLite, loopback only.

Airflow reads its settings from the environment, so every command that talks to this instance
(tests, ``airflow dags test``) uses ``airflow_env()``. ``worker_hostname`` is what the production stack's
Celery workers name themselves by (infra/local/prod_stack.py): Airflow workers import it, so this module
imports only the standard library and the pipeline's stdlib-only modules.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from pipeline.envs import REPO_ROOT, pythonpath
from pipeline.services.process import Service, start, stop

HOST, PORT = "127.0.0.1", 8080


def worker_hostname() -> str:
    """``core.hostname_callable`` of the production stack's Celery workers (infra/local/prod_stack.py sets
    ``PIPELINE_WORKER_QUEUE``): the queue in the name each task instance records, so the UI, the API and
    ``dag-run`` show which worker ran it (all of them run on one host)."""
    return f"{os.environ.get('PIPELINE_WORKER_QUEUE', 'worker')}-worker.{socket.gethostname()}"


def airflow_home() -> Path:
    return Path(os.environ.get("AIRFLOW_HOME", REPO_ROOT / ".airflow")).resolve()


def airflow_env(home: Path | None = None, port: int = PORT) -> dict[str, str]:
    home = home or airflow_home()
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO_ROOT / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://{HOST}:{port}/execution/",
        "AIRFLOW__API__HOST": HOST,
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "PYTHONPATH": pythonpath(),
    }


def airflow_bin() -> str:
    """The `airflow` of this installation (also when its venv's bin/ is not on PATH)."""
    return shutil.which("airflow") or str(Path(sys.executable).with_name("airflow"))


def admin_password(home: Path) -> str:
    """The simple auth manager's generated admin password ('' until the API server has written it)."""
    path = home / "simple_auth_manager_passwords.json.generated"
    return json.loads(path.read_text()).get("admin", "") if path.exists() else ""


def up(port: int = PORT) -> dict[str, str]:
    home = airflow_home()
    home.mkdir(parents=True, exist_ok=True)
    airflow = airflow_bin()
    service = Service("airflow", home)
    # standalone starts its components as `airflow ...` from PATH: the same installation's, whatever PATH the caller has
    env = {**airflow_env(home, port), "PATH": os.pathsep.join([str(Path(airflow).parent), os.environ.get("PATH", "")])}
    start(service, [airflow, "standalone"], f"http://{HOST}:{port}/api/v2/monitor/health",
          env=env, timeout_s=240, cwd=REPO_ROOT, identity={"airflow_home": str(home)})
    # GPU-bound tasks (train_sft) run in this pool; one slot = one GPU worker here
    subprocess.run([airflow, "pools", "set", "gpu", "1", "GPU-bound stages (train_sft)"],
                   env={**os.environ, **airflow_env(home, port)}, check=True, capture_output=True)
    password_file = home / "simple_auth_manager_passwords.json.generated"
    return {"url": f"http://{HOST}:{port}", "user": "admin", "password": admin_password(home),
            "password_file": str(password_file), "log": str(service.log_file)}


def down() -> bool:
    return stop(Service("airflow", airflow_home()), grace_s=30)
