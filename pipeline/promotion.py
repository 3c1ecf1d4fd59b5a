"""Switch a role to a registered version, crash-safe: the one place the champion alias and the live routing move.

A switch is five steps: deploy the version (hot-load its adapter), write a routing version with the
role pointed at it, apply that version (verified through an evaluation table before it goes live),
move the ``champion`` alias, tag the versions. A process killed between two of them used to leave
the candidate serving under the old champion alias with nothing to reconcile them. Now an *intent*
record (``<serving.home>/routing/intent.json``) is written before the first step and removed after
the last, and :func:`reconcile` (run at the start of ``promote``, ``rollback`` and
``stack.ensure``) finishes or undoes a switch it finds:

- alias already moved to the target: the switch completed; the routing version it applied is made
  live (if it is not) and its tags are written (idempotent), so a retried ``promote`` finds the
  candidate champion with its decision recorded;
- alias not moved: the switch did not happen; the routing that was live before it is restored.

What was switched is appended to the **promotion journal** (``<serving.home>/routing/journal.jsonl``, 0600, one JSON
line per switch, written only here): role, action (promote | rollback), the version made champion and the one it replaced,
each with the ``sha256`` it carried at that moment, and the routing versions. ``rollback`` reads what to go back to from
the journal, never from registry tags (which anyone who reaches the tracking server can write), and refuses a registry
whose champion or digests disagree with it.

Every step of a switch holds the routing lock (``routing.lock``), so two switches (a DAG retry and a
user's rollback) cannot interleave. ``PIPELINE_FAILPOINT=switch.<step>`` kills the process (SIGKILL)
right after that step: the crash tests use it, nothing else sets it.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline import prompt_registry, registry
from pipeline.agents import prompts
from pipeline.config import MlflowParams, ServingParams
from pipeline.contracts import Artifact
from pipeline.io import write_json
from pipeline.services.process import ServiceError
from pipeline.serving import proxy, routing
from pipeline.versions import CHAMPION, Line, VersionError

FAILPOINT_ENV = "PIPELINE_FAILPOINT"
STEPS = ("intent", "deploy", "routing_written", "routing_applied", "alias_moved", "tagged")


class PromotionError(RuntimeError):
    pass


def failpoint(step: str) -> None:
    """Fault injection for crash tests: die here, as a SIGKILL would, when asked to."""
    if os.environ.get(FAILPOINT_ENV) == f"switch.{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def intent_file(serving: ServingParams) -> Path:
    return proxy.active_file(serving).with_name("intent.json")


def pending(serving: ServingParams) -> dict[str, Any] | None:
    path = intent_file(serving)
    return json.loads(path.read_text()) if path.exists() else None


def journal_file(serving: ServingParams) -> Path:
    return proxy.active_file(serving).with_name("journal.jsonl")


MODEL, PROMPT = Artifact.MODEL.value, Artifact.PROMPT.value  # what a switch moved (a journal line's ``kind``)


def journal(serving: ServingParams, line: Line | None = None, kind: str = MODEL) -> list[dict[str, Any]]:
    """The switches of ``line`` recorded so far, oldest first (without a line: every switch of ``kind``). A torn last
    line (a crash mid-append) is skipped; anything else that is not a switch (bytes that are not UTF-8, a line that is
    not an object with a role and a version, a folder in the journal's place) is refused in one line: the journal is
    what rollback and every stage's check trust, so a damaged one must stop them, not be half-read. Entries written
    before prompts could switch carry no kind: they are model switches."""
    path = journal_file(serving)
    if not path.exists():
        return []
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PromotionError(f"{path}: the promotion journal cannot be read ({exc}); {RECOVER}") from None
    lines = text.split("\n")
    entries = []
    for n, text_line in enumerate(lines, 1):
        if not text_line.strip():
            continue
        try:
            entry = json.loads(text_line)
        except json.JSONDecodeError:
            if n == len(lines):  # the last line, without its newline: a crash while it was written
                continue
            raise PromotionError(f"{path}: line {n} is not JSON; {RECOVER}") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("role"), str) or "version" not in entry:
            raise PromotionError(f"{path}: line {n} is not a switch (an object with 'role' and 'version'); {RECOVER}")
        entries.append(entry)
    kind = line.artifact if line is not None else kind
    return [e for e in entries if e.get("kind", MODEL) == kind and (line is None or Line.of_record(e) == line)]


RECOVER = ("restore it from a backup (each switch is also an MLflow `promote` run with its routing version), or move it "
           "aside and point every champion alias back to its baseline with the writer's credentials")


def rolled_back_after(serving: ServingParams, line: Line, when: str | None) -> str | None:
    """The time of the last rollback of ``line`` later than ``when`` (an ISO time; None: evidence of
    unknown age, older than any rollback), else None. Evidence from before a rollback would promote the rolled-back
    version again the moment its champion is back: a rollback must stick until something is evaluated anew."""
    times = [e["time"] for e in journal(serving, line) if e.get("action") == "rollback" and e.get("time")]
    later = [t for t in times if when is None or str(t) > when]
    return max(later) if later else None


def _append(serving: ServingParams, entry: dict[str, Any]) -> None:
    """One line, appended and synced: the journal is never rewritten."""
    path = journal_file(serving)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(entry, sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


APPROVAL = "approval"  # a journal line that records a person's answer, not a switch: no check reads it as one


def record_not_approved(serving: ServingParams, line: Line, version: str, by: str, why: str) -> None:
    """A candidate that passed the gate and was not approved: in the journal beside the switches, nothing switched."""
    _append(serving, {"kind": APPROVAL, "action": "not_approved", "role": line.role, "version": str(version), "by": by,
                      "why": why, "template": line.template, "time": datetime.now(UTC).isoformat(timespec="seconds")})


def _note(serving: ServingParams, intent: dict[str, Any], **update: Any) -> dict[str, Any]:
    intent.update(update)
    write_json(intent_file(serving), intent)
    return intent


def switch(serving: ServingParams, mlflow: MlflowParams, line: Line, to: Any, description: str,
           tags: dict[str, Any] | None = None, record: bool = True) -> int:
    """Serve version ``to`` of ``line`` (a role's model or a prompt it renders): a new routing version, verified and
    applied, then the line's ``champion`` alias moved and ``tags`` written on ``to``; on a failure both stay as they
    were, on a crash :func:`reconcile` settles it. Returns the routing version now live."""
    with routing.lock(serving):
        reconcile(serving, mlflow)
        live = routing.active(serving)
        if live is None:
            raise PromotionError("no routing version is live; start the serving plane first")
        what = f"{line.label} v{to.version}"
        served = line.current(live)  # what the society was served before: what a rollback restores
        previous = line.get(served) if served is not None else None
        intent = _note(serving, {}, id=uuid.uuid4().hex, kind=line.artifact.value, role=line.role, template=line.template,
                       to_version=str(to.version), to_sha256=line.sha256(to), description=description,
                       previous_champion=str(previous.version) if previous is not None else None,
                       previous_sha256=line.sha256(previous) if previous is not None else None,
                       previous_routing=live["version"], new_routing=None, tags=dict(tags or {}), record=record)
        failpoint("intent")
        try:
            table = line.routed(serving, live, to)
            number = routing.write_version(serving, table.roles, description, table.policies, table.prompts, table.pins)
        except (ServiceError, VersionError, routing.RoutingError, OSError) as exc:
            intent_file(serving).unlink(missing_ok=True)
            raise PromotionError(f"{what} could not be deployed: {exc}") from exc
        _note(serving, intent, to_deployment=table.deployment, previous_deployment=table.previous_deployment)
        failpoint("deploy")
        _note(serving, intent, new_routing=number)
        failpoint("routing_written")
        try:
            routing.apply(serving, mlflow, number)
        except routing.RoutingError as exc:
            intent_file(serving).unlink(missing_ok=True)
            raise PromotionError(f"{what}: {exc}") from exc
        failpoint("routing_applied")
        try:
            line.set_alias(CHAMPION, to.version)
        except Exception as exc:
            routing.apply(serving, mlflow, live["version"])
            intent_file(serving).unlink(missing_ok=True)
            raise PromotionError(f"{what}: moving the champion alias failed ({exc}); "
                                 f"routing restored to v{live['version']}") from exc
        failpoint("alias_moved")
        _finish(serving, intent)
        return number


def _finish(serving: ServingParams, intent: dict[str, Any]) -> None:
    """The switch's bookkeeping after the alias moved (idempotent: a reconcile may run it again)."""
    line = Line.of_record(intent)
    tags = dict(intent["tags"])
    if intent["record"]:  # a rollback does not record what it replaced: rolling back twice must not undo itself
        tags.update({"promotion.previous_champion": intent["previous_champion"] or "",
                     "promotion.routing_version": intent["new_routing"],
                     "promotion.previous_routing_version": intent["previous_routing"]})
    if tags:
        line.set_tags(intent["to_version"], tags)
    if not any(e.get("id") == intent.get("id") for e in journal(serving, line)):  # a reconcile may finish twice
        _append(serving, {"id": intent.get("id"), "time": datetime.now(UTC).isoformat(timespec="seconds"),
                          "role": line.role, "action": "promote" if intent["record"] else "rollback",
                          "version": intent["to_version"], "sha256": intent.get("to_sha256"),
                          "previous_version": intent["previous_champion"], "previous_sha256": intent.get("previous_sha256"),
                          "routing_version": intent["new_routing"], "previous_routing": intent["previous_routing"],
                          "deployment": intent.get("to_deployment"), "previous_deployment": intent.get("previous_deployment"),
                          "description": intent.get("description", ""),
                          **({"kind": PROMPT, "template": line.template} if line.template is not None else {})})
    failpoint("tagged")
    intent_file(serving).unlink(missing_ok=True)


def audit(serving: ServingParams, roles: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Where the registry disagrees with the journal: a role whose champion alias, champion digest or champion
    deployment is not what the journal's last switch of that role made it; a role of ``roles`` whose champion is a
    version other than its baseline although the journal records no switch of it (the journal was removed or its line torn: roles
    never switched are on their baselines); a prompt whose champion alias moved outside promote/rollback."""
    lasts = {Line.of_record(e): e for kind in (MODEL, PROMPT) for e in journal(serving, kind=kind)}  # each line's last switch
    found = _unswitched_roles(serving, [r for r in roles if Line(r) not in lasts])
    for line, last in lasts.items():
        champion = line.champion()
        if problem := (moved(line, last, champion) or
                       line.drift(serving, champion, last.get("sha256"), last.get("deployment"), "made it champion")):
            found.append(problem)
    return found + _unswitched_prompts({line.template for line in lasts if line.template is not None})


def moved(line: Line, last: dict[str, Any], champion: Any | None) -> str | None:
    """Why ``champion`` is not the version the journal's ``last`` switch of ``line`` made champion (None: it is)."""
    if champion is not None and str(champion.version) == str(last["version"]):
        return None
    return (f"{line.label}: the {line.store}'s champion is v{champion.version if champion else '-'}, but the promotion "
            f"journal's last switch made v{last['version']} champion: the {line.store} was changed outside promote/rollback")


BASELINE = "1"  # registry.ensure_baselines registers it first: a role no switch touched has it as champion


def _unswitched_roles(serving: ServingParams, roles: list[str]) -> list[str]:
    """A role the journal records no switch of is on its baseline; another champion means the journal was removed or
    its line torn."""
    found = []
    for role in roles:
        champion = registry.by_alias(role, registry.CHAMPION)
        if champion is not None and str(champion.version) != BASELINE:
            found.append(f"{role}: the registry's champion is v{champion.version}, not its baseline v{BASELINE}, but the "
                         f"promotion journal {journal_file(serving)} records no switch of {role} (missing or torn); "
                         f"{RECOVER}")
    return found


def _unswitched_prompts(switched: set[str]) -> list[str]:
    """A template no switch touched keeps the champion its first registration got, a version of the repository's text;
    an alias moved elsewhere was moved outside promote/rollback (rollback would read it)."""
    found = []
    unswitched = [t for t in prompts.TEMPLATES if t not in switched]
    for template, champion in prompt_registry.aliased(prompt_registry.CHAMPION, unswitched).items():
        if champion is not None and champion.tags.get("source") != prompt_registry.SOURCE:
            found.append(f"prompt {template}: the Prompt Registry's champion is v{champion.version}, an optimizer's "
                         "version no promotion made champion (promotion journal): the alias was moved outside "
                         "promote/rollback")
    return found


def check(serving: ServingParams, roles: list[str] | tuple[str, ...] = ()) -> None:
    """Refuse to serve from a registry the journal disagrees with, naming each disagreement and the way out."""
    if found := audit(serving, roles):
        raise PromotionError("; ".join(found) + f" (the record is {journal_file(serving)}: point the alias back with "
                             "the writer's credentials; a registry started afresh needs that journal moved aside)")


def reconcile(serving: ServingParams, mlflow: MlflowParams) -> str | None:
    """Finish or undo a switch a crash interrupted; what was done (None: nothing pending)."""
    with routing.lock(serving):  # the intent is read under the lock: a switch in flight is not taken for a crashed one
        intent = pending(serving)
        if intent is None:
            return None
        found = Line.of_record(intent).champion()
        champion = str(found.version) if found is not None else None
        live = routing.active(serving)
        if champion is not None and champion == intent["to_version"]:
            if intent["new_routing"] is not None and (live is None or live["version"] != intent["new_routing"]):
                routing.apply(serving, mlflow, intent["new_routing"])
            _finish(serving, intent)
            done = (f"completed the interrupted switch of {intent['role']} to v{intent['to_version']} "
                    f"(routing v{intent['new_routing']})")
        else:
            if live is None or live["version"] != intent["previous_routing"]:
                routing.apply(serving, mlflow, intent["previous_routing"])
            intent_file(serving).unlink(missing_ok=True)
            done = (f"undid the interrupted switch of {intent['role']} to v{intent['to_version']}: "
                    f"routing v{intent['previous_routing']} and champion v{champion or '-'} kept")
    print(f"reconcile: {done}")
    return done
