"""Which weights answered an evaluation: every LLM span of the evaluated role must name the candidate's deployment.

A LoRA deployment's name carries the sha256 prefix ``deploy`` verified (``pipeline.digest``), and each span
records the deployment the proxy says answered (``x-litellm-model-group``) and that digest. A comparison
whose candidate calls were answered by anything else (a stale routing file, a cached adapter of the same
name, a fallback) compares the wrong model: the evaluation fails rather than report it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pipeline.digest import served_digest


def served_by(traces: list[Any], role: str) -> Counter[tuple[str | None, str | None]]:
    """(deployment, digest) -> number of successful calls of ``role`` in ``traces``."""
    seen: Counter[tuple[str | None, str | None]] = Counter()
    for trace in traces:
        for span in trace.spans:
            d = span.data
            if span.kind == "llm" and d.get("logical_model") == role and d.get("ok"):
                seen[(d.get("deployment"), d.get("digest"))] += 1
    return seen


def check_served(traces: list[Any], role: str, version: str, deployment: str) -> int:
    """Raise naming what answered when any call of ``role`` was not served by ``deployment`` (and its digest);
    returns the calls checked."""
    seen = served_by(traces, role)
    want = (deployment, served_digest(deployment))
    wrong = {k: n for k, n in seen.items() if k != want}
    if wrong:
        found = ", ".join(f"{dep or '?'} (sha256 {dig or '-'}) x{n}" for (dep, dig), n in wrong.items())
        raise RuntimeError(f"{role} v{version} was evaluated as {deployment} (sha256 {want[1] or '-'}), "
                           f"but {sum(wrong.values())} of its calls were answered by {found}: "
                           "the comparison would not be of this version")
    return sum(seen.values())
