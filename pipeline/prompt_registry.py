"""The society's prompt templates as versions in MLflow's Prompt Registry, and the routed version of each (#43).

Each template of ``pipeline.agents.prompts.TEMPLATES`` is the registered prompt ``society.<name>``. :func:`sync`
registers the repository's text as a new version whenever it differs from the newest one (a template changed in the
repo becomes a new version, never an edit of one already used), tags it with its ``sha``, points ``champion`` at the
first version a prompt gets, and returns what a society renders as a value (``prompts.Prompts``: each template's text
and its version, which every LLM span names as ``prompt_version``). Stages that run the society call it once at start
(rollouts, evaluate, report, train_prompt) with the live routing table and hand the value to the society's client: a
routing version may name, per template, a registered version (``prompts:``), whose text the society then renders
instead of the repository's, after checking it against the digest it was registered with.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipeline.agents import prompts
from pipeline.config import MlflowParams

PREFIX = "society."
CHAMPION = "champion"
CHALLENGER = "challenger"  # an optimizer's proposal, evaluated with the role's champion weights (evaluate)
FRESH: dict[str, Any] = {"link_to_model": False, "cache_ttl_seconds": 0}  # aliases move and tags are written after registration
SOURCE = "pipeline/agents/prompts.py"  # the ``source`` tag of a version registered from the repository's text
REPOSITORY = "repository"  # the newest version registered from pipeline/agents/prompts.py (optimizers register others)


def registered_name(template: str) -> str:
    return PREFIX + template


class PromptError(RuntimeError):
    pass


def sync(mlflow_cfg: MlflowParams, table: dict[str, Any] | None = None) -> prompts.Prompts:
    """Every template registered as it reads now; returns what a society routed by ``table`` renders: the versions
    its ``prompts`` name (checked against their pinned digests), the repository's text of every other template."""
    from pipeline import tracking  # noqa: PLC0415 - control plane only

    tracking.setup(mlflow_cfg)
    held = _held()
    versions = {t: _repository_version(t, text, held.get(registered_name(t))) for t, text in prompts.TEMPLATES.items()}
    return routed(table, prompts.Prompts(versions=versions))


def routed(table: dict[str, Any] | None, rendered: prompts.Prompts = prompts.REPOSITORY) -> prompts.Prompts:
    """``rendered`` with every template the routing ``table`` names replaced by that version's checked text. It only
    reads, so the RL trainer's rollout workers (a process a rollout, many at once) render what the society is routed
    to without registering anything; the tracking client must be set up."""
    for template, number in ((table or {}).get("prompts") or {}).items():
        rendered = rendered.with_text(template, _routed_text(template, number, table or {}), int(number))
    return rendered


def _repository_version(template: str, text: str, held: Any | None) -> int:
    """The version holding the repository's ``text`` of ``template`` (``held``: its prompt as :func:`_held` read it): a
    new one when the text changed (a template changed in the repo is a new version, never an edit of one already
    used); the first version is the champion."""
    import mlflow.genai  # noqa: PLC0415 - control plane only; 1 s import

    name = registered_name(template)
    aliases, newest = (dict(held.aliases) if held is not None else {}), _newest(held)
    number = aliases.get(REPOSITORY) or (newest.version if newest is not None else None)
    current = _version(template, held, number) if number is not None else None
    if current is None or current.template != text:
        sha = prompts.digest(text)
        current = mlflow.genai.register_prompt(name, text, commit_message=f"pipeline/agents/prompts.py at sha {sha}",
                                               tags={"sha": sha, "source": SOURCE})
    version = int(current.version)
    if aliases.get(REPOSITORY) != str(version):
        mlflow.genai.set_prompt_alias(name, REPOSITORY, version)
    # the first version is the champion; later only promotion and rollback move it (their journal records it)
    if CHAMPION not in aliases:
        mlflow.genai.set_prompt_alias(name, CHAMPION, version)
    return version


def _held() -> dict[str, Any]:
    """Every society prompt as the registry holds it now, read in one request: name -> its registered model (its
    aliases, its newest version with text and tags). MLflow's ``load_prompt`` makes four or five requests a version,
    which made each stage's :func:`sync` and each serving check ~150 requests (seconds on a busy host, #54)."""
    from mlflow import MlflowClient  # noqa: PLC0415 - control plane only
    from mlflow.prompt.constants import IS_PROMPT_TAG_KEY  # noqa: PLC0415

    client, held, token = MlflowClient(), {}, None
    while True:
        page = client.search_registered_models(filter_string=f"tags.`{IS_PROMPT_TAG_KEY}` = 'true' AND name LIKE "
                                               f"'{PREFIX}%'", max_results=1000, page_token=token)
        held.update({m.name: m for m in page})
        if not (token := page.token):
            return held


def _newest(held: Any | None) -> Any | None:
    """The newest version of a prompt :func:`_held` read (None: no such prompt, or no version yet)."""
    return max(held.latest_versions, key=lambda v: int(v.version)) if held is not None and held.latest_versions else None


def _version(template: str, held: Any | None, number: int | str) -> Any | None:
    """Version ``number`` of ``template``: from ``held`` when it is the newest there (no request), else the registry's."""
    newest = _newest(held)
    if newest is not None and str(newest.version) == str(number):
        from mlflow.prompt.registry_utils import model_version_to_prompt_version  # noqa: PLC0415 - control plane only

        return model_version_to_prompt_version(newest)
    return load(template, int(number))


def aliased(alias: str, templates: Iterable[str]) -> dict[str, Any | None]:
    """Each of ``templates``' version under ``alias`` (None where there is none), read as :func:`_held` reads: one
    request, and one more for each such version that is not its prompt's newest."""
    held = _held()
    found: dict[str, Any | None] = {}
    for template in templates:
        model = held.get(registered_name(template))
        number = model.aliases.get(alias) if model is not None else None
        found[template] = _version(template, model, number) if number is not None else None
    return found


def _routed_text(template: str, number: int, table: dict[str, Any]) -> str:
    """The text of version ``number`` of ``template`` that routing ``table`` names, once it is the text the table pinned
    (a registry writer can replace a version's text and its tag together) and the one registered under its ``sha``."""
    import mlflow.genai  # noqa: PLC0415 - control plane only

    routed = mlflow.genai.load_prompt(f"prompts:/{registered_name(template)}/{number}", allow_missing=True, **FRESH)
    where = f"prompt {registered_name(template)} v{number}"
    if routed is None:
        raise PromptError(f"{where}: routed by routing version {table.get('version')}, but not in the Prompt Registry")
    sha, pinned = prompts.digest(routed.template), (table.get("prompt_sha256") or {}).get(template)
    if pinned is not None and sha != pinned:
        raise PromptError(f"{where}: its text hashes to {sha}, but routing version {table.get('version')} pinned "
                          f"{pinned}: the registry's text was changed; not rendered")
    if routed.tags.get("sha") != sha:
        raise PromptError(f"{where}: its text hashes to {sha}, but it was registered as {routed.tags.get('sha')}")
    return str(routed.template)


def pin(template: str, number: int | str) -> str:
    """The digest of version ``number`` of ``template``, once it is found, its ``sha`` tag is its text's and its fields
    are the society's: what a routing version pins it by."""
    found = load(template, int(number))
    if found is None:
        raise PromptError(f"prompt {registered_name(template)} v{number}: not in the Prompt Registry")
    sha = prompts.digest(found.template)
    if found.tags.get("sha") != sha:
        raise PromptError(f"prompt {registered_name(template)} v{number}: its text hashes to {sha}, but it was registered "
                          f"as {found.tags.get('sha')}")
    check_fields(template, str(found.template))
    return sha


def register(mlflow_cfg: MlflowParams, template: str, text: str, message: str, tags: dict[str, str] | None = None) -> int:
    """A new version of ``template`` (an optimizer's proposal): its fields must be the repository template's, so the
    society can render it; returns the version number."""
    import mlflow.genai  # noqa: PLC0415 - control plane only; 1 s import

    from pipeline import tracking  # noqa: PLC0415 - control plane only

    check_fields(template, text)
    tracking.setup(mlflow_cfg)
    version = mlflow.genai.register_prompt(registered_name(template), text, commit_message=message,
                                           tags={**(tags or {}), "sha": prompts.digest(text)})
    return int(version.version)


def check_fields(template: str, text: str) -> None:
    """A version of ``template`` must have the fields the society fills, no more, no fewer."""
    import string  # noqa: PLC0415

    fields = {f for _, f, _, _ in string.Formatter().parse(text) if f}
    need = {f for _, f, _, _ in string.Formatter().parse(prompts.TEMPLATES[template]) if f}
    if fields != need:
        raise PromptError(f"prompt {template}: fields {sorted(fields)}, but the society fills {sorted(need)}")


def load(template: str, ref: str | int) -> Any | None:
    """The version ``ref`` (a number, or ``@alias``) of ``template``'s prompt; None when there is none."""
    import mlflow.genai  # noqa: PLC0415 - control plane only

    where = f"@{ref[1:]}" if isinstance(ref, str) and ref.startswith("@") else f"/{ref}"
    return mlflow.genai.load_prompt(f"prompts:/{registered_name(template)}{where}", allow_missing=True, **FRESH)


def set_alias(template: str, alias: str, version: int | str) -> None:
    import mlflow.genai  # noqa: PLC0415 - control plane only

    mlflow.genai.set_prompt_alias(registered_name(template), alias, int(version))


def delete_alias(template: str, alias: str) -> None:
    import mlflow.genai  # noqa: PLC0415 - control plane only

    if load(template, f"@{alias}") is not None:
        mlflow.genai.delete_prompt_alias(registered_name(template), alias)


def set_tags(template: str, version: int | str, tags: dict[str, Any]) -> None:
    import mlflow.genai  # noqa: PLC0415 - control plane only

    for key, value in tags.items():
        mlflow.genai.set_prompt_version_tag(registered_name(template), version, key, str(value))


def rendered(table: dict[str, Any] | None, template: str) -> int | None:
    """The version of ``template`` the society renders under routing ``table``: the one it routes, else the newest
    repository version (what :func:`sync` makes the society render); None before any sync."""
    number = ((table or {}).get("prompts") or {}).get(template)
    if number is not None:
        return int(number)
    repo = load(template, f"@{REPOSITORY}")
    return int(repo.version) if repo is not None else None
