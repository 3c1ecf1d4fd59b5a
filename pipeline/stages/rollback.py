"""``python -m pipeline rollback ROLE``: give a role back the champion it had before the last promotion.

The version a promotion replaced is recorded on the promoted version (``promotion.previous_champion``);
rollback routes the role back to it through a new routing version (applied and verified like any
other, so later promotions of other roles are kept) and moves ``champion`` back.
"""

from __future__ import annotations

import argparse
import sys

from pipeline import registry, tracking
from pipeline.config import MlflowParams, Params, PromoteParams, ServingParams
from pipeline.promotion import PromotionError, reconcile, switch
from pipeline.serving import stack


def rollback(serving: ServingParams, mlflow: MlflowParams, promote: PromoteParams, name: str) -> tuple[str, str, int]:
    """Returns (from version, to version, routing version now live)."""
    reconcile(serving, mlflow)  # a promotion a crash interrupted is settled first: "the previous champion" must be the real one
    if name not in promote.roles:
        raise PromotionError(f"unknown role {name!r}; trainable roles are {list(promote.roles)}")
    current = registry.by_alias(name, registry.CHAMPION)
    previous = current and current.tags.get("promotion.previous_champion")
    if current is None or not previous:
        raise PromotionError(f"{name}: champion v{current.version if current else '?'} was not put there by a promotion; "
                             "nothing to roll back")
    number = switch(serving, mlflow, promote, name, registry.get_version(name, previous),
                    f"rollback {name} v{current.version} -> v{previous}", record=False)
    registry.set_tags(name, current.version, {"promotion.decision": "rolled_back"})
    return current.version, previous, number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("role", help="registered model of the role, e.g. junior_researcher")


def main(args: argparse.Namespace, params: Params) -> int:
    stack.ensure(params.serving, params.mlflow)
    tracking.setup(params.mlflow)
    try:
        was, now, number = rollback(params.serving, params.mlflow, params.promote, args.role)
    except PromotionError as exc:
        print(f"error: rollback failed, champion alias and live routing unchanged: {exc}", file=sys.stderr)
        return 1
    print(f"rollback: {args.role} champion v{was} -> v{now}; routing version {number} live")
    return 0
