"""Register an A/A candidate: a role's champion again under another version (alias ``aa``), for the gate to refuse.

``evaluate`` scores it beside the role's challenger and ``promote`` decides it by the same rules, first; a gate that
promotes it promotes noise. ``make learn`` registers one for the PI every cycle.
"""

from __future__ import annotations

import argparse

from pipeline import registry, tracking
from pipeline.config import Params
from pipeline.promotion import PromotionError
from pipeline.serving import stack


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("role", help="a registered role of promote.roles (e.g. principal_investigator)")


def check(args: argparse.Namespace, params: Params) -> None:
    """An unknown role, refused before any service starts (the CLI calls this first)."""
    if args.role not in params.promote.roles:
        raise PromotionError(f"{args.role!r} is not a trainable role (promote.roles: {sorted(params.promote.roles)})")


def main(args: argparse.Namespace, params: Params) -> int:
    stack.ensure(params.serving, params.mlflow)
    with tracking.stage_run("register_aa", params.mlflow):
        version = registry.register_aa(params, args.role)
    print(f"register-aa: {args.role} v{version.version} = champion v{version.tags['aa_of']}'s artifact, alias {registry.AA}")
    return 0
