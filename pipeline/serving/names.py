"""What a routing table may name: one pattern each, shared by ``route new``, promotion, the proxy's router and the
adapter store, so a name that reaches a path or a routing file is checked the same way everywhere before it is written."""

from __future__ import annotations

import re

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a worker or an adapter: never '..', '/', or a shell character
EVAL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,80}")  # an evaluation routing table (a file name beside the live one)
POLICY = re.compile(r"llm|models:/[A-Za-z0-9][A-Za-z0-9._-]{0,127}(/[0-9]+|@[A-Za-z0-9_-]{1,64})")


class BadName(ValueError):
    """A name a routing table or a path may not hold."""


def check_target(target: str) -> str:
    """``worker`` or ``worker/adapter``, each part a :data:`NAME`; returns it or raises naming the rule."""
    worker, sep, adapter = str(target).partition("/")
    if not NAME.fullmatch(worker) or (sep and not NAME.fullmatch(adapter)):
        raise BadName(f"deployment {target!r}: must be WORKER or WORKER/ADAPTER, each matching {NAME.pattern}")
    return str(target)


def check_policy(value: str) -> str:
    """A policy's routing value: ``llm`` or an MLflow model URI (``models:/NAME/VERSION`` or ``models:/NAME@ALIAS``)."""
    if not POLICY.fullmatch(str(value)):
        raise BadName(f"policy {value!r}: must be 'llm' or models:/NAME/VERSION or models:/NAME@ALIAS")
    return str(value)
