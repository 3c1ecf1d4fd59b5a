"""Inference of the trained supervisor policy, self-contained: the standard library, ``vowpalwabbit``
and this package's ``features`` module (MLflow only for the pyfunc base class, where installed).

It is the code a registered ``supervisor_policy`` version carries with it: ``train_bandit`` logs this
file and ``features.py`` as a package in the model's ``code/`` folder (``mlflow_model.py`` imports it
from there), so ``mlflow.pyfunc.load_model("models:/supervisor_policy/<n>")`` works in any process
with MLflow and VW, without this repository. Keep it that way: no import of ``pipeline.*`` here, only
relative imports of modules that are logged with it (``train_bandit.CODE_FILES``).

The decision path (``pipeline.bandit.policy.load_policy``) uses ``BanditPolicy`` directly on the
downloaded ``.vw`` artifact and never runs a registered version's code.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from vowpalwabbit import Workspace

from . import features

try:  # the pyfunc base class is only needed where MLflow is installed (control plane)
    from mlflow.pyfunc import PythonModel
except ImportError:  # pragma: no cover - model plane has no MLflow
    PythonModel = object  # type: ignore[assignment,misc]


# The ADF lines of a decision, unlabelled. ``pipeline.bandit.vw`` writes the same lines (plus the label) for
# training with these two functions (imported from here, the module that travels with the model).
def _shared(context: dict[str, Any]) -> str:
    words = " ".join(f"w_{w}" for w in context.get("q_words", []))
    return f"|s q_len:{float(context.get('q_len', 0.0))} {words}".rstrip()


def _action(action: dict[str, Any]) -> str:
    return (f"|a author={action['author']} overlap:{float(action['overlap'])} n_pmids:{int(action['n_pmids'])} "
            f"h_len:{float(action['h_len'])}")


def adf_lines(context: dict[str, Any], actions: Sequence[dict[str, Any]]) -> list[str]:
    return [f"shared {_shared(context)}", *(_action(a) for a in actions)]


def pmf(ws: Any, context: dict[str, Any], actions: Sequence[dict[str, Any]]) -> list[float]:
    """The policy's probability for each candidate, in candidate order (sums to 1)."""
    probs = [float(p) for p in ws.predict(adf_lines(context, actions))]
    total = sum(probs)
    return [p / total for p in probs] if total > 0 else [1.0 / len(actions)] * len(actions)


class BanditPolicy:
    def __init__(self, model_file: str | Path, source: str | None = None) -> None:
        self.model_file = str(model_file)
        self.source = source or self.model_file
        self.sha256: str | None = None  # set by the loader: the digest of the file read
        self.version: str | None = None  # set by the loader: the registered version, if any
        self._ws = Workspace(f"--quiet -i {self.model_file}")

    def pmf(self, question: str, candidates: list[dict[str, Any]]) -> list[float]:
        context, actions = features.decision_features(question, candidates)
        return pmf(self._ws, context, actions)


class SupervisorPolicyModel(PythonModel):  # type: ignore[misc,valid-type]
    """MLflow pyfunc: input rows with ``question`` and ``candidates`` (list of hypothesis dicts)."""

    def load_context(self, context: Any) -> None:
        self.policy = BanditPolicy(context.artifacts["vw_model"])

    # a DataFrame hint: the logged signature and input example are what MLflow checks inputs against
    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[list[float]]:
        rows = model_input.to_dict("records") if hasattr(model_input, "to_dict") else list(model_input)
        return [self.policy.pmf(str(row["question"]), [dict(c) for c in row["candidates"]]) for row in rows]
