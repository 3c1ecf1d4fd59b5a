"""`python -m pipeline <command>`: what a refusal looks like to the person who ran it (fast, no services)."""

from __future__ import annotations

import sys
import types

import pytest

from pipeline import cli
from pipeline.registry import RegistryError
from pipeline.serving.routing import RoutingError
from pipeline.versions import VersionError


@pytest.mark.parametrize("error", [RegistryError, VersionError, RoutingError])
def test_a_registry_version_or_routing_refusal_ends_in_one_line(error: type[Exception], monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture) -> None:
    """A candidate whose artifact no longer matches its digest (deploy's RegistryError), a version the journal does not
    know (VersionError), a routing table that cannot be served: `evaluate` or `report` says so in one line, exit 1."""
    why = "senior_researcher v3: the registry's artifact has sha256 ab12, its sha256 tag says cd34"

    def main(args: object, params: object) -> int:
        raise error(why)

    module = types.ModuleType("refusing_command")
    module.add_arguments, module.main, module.TRACKING = (lambda parser: None), main, False  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "refusing_command", module)
    monkeypatch.setitem(cli.COMMANDS, "evaluate", ("refusing_command", "refuses"))
    assert cli.main(["evaluate"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {why}"]


def test_a_trainers_unknown_role_is_refused_before_any_service_starts(project, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """A typo in --role ends in one line naming the params' list, and leaves no MLflow server behind."""
    import socket

    from pipeline.services.process import free_port

    port = free_port()
    monkeypatch.setenv("PIPELINE__MLFLOW__PORT", str(port))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train-sft", "--role", "judge"])
    assert str(exit_.value) == "error: --role 'judge': sft.roles in params.yaml lists ['junior_researcher']"
    assert not (project / ".mlflow").exists()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens there
