"""The society's prompt templates as versions in MLflow's Prompt Registry (the first step of issue #43).

Each template of ``pipeline.agents.prompts.TEMPLATES`` is the registered prompt ``society.<name>``. :func:`sync`
registers the repository's text as a new version whenever it differs from the newest one (a template changed in the
repo becomes a new version, never an edit of one already used), tags it with its ``sha``, points ``champion`` at the
first version a prompt gets, and tells ``prompts`` which version each template's text is, so every LLM span names
it (``prompt_version``). Stages that run the society call it once at start (rollouts, evaluate, report).
"""

from __future__ import annotations

from pipeline.agents import prompts
from pipeline.config import MlflowParams

PREFIX = "society."
CHAMPION = "champion"


def registered_name(template: str) -> str:
    return PREFIX + template


def sync(mlflow_cfg: MlflowParams) -> dict[str, int]:
    """Every template registered as it reads now; returns (and records in ``prompts``) template -> version."""
    import mlflow.genai  # noqa: PLC0415 - control plane only; 1 s import

    from pipeline import tracking  # noqa: PLC0415 - control plane only

    tracking.setup(mlflow_cfg)
    versions: dict[str, int] = {}
    for template, text in prompts.TEMPLATES.items():
        name = registered_name(template)
        latest = mlflow.genai.load_prompt(f"prompts:/{name}@latest", allow_missing=True, link_to_model=False)
        if latest is None or latest.template != text:
            latest = mlflow.genai.register_prompt(
                name, text, commit_message=f"pipeline/agents/prompts.py at sha {prompts.sha(template)}",
                tags={"sha": prompts.sha(template), "source": "pipeline/agents/prompts.py"})
        if mlflow.genai.load_prompt(f"prompts:/{name}@{CHAMPION}", allow_missing=True, link_to_model=False) is None:
            mlflow.genai.set_prompt_alias(name, CHAMPION, latest.version)
        versions[template] = int(latest.version)
    prompts.VERSIONS.update(versions)
    return versions
