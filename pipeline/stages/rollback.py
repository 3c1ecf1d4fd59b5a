"""``python -m pipeline rollback ROLE``: give a role back the champion it had before the last promotion.

The version a promotion replaced is read from the promotion journal (``pipeline/promotion.py``), never from registry
tags: the champion must be the one the journal's last switch of the role made, and the version to go back to must
still carry the digest it had when it was replaced. Rollback routes the role back to it through a new routing version
(applied and verified like any other, so later promotions of other roles are kept) and moves ``champion`` back.
``rollback ROLE --prompt`` does the same for the prompt version the role renders (its journal entries, its alias).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipeline import prompt_registry, registry, tracking
from pipeline.agents import prompts
from pipeline.config import MlflowParams, Params, PromoteParams, ServingParams
from pipeline.promotion import PROMPT, PromotionError, journal, reconcile, switch, switch_prompt
from pipeline.serving import routing, stack


def _promotion_of(entries: list[dict[str, Any]], current: str | None, what: str, store: str) -> dict[str, Any]:
    """The journal entry of the promotion that made ``current`` champion; refused when the store's champion is not the
    one the journal's last switch made, or no promotion made it."""
    if current is not None and entries and str(entries[-1]["version"]) != current:
        raise PromotionError(f"{what}: the {store}'s champion is v{current}, but the promotion journal's last switch made "
                             f"v{entries[-1]['version']} champion: the {store} was changed outside promote/rollback")
    made = next((e for e in reversed(entries) if e["action"] == "promote" and str(e["version"]) == current), None)
    if current is None or made is None or not made.get("previous_version"):
        raise PromotionError(f"{what} v{current or '?'} was not put there by a promotion (promotion journal); "
                             "nothing to roll back")
    return made


def rollback(serving: ServingParams, mlflow: MlflowParams, promote: PromoteParams, name: str) -> tuple[str, str, int]:
    """Returns (from version, to version, routing version now live)."""
    reconcile(serving, mlflow)  # a promotion a crash interrupted is settled first: "the previous champion" must be the real one
    if name not in promote.roles:
        raise PromotionError(f"unknown role {name!r}; trainable roles are {list(promote.roles)}")
    current = registry.by_alias(name, registry.CHAMPION)
    made = _promotion_of(journal(serving, name), current and str(current.version), f"{name}: champion", "registry")
    was, previous = str(made["version"]), str(made["previous_version"])
    target = registry.get_version(name, previous)
    if target.tags.get(registry.SHA256_TAG) != made.get("previous_sha256"):
        raise PromotionError(f"{name} v{previous}: sha256 {target.tags.get(registry.SHA256_TAG)} in the registry, but "
                             f"{made.get('previous_sha256')} when the promotion journal recorded it as champion")
    # a base version has no digest: what it routed to is the journal's record, never its (writable) `deployment` tag
    live = routing.active(serving) or {}
    where = registry.target(serving, name, target, (live.get("roles") or {}).get(name))
    if made.get("previous_deployment") and where != made["previous_deployment"]:
        raise PromotionError(f"{name} v{previous}: the registry would route it to {where}, but the promotion journal "
                             f"recorded {made['previous_deployment']} when it was replaced")
    number = switch(serving, mlflow, promote, name, target,
                    f"rollback {name} v{was} -> v{previous}", record=False)
    registry.set_tags(name, was, {"promotion.decision": "rolled_back"})
    return was, previous, number


def rollback_prompt(serving: ServingParams, mlflow: MlflowParams, name: str, template: str) -> tuple[str, str, int]:
    """The prompt version ``name`` rendered before the last promotion of ``template``, back (from the journal, its
    digest checked); returns (from version, to version, routing version now live)."""
    reconcile(serving, mlflow)
    current = prompt_registry.load(template, f"@{prompt_registry.CHAMPION}")
    made = _promotion_of(journal(serving, name, PROMPT, template), current and str(current.version),
                         f"{name}: prompt {template}", "Prompt Registry")
    was, previous = str(made["version"]), str(made["previous_version"])
    target = prompt_registry.load(template, previous)
    sha = prompts.digest(str(target.template)) if target is not None else None
    if target is None or sha != made.get("previous_sha256") or target.tags.get("sha") != sha:
        raise PromotionError(f"prompt {template} v{previous}: its text hashes to {sha}, but the promotion journal recorded "
                             f"{made.get('previous_sha256')} when it was replaced")
    number = switch_prompt(serving, mlflow, name, template, target,
                           f"rollback prompt {template} v{was} -> v{previous}", record=False)
    prompt_registry.set_tags(template, was, {"promotion.decision": "rolled_back"})
    return was, previous, number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("role", help="registered model of the role, e.g. junior_researcher")
    parser.add_argument("--prompt", nargs="?", const="", default=None, metavar="TEMPLATE",
                        help="roll back the prompt version the role renders instead of its model (TEMPLATE: the one "
                             "prompt.roles.<role>.template names when the role learns by prompt)")


def main(args: argparse.Namespace, params: Params) -> int:
    learner = params.prompt.roles.get(args.role)
    template = args.prompt or (learner.template if learner else None)
    try:
        stack.ensure(params.serving, params.mlflow)
        tracking.setup(params.mlflow)
        if args.prompt is not None:
            if template is None:
                raise PromotionError(f"{args.role}: name the template (--prompt TEMPLATE); prompt.roles lists "
                                     f"{list(params.prompt.roles)}")
            was, now, number = rollback_prompt(params.serving, params.mlflow, args.role, template)
        else:
            was, now, number = rollback(params.serving, params.mlflow, params.promote, args.role)
    except PromotionError as exc:
        print(f"error: rollback failed, champion alias and live routing unchanged: {exc}", file=sys.stderr)
        return 1
    what = f"prompt {template}" if args.prompt is not None else "champion"
    print(f"rollback: {args.role} {what} v{was} -> v{now}; routing version {number} live")
    return 0
