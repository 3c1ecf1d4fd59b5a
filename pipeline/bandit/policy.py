"""The trained supervisor policy: a VW ``--cb_explore_adf`` model behind a small interface.

``BanditPolicy.pmf(question, candidates)`` is all the supervisor needs. Registered in MLflow as a
pyfunc (``SupervisorPolicyModel``) whose ``predict`` returns each row's action distribution, so it
can be loaded from ``models:/supervisor_policy@champion`` like any other registered model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.bandit import features, vw

if TYPE_CHECKING:  # the logged pyfunc imports this module: keep its import surface to the bandit
    from pipeline.config import Params

try:  # the pyfunc base class is only needed where MLflow is installed (control plane)
    from mlflow.pyfunc import PythonModel
except ImportError:  # pragma: no cover - model plane has no MLflow
    PythonModel = object  # type: ignore[assignment,misc]


class BanditPolicy:
    def __init__(self, model_file: str | Path, source: str | None = None) -> None:
        from vowpalwabbit import Workspace

        self.model_file = str(model_file)
        self.source = source or self.model_file
        self._ws = Workspace(f"--quiet -i {self.model_file}")

    def pmf(self, question: str, candidates: list[dict[str, Any]]) -> list[float]:
        context, actions = features.decision_features(question, candidates)
        return vw.pmf(self._ws, context, actions)


class SupervisorPolicyModel(PythonModel):  # type: ignore[misc,valid-type]
    """MLflow pyfunc: input rows with ``question`` and ``candidates`` (list of hypothesis dicts)."""

    def load_context(self, context: Any) -> None:
        self.policy = BanditPolicy(context.artifacts["vw_model"])

    def predict(self, context, model_input, params=None):
        rows = model_input.to_dict("records") if hasattr(model_input, "to_dict") else list(model_input)
        return [self.policy.pmf(str(row["question"]), list(row["candidates"])) for row in rows]


def load_policy(uri: str, params: Params | None = None) -> BanditPolicy:
    """From a ``.vw`` file, an MLflow model folder, or an MLflow URI (``models:/``, ``runs:/``).

    With ``params``, an MLflow URI resolves against the project's tracking server: callers run before
    their stage's MLflow run starts, and without it the client looked in the default store (./mlflow.db)
    and a promoted policy "did not exist" (make run's report)."""
    if params is not None and uri.startswith(("models:/", "runs:/")):
        from pipeline import tracking

        tracking.setup(params)
    path = Path(uri)
    if path.is_file():
        return BanditPolicy(path)
    import mlflow.pyfunc

    if path.is_dir() and not (path / "MLmodel").exists():
        raise FileNotFoundError(f"{uri}: neither a VW model file nor an MLflow model folder (no MLmodel)")
    model = mlflow.pyfunc.load_model(uri)
    policy = model.unwrap_python_model().policy
    policy.source = uri
    return policy
