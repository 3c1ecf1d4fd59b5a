"""MLflow's basic-auth users of every production stack: the writer and reader users and the writer's grants.

The same provisioning runs in compose's ``mlflow-init``, a Kubernetes Job (``python -m pipeline prod mlflow-users``,
with the passwords from the environment) and ``make prod-stack`` (infra/local/prod_stack.py, with the passwords
from its secrets). Passwords travel in JSON bodies only, never in a URL or on a command line (docs/security.md).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import httpx

from pipeline.services.process import http_ok

MLFLOW_ADMIN = "admin"
# MLflow's basic-auth users besides the admin: the Airflow workers (trainers, evaluation, promotion) write as
# `writer`; `reader` is for people and tools that only look (default_permission = READ covers every user)
MLFLOW_USERS = {"writer": "pipeline-writer", "reader": "pipeline-reader"}
# the writer's grants on every experiment and registered model: log runs, register versions, move aliases;
# MANAGE on models because rollback and promotion delete aliases (EDIT cannot delete)
MLFLOW_WRITER_GRANTS = (("experiment", "*", "EDIT"), ("registered_model", "*", "MANAGE"))


def provision_mlflow_users(uri: str, admin_password: str, passwords: dict[str, str], transport: Any = None) -> dict[str, str]:
    """Create (or re-key) the writer and reader users as MLflow's admin and give the writer its grants; idempotent.
    ``passwords``: role (``MLFLOW_USERS``' keys) -> password. Passwords travel in JSON bodies, never in a URL.
    Returns user -> what was done."""
    done: dict[str, str] = {}
    with httpx.Client(base_url=uri, auth=(MLFLOW_ADMIN, admin_password), timeout=30, transport=transport) as api:
        for role, password in passwords.items():
            name = MLFLOW_USERS[role]
            found = api.get("/api/2.0/mlflow/users/get", params={"username": name})
            if found.status_code == 404:
                api.post("/api/2.0/mlflow/users/create", json={"username": name, "password": password}).raise_for_status()
                done[name] = "created"
            else:
                found.raise_for_status()
                api.patch("/api/2.0/mlflow/users/update-password",
                          json={"username": name, "password": password}).raise_for_status()
                done[name] = "password set"
        writer = MLFLOW_USERS["writer"]
        listed = api.get("/api/3.0/mlflow/users/permissions/list", params={"username": writer}).raise_for_status().json()
        have = {(p["resource_type"], p["resource_pattern"]): p["permission"] for p in listed.get("permissions", [])
                if p.get("role_name", "").startswith("__user_")}
        for resource_type, pattern, permission in MLFLOW_WRITER_GRANTS:
            if have.get((resource_type, pattern)) == permission:
                continue
            grant = {"username": writer, "resource_type": resource_type, "resource_id": pattern}
            if (resource_type, pattern) in have:
                api.post("/api/3.0/mlflow/users/permissions/revoke", json=grant).raise_for_status()
            api.post("/api/3.0/mlflow/users/permissions/grant", json={**grant, "permission": permission}).raise_for_status()
    return done


def users_from_env(timeout_s: float) -> int:
    """compose's ``mlflow-init`` (and a Kubernetes Job): the stack's users on a server the operator runs."""
    names = ["MLFLOW_TRACKING_URI", "MLFLOW_AUTH_ADMIN_PASSWORD", *(f"MLFLOW_{role.upper()}_PASSWORD" for role in MLFLOW_USERS)]
    if missing := [n for n in names if not os.environ.get(n)]:
        print(f"mlflow-users: set {', '.join(missing)}", file=sys.stderr)
        return 2
    uri = os.environ["MLFLOW_TRACKING_URI"].rstrip("/")
    deadline = time.monotonic() + min(timeout_s, 600.0)
    while not http_ok(f"{uri}/health"):
        if time.monotonic() > deadline:
            print(f"mlflow-users: {uri}/health never answered", file=sys.stderr)
            return 1
        time.sleep(2)
    done = provision_mlflow_users(uri, os.environ["MLFLOW_AUTH_ADMIN_PASSWORD"],
                                  {role: os.environ[f"MLFLOW_{role.upper()}_PASSWORD"] for role in MLFLOW_USERS})
    print("mlflow-users: " + ", ".join(f"{user} {what}" for user, what in done.items())
          + f"; {MLFLOW_USERS['writer']} may write everywhere")
    return 0
