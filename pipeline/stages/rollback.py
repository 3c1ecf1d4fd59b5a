"""``python -m pipeline rollback ROLE``: give a role back the champion it had before the last promotion.

The version a promotion replaced is read from the promotion journal (``pipeline/promotion.py``), never from registry
tags: the champion must be the one the journal's last switch of the role made, and the version to go back to must
still carry the digest it had when it was replaced. Rollback routes the role back to it through a new routing version
(applied and verified like any other, so later promotions of other roles are kept) and moves ``champion`` back.
``rollback ROLE --prompt`` does the same for the prompt version the role renders: the same code, another
:class:`~pipeline.versions.Line`.
"""

from __future__ import annotations

import argparse
import sys

from pipeline import tracking
from pipeline.config import MlflowParams, Params, PromptParams, ServingParams
from pipeline.contracts import Status
from pipeline.promotion import PromotionError, journal, moved, reconcile, switch
from pipeline.serving import stack
from pipeline.versions import Line


def rollback(serving: ServingParams, mlflow: MlflowParams, line: Line) -> tuple[str, str, int]:
    """``line``'s version before its last promotion, back (from the journal, its digest checked); returns (from
    version, to version, routing version now live)."""
    reconcile(serving, mlflow)  # a promotion a crash interrupted is settled first: "the previous champion" must be the real one
    found = line.champion()
    current = str(found.version) if found is not None else None
    entries = journal(serving, line)
    if found is not None and entries and (problem := moved(line, entries[-1], found)):
        raise PromotionError(problem)
    made = next((e for e in reversed(entries) if e["action"] == "promote" and str(e["version"]) == current), None)
    if current is None or made is None or not made.get("previous_version"):
        raise PromotionError(f"{line.label}: champion v{current or '?'} was not put there by a promotion (promotion "
                             "journal); nothing to roll back")
    was, previous = str(made["version"]), str(made["previous_version"])
    target = line.get(previous)
    if target is None:
        raise PromotionError(f"{line.label} v{previous}: not in the {line.store}")
    if problem := line.drift(serving, target, made.get("previous_sha256"), made.get("previous_deployment"),
                             "recorded it as champion"):
        raise PromotionError(problem)
    number = switch(serving, mlflow, line, target, f"rollback {line.label} v{was} -> v{previous}", record=False)
    line.set_tags(was, {"promotion.decision": Status.ROLLED_BACK.value})
    return was, previous, number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("role", help="registered model of the role, e.g. junior_researcher")
    parser.add_argument("--prompt", nargs="?", const="", default=None, metavar="TEMPLATE",
                        help="roll back the prompt version the role renders instead of its model (TEMPLATE: the one "
                             "prompt.roles.<role>.template names when the role learns by prompt)")


def _template(args: argparse.Namespace, prompt: PromptParams) -> str | None:
    learner = prompt.roles.get(args.role)
    return args.prompt or (learner.template if learner else None)


def check(args: argparse.Namespace, params: Params) -> None:
    """Refuse an unknown role or a prompt without its template before any service starts (the CLI calls this first)."""
    if args.prompt is None and args.role not in params.promote.roles:
        raise PromotionError(f"unknown role {args.role!r}; trainable roles are {list(params.promote.roles)}")
    if args.prompt is not None and _template(args, params.prompt) is None:
        raise PromotionError(f"{args.role}: name the template (--prompt TEMPLATE); prompt.roles lists "
                             f"{list(params.prompt.roles)}")


def main(args: argparse.Namespace, params: Params) -> int:
    try:  # the CLI ran check(args, params) before starting anything
        stack.ensure(params.serving, params.mlflow)
        tracking.setup(params.mlflow)
        line = Line(args.role, _template(args, params.prompt) if args.prompt is not None else None)
        was, now, number = rollback(params.serving, params.mlflow, line)
    except PromotionError as exc:
        print(f"error: rollback failed, champion alias and live routing unchanged: {exc}", file=sys.stderr)
        return 1
    print(f"rollback: {args.role} {line.label if line.template else 'champion'} v{was} -> v{now}; routing version "
          f"{number} live")
    return 0
