"""Versioned, reversible role routing: ``route apply|status|rollback|new``.

A version is a file ``v<N>.yaml`` mapping every role to a deployment (``<worker>`` or
``<worker>/<adapter>``) and, optionally, a policy to a policy model (``policies: {supervisor_policy:
models:/supervisor_policy/3}``; absent or ``llm`` = the supervisor LLM). Hand-written versions live
in git (``serving.routing_dir``); versions written by promotion or ``route new`` go to
``<serving.home>/routing/versions/`` and are also logged to MLflow by the promotion that wrote them,
so no generated file is left untracked in the work tree. Numbers are global across both. Applying one
first sends one request per role through the proxy *under that version* (as an evaluation table,
``metadata.routing``, so live traffic never sees an unverified version) and checks the deployment
that answered; only then does it replace the proxy's active routing file atomically (the proxy is
not restarted, so in-flight requests finish on the old target). Any failure leaves the previous
version live and the command fails. History is kept next to the active file, so ``rollback`` knows
the version before the current one. Every mutation (a new version number, apply, rollback) holds
one lock (:func:`lock`), so concurrent writers cannot take the same number or interleave.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from pipeline import tracking
from pipeline.agents import prompts
from pipeline.config import MlflowParams, Params, RolloutsParams, ServingParams
from pipeline.io import write_json, write_text
from pipeline.serving import proxy
from pipeline.serving.names import EVAL_NAME, NAME, BadName, check_policy, check_target
from pipeline.serving.worker import served_name


class RoutingError(RuntimeError):
    pass


_held: dict[str, int] = {}  # lock file -> depth held by this process (re-entrant: a switch applies under its own lock)


@contextmanager
def lock(serving: ServingParams) -> Iterator[None]:
    """The routing lock: one writer of routing versions, the active file and the champion switch at a time."""
    path = proxy.active_file(serving).with_name("routing.lock")
    key = str(path)
    if _held.get(key):
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        _held[key] = 1
        try:
            yield
        finally:
            _held[key] = 0
            fcntl.flock(fh, fcntl.LOCK_UN)


def generated_dir(serving: ServingParams) -> Path:
    return Path(serving.home).resolve() / "routing" / "versions"


def _files(serving: ServingParams) -> dict[int, Path]:
    found: dict[int, Path] = {}
    for folder in (Path(serving.routing_dir), generated_dir(serving)):
        for p in folder.glob("v*.yaml"):
            if p.stem[1:].isdigit():
                found.setdefault(int(p.stem[1:]), p)
    return found


def version_path(serving: ServingParams, version: int) -> Path:
    return _files(serving).get(version) or generated_dir(serving) / f"v{version}.yaml"


def versions(serving: ServingParams) -> list[int]:
    return sorted(_files(serving))


def expected_model(serving: ServingParams, target: str) -> str:
    """The model name the backend reports for a deployment (worker's served name or the adapter)."""
    worker_name, _, adapter = target.partition("/")
    for worker in serving.workers:
        if worker.name == worker_name:
            return adapter or served_name(worker)
    raise RoutingError(f"deployment '{target}': no worker '{worker_name}' in serving.workers")


def _mapping(path: Path, doc: dict[str, Any], key: str, what: str, required: bool = False) -> dict[str, Any]:
    value = doc.get(key) if required else doc.get(key) or {}
    if not isinstance(value, dict):
        raise RoutingError(f"{path}: '{key}' must map {what}")
    return value


def load_version(serving: ServingParams, version: int) -> dict[str, Any]:
    path = version_path(serving, version)
    if not path.exists():
        raise RoutingError(f"{path}: routing version {version} does not exist (have {versions(serving)})")
    doc = yaml.safe_load(path.read_text()) or {}
    roles = _mapping(path, doc, "roles", "role -> deployment", required=True)
    for role, was in serving.inherits.items():  # a version from before the role had its own model: where its calls went then
        if role in serving.roles and role not in roles and was in roles:
            roles = {**roles, role: roles[was]}
    policies = _mapping(path, doc, "policies", "policy -> model URI or 'llm'")
    prompt_versions = _mapping(path, doc, "prompts", "prompt template -> registered version")
    try:
        check_table(serving, roles, policies, prompt_versions)
    except RoutingError as exc:
        raise RoutingError(f"{path}: {exc}") from None
    table = {"version": version, "roles": {r: str(t) for r, t in roles.items()},
             "policies": {k: str(v) for k, v in policies.items()}, "description": doc.get("description", "")}
    if prompt_versions:
        table["prompts"] = {t: int(v) for t, v in prompt_versions.items()}
    if pins := doc.get(PINS):  # versions written before pins had none: their prompts are checked against their tags only
        table[PINS] = {str(t): str(v) for t, v in pins.items()} if isinstance(pins, dict) else {}
    return table


PINS = "prompt_sha256"  # template -> the digest of the routed version's text when the routing version was written


def pins_kept(live: dict[str, Any] | None, routed: dict[str, int]) -> dict[str, str]:
    """The pins of ``live`` still true for ``routed``: those of templates routed at the same version."""
    live = live or {}
    return {t: sha for t, sha in (live.get(PINS) or {}).items() if (live.get("prompts") or {}).get(t) == routed.get(t)}


def _pin(prompt_versions: dict[str, int], pinned: dict[str, str] | None) -> dict[str, str]:
    """Every routed prompt's digest: the one ``pinned`` carries (a version already routed), else its text's now, the
    version found in the Prompt Registry, its tag matching its text and its fields the society's."""
    from pipeline import prompt_registry  # noqa: PLC0415 - mlflow.genai: only when prompts are routed

    out = {}
    for template, number in prompt_versions.items():
        try:
            out[template] = (pinned or {}).get(template) or prompt_registry.pin(template, number)
        except prompt_registry.PromptError as exc:
            raise RoutingError(str(exc)) from None
    return out


def check_table(serving: ServingParams, roles: dict[str, Any], policies: dict[str, Any],
                prompt_versions: dict[str, Any] | None = None) -> None:
    """Every role of ``serving.roles`` and no other, each on a deployment a worker serves, every policy a valid routing
    value, every routed prompt a template of the society at a registered version number: what a routing version must
    hold before it is written, or read."""
    missing = sorted(set(serving.roles) - set(roles))
    unknown = sorted(set(roles) - set(serving.roles))
    if missing or unknown:
        raise RoutingError(f"roles missing {missing}, unknown {unknown}")
    for template, number in (prompt_versions or {}).items():
        if template not in prompts.TEMPLATES:
            raise RoutingError(f"prompt {template!r}: not a template of the society (pipeline/agents/prompts.py)")
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise RoutingError(f"prompt {template}: version {number!r} must be a registered version number (1, 2, ...)")
    try:
        for target in roles.values():
            check_target(str(target))
        for name, value in policies.items():
            if not NAME.fullmatch(str(name)):
                raise BadName(f"policy name {name!r}: must match {NAME.pattern}")
            check_policy(str(value))
    except BadName as exc:
        raise RoutingError(str(exc)) from None
    for target in roles.values():
        expected_model(serving, str(target))  # raises naming the worker no entry of serving.workers has


def write_version(serving: ServingParams, roles: dict[str, str], description: str = "",
                  policies: dict[str, str] | None = None, prompt_versions: dict[str, int] | None = None,
                  pinned: dict[str, str] | None = None) -> int:
    """Write the next version file (used by `route new` and by promotion); returns its number. A table that
    :func:`check_table` refuses writes nothing. ``prompt_versions``: template -> the Prompt Registry version the
    society renders instead of the repository's text (docs/serving.md); each is pinned by its text's digest (``pinned``
    carries the pins of versions already routed), and rendering refuses any other text under that version."""
    check_table(serving, roles, policies or {}, prompt_versions)
    pins = _pin(prompt_versions or {}, pinned)
    with lock(serving):
        number = (versions(serving) or [0])[-1] + 1
        doc: dict[str, Any] = {"description": description, "roles": roles}
        if policies:
            doc["policies"] = policies
        if prompt_versions:
            doc["prompts"] = prompt_versions
            doc[PINS] = pins
        path = generated_dir(serving) / f"v{number}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, yaml.safe_dump(doc, sort_keys=False))
        load_version(serving, number)
        return number


def policy(table: dict[str, Any] | None, name: str) -> str:
    """The policy a routing table names for ``name`` (``llm`` when none)."""
    return ((table or {}).get("policies") or {}).get(name, "llm")


def eval_file(serving: ServingParams, name: str) -> Path:
    if not EVAL_NAME.fullmatch(name):
        raise RoutingError(f"evaluation routing name {name!r}: letters, digits, '.', '_' and '-' only")
    return proxy.active_file(serving).with_name("eval") / f"{name}.json"


def write_eval(serving: ServingParams, name: str, roles: dict[str, str],
               policies: dict[str, str] | None = None) -> dict[str, Any]:
    """An evaluation routing table: requests that name it (``metadata.routing``) use it; the live one is untouched."""
    check_table(serving, roles, policies or {})
    table = {"version": f"eval:{name}", "roles": roles, "policies": policies or {}}
    path = eval_file(serving, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, table)
    _written.add(path)
    return table


_written: set[Path] = set()  # the evaluation tables this process wrote: drop_evals removes them when its stage ends


def drop_evals() -> int:
    """Remove the evaluation tables this process wrote: a table outliving its evaluation would let any holder of the
    proxy's key reach a refused candidate (``metadata.routing``) long after the gate said no. Returns how many."""
    dropped = 0
    for path in list(_written):
        if path.exists():
            path.unlink()
            dropped += 1
        _written.discard(path)
    return dropped


def active(serving: ServingParams) -> dict[str, Any] | None:
    path = proxy.active_file(serving)
    return json.loads(path.read_text()) if path.exists() else None


def _history_file(serving: ServingParams) -> Path:
    return proxy.active_file(serving).with_name("history.jsonl")


def history(serving: ServingParams) -> list[dict[str, Any]]:
    path = _history_file(serving)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _record(serving: ServingParams, entry: dict[str, Any]) -> None:
    path = _history_file(serving)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps({**entry, "at": datetime.now(UTC).isoformat()}) + "\n")


def society_endpoint(rollouts: RolloutsParams, serving: ServingParams) -> tuple[str, str, int | None]:
    """(OpenAI base URL, key, live routing version) a society's calls go to: ``rollouts.llm_base_url`` when set
    (an external endpoint, no routing), else the proxy with the live version the traces record."""
    base = rollouts.llm_base_url  # load_params has already applied PIPELINE__ROLLOUTS__LLM_BASE_URL
    if base:
        return base, os.environ.get("LLM_API_KEY", "none"), None
    url, key = proxy.client_settings(serving)
    live = active(serving)
    return url, os.environ.get("LLM_API_KEY", key), live["version"] if live else None


def verify(serving: ServingParams, mlflow: MlflowParams, table: dict[str, Any], timeout_s: float = 120.0,
           routing: str | None = None) -> dict[str, str]:
    """One live request per role through the proxy (through evaluation table ``routing`` when given);
    role -> problem for each that failed. A routed policy must load (an MLflow URI from the ``mlflow`` server)."""
    url, key = proxy.client_settings(serving)

    def check(client: httpx.Client, role: str, target: str) -> str | None:
        try:
            resp = client.post(f"{url}/chat/completions", json={
                "model": role, "max_tokens": serving.verify_max_tokens,
                "messages": [{"role": "user", "content": "Reply with OK."}],
                **({"metadata": {"routing": routing}} if routing else {})})
        except httpx.HTTPError as exc:
            return f"{target}: {type(exc).__name__}: {exc}"
        if resp.status_code != 200:
            return f"{target}: HTTP {resp.status_code}: {resp.text[:200]}"
        # LiteLLM echoes the requested name in the body; the headers say which deployment answered.
        group = resp.headers.get("x-litellm-model-group", "")
        served = resp.headers.get("x-litellm-model-name", "").removeprefix("hosted_vllm/")
        if group != target or served != expected_model(serving, target):
            return f"{target}: answered by deployment '{group}' (model '{served}')"
        return None

    roles = table["roles"]
    # the roles' requests side by side: the engine batches them (one at a time they cost ~0.4 s each, at every stage's
    # start and every switch)
    with (httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {key}"}) as client,
          ThreadPoolExecutor(max_workers=max(1, len(roles))) as pool):
        found = dict(zip(roles, pool.map(lambda item: check(client, *item), roles.items()), strict=True))
    problems = {role: problem for role, problem in found.items() if problem is not None}
    for name, uri in (table.get("policies") or {}).items():
        if uri != "llm":
            try:
                from pipeline.bandit.policy import load_policy  # noqa: PLC0415 - imports mlflow (1.3 s): only a routed policy

                if uri.startswith(("models:/", "runs:/")):
                    tracking.setup(mlflow)  # resolve it on the project's tracking server, not MLflow's default store
                load_policy(uri)
            except Exception as exc:
                problems[name] = f"{uri}: {type(exc).__name__}: {exc}"
    return problems


def _activate(serving: ServingParams, table: dict[str, Any] | None) -> None:
    path = proxy.active_file(serving)
    if table is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {**table, "applied_at": time.time()})
    _track(serving, table)


def _track(serving: ServingParams, table: dict[str, Any]) -> None:
    """The live table in ``serving.live_file``, rewritten only when it changes (DVC hashes it: the same routing
    must not look new). The proxy reads the service-state copy; this one says what produced the traces."""
    live = Path(serving.live_file)
    doc = {"version": table["version"], "roles": table["roles"], "policies": table.get("policies") or {}}
    if table.get("prompts"):
        doc["prompts"] = table["prompts"]
        doc[PINS] = table.get(PINS) or {}
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    if not live.exists() or live.read_text() != text:
        write_text(live, text)


def apply(serving: ServingParams, mlflow: MlflowParams, version: int) -> dict[str, Any]:
    """Verify ``version`` through the proxy as an evaluation table, then make it live; on failure the previous
    version stays live."""
    with lock(serving):
        table = load_version(serving, version)
        previous = active(serving)
        if table.get("prompts"):  # every routed prompt exists, renders, and is still the text it was pinned with
            tracking.setup(mlflow)
            now = _pin(table["prompts"], None)
            if changed := [f"{t}: {sha[:12]} -> {now.get(t, '-')[:12]}" for t, sha in (table.get(PINS) or {}).items()
                           if now.get(t) != sha]:
                kept = f"version {previous['version']} stays live" if previous else "no version is live"
                raise RoutingError(f"routing version {version}: prompt text changed since it was pinned "
                                   f"({', '.join(changed)}); {kept}")
        name = f"verify-v{version}"
        write_eval(serving, name, table["roles"], table.get("policies"))
        try:
            problems = verify(serving, mlflow, table, routing=name)
        finally:
            eval_file(serving, name).unlink(missing_ok=True)
        if problems:
            _record(serving, {"version": version, "status": "failed", "problems": problems,
                              "kept": previous and previous["version"]})
            lines = "\n".join(f"  - {role}: {why}" for role, why in problems.items())
            kept = f"version {previous['version']} stays live" if previous else "no version is live"
            raise RoutingError(f"routing version {version} failed verification; {kept}:\n{lines}")
        _activate(serving, table)
        _record(serving, {"version": version, "status": "applied", "previous": previous and previous["version"]})
        return table


def rollback(serving: ServingParams, mlflow: MlflowParams) -> dict[str, Any]:
    """Re-apply the version that was live before the current one."""
    with lock(serving):
        return _rollback(serving, mlflow)


def _rollback(serving: ServingParams, mlflow: MlflowParams) -> dict[str, Any]:
    current = active(serving)
    if current is None:
        raise RoutingError("no routing version is live; nothing to roll back")
    applied = [e["version"] for e in history(serving) if e["status"] == "applied"]
    while applied and applied[-1] == current["version"]:
        applied.pop()
    if not applied:
        raise RoutingError(f"version {current['version']} is the first applied version; nothing to roll back to")
    return apply(serving, mlflow, applied[-1])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["apply", "status", "rollback", "new"])
    parser.add_argument("--version", type=int, help="version to apply (default: the newest)")
    parser.add_argument("--set", action="append", default=[], metavar="ROLE=DEPLOYMENT", help="with `new`: change a role")
    parser.add_argument("--prompt", action="append", default=[], metavar="TEMPLATE=VERSION",
                        help="with `new`: render this Prompt Registry version of a template (society.<TEMPLATE>)")
    parser.add_argument("--description", default="")


def _pairs(items: list[str], flag: str, rule: str, valid: Any = lambda _: True) -> dict[str, str]:
    """``NAME=VALUE`` arguments of ``flag`` as a dict; the first that is not one (or whose value ``valid`` refuses) is
    refused naming it and ``rule``."""
    pairs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not valid(value):
            raise RoutingError(f"{flag} {item!r}: {rule}")
        pairs[name] = value
    return pairs


# whole Params: serving and promote's policy roles
def _planned(params: Params, sets: list[str], prompt_items: list[str]) -> tuple[dict[str, Any], ...]:
    """``route new``'s table, checked and not written: the live one with ``--set ROLE=DEPLOYMENT|POLICY=URI`` and
    ``--prompt TEMPLATE=VERSION`` applied; returns the live table, the roles, the policies and the routed prompts."""
    serving = params.serving
    live = active(serving) or load_version(serving, (versions(serving) or [1])[-1])
    changes = _pairs(sets, "--set", "must be ROLE=DEPLOYMENT or POLICY=URI")
    policy_roles = [n for n, kind in params.promote.roles.items() if kind == "policy"]
    if unknown := [k for k in changes if k not in serving.roles and k not in policy_roles]:
        raise RoutingError(f"--set {unknown[0]}=...: neither a role ({serving.roles}) nor a policy ({policy_roles})")
    roles = {**live["roles"], **{k: v for k, v in changes.items() if k in serving.roles}}
    policies = {**live.get("policies", {}), **{k: v for k, v in changes.items() if k not in serving.roles}}
    numbers = _pairs(prompt_items, "--prompt", "must be TEMPLATE=VERSION (a registered version number)", str.isdigit)
    routed = {**(live.get("prompts") or {}), **{t: int(n) for t, n in numbers.items()}}
    check_table(serving, roles, policies, routed)
    return live, roles, policies, routed


def TRACKING(args: argparse.Namespace) -> bool:  # the CLI's per-module switch (cli.tracks): status reads files only
    return bool(args.action != "status")


def check(args: argparse.Namespace, params: Params) -> None:
    """``route new``'s arguments and table, and a version ``apply`` does not have, refused before any service starts (the
    CLI calls this first)."""
    if args.action == "new":
        _planned(params, args.set, args.prompt)
    if args.action == "apply" and args.version is not None and args.version not in (have := versions(params.serving)):
        raise RoutingError(f"routing version {args.version} does not exist (have {have})")


def main(args: argparse.Namespace, params: Params) -> int:
    """A refusal raises RoutingError, which the CLI prints as one line on stderr (exit 1)."""
    serving = params.serving
    if args.action == "apply":
        version = (versions(serving) or [0])[-1] if args.version is None else args.version
        table = apply(serving, params.mlflow, version)
        print(f"routing version {version} live and verified: {json.dumps(table['roles'])}")
    elif args.action == "rollback":
        table = rollback(serving, params.mlflow)
        print(f"rolled back to routing version {table['version']}: {json.dumps(table['roles'])}")
    elif args.action == "new":
        live, roles, policies, routed = _planned(params, args.set, args.prompt)
        if routed:
            tracking.setup(params.mlflow)  # each routed prompt is looked up and pinned by its text's digest
        number = write_version(serving, roles, args.description, policies, routed, pins_kept(live, routed))
        print(f"wrote {version_path(serving, number)}; apply with `python -m pipeline route apply --version {number}`")
    else:
        print(json.dumps({"active": active(serving), "versions": versions(serving), "history": history(serving)[-5:]},
                         indent=1))
    return 0
